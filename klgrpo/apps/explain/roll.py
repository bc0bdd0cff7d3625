"""A ROLL RLVR pipeline config (flat keys beside ``actor_train:``, ``actor_infer:``, ``reference:``, ...) in klgrpo's
terms, by the rules of each ROLL release range (``roll.json``, read from alibaba/ROLL at every tag).

ROLL has two KL terms: ``use_kl_loss`` adds kl_loss_coef x k3 (clamped to [-10, 10], no importance weight: the
forward KL's gradient) to the loss, aggregated by ``loss_agg_mode``; ``add_token_level_kl`` subtracts the KL
controller's beta (``init_kl_coef``; adaptive with ``target_kl``) x ``kl_penalty``'s estimate at the rollout policy
from each token's reward after the response-level normalisation, summed to the end (klgrpo's reward_to_go).
``init_kl_coef`` alone (its default is 0.2) loads the reference and logs the KL but adds none. A
``generating_args`` block samples with top_p 0.7 and top_k 50 where it leaves them unset.
"""

from __future__ import annotations

import math
from typing import Any

from klgrpo.apps.explain.frameworks import Release, releases
from klgrpo.apps.explain.nemo_rl import flatten
from klgrpo.errors import ConfigError
from klgrpo.integrations.mapping import Mapped
from klgrpo.integrations.versions import NotInRange

__all__ = ["flatten", "is_roll", "map_roll"]

#: loss_agg_mode -> klgrpo's loss.aggregation (verl's names, the same formulas).
AGGREGATIONS = {"token-mean": "token_mean", "seq-mean-token-mean": "seq_mean_token_mean",
                "seq-mean-token-sum": "seq_mean_token_sum", "seq-mean-token-sum-norm": "constant"}
#: kl_penalty -> klgrpo's estimator (None: no counterpart).
ESTIMATORS = {"kl": "k1", "mse": "k2", "abs": None, "full": None}
READ = ("init_kl_coef", "target_kl", "kl_horizon", "kl_penalty", "add_token_level_kl", "use_kl_loss", "kl_loss_coef",
        "loss_agg_mode", "adv_estimator", "gamma", "whiten_advantages", "norm_mean_type", "norm_std_type",
        "ppo_epochs", "pg_clip", "use_pg_clip_range", "pg_clip_low", "pg_clip_high", "dual_clip_loss",
        "num_return_sequences_in_group", "rollout_batch_size", "reward_clip", "lambd",
        "actor_infer.generating_args.top_p", "actor_infer.generating_args.top_k")
#: Top-level keys that change the objective and are not mapped: named when set to something other than off.
OBJECTIVE = ("advantage_clip", "difficulty_mask", "max_len_mask", "error_max_len_clip", "difficulty_loss_weight",
             "length_loss_weight", "entropy_loss_coef", "importance_sampling", "use_reward_scaling", "use_reward_norm",
             "whiten_rewards", "add_len_reward", "rl_loss_coef", "train_infer_correction", "use_opd", "is_pure_opd")
AGENTIC = ("custom_envs", "train_env_manager", "val_env_manager")


def is_roll(data: dict) -> bool:
    """ROLL's worker groups actor_train and actor_infer at the top level."""
    return {"actor_train", "actor_infer"} <= {str(key) for key in data}


def newest() -> Release:
    return releases("roll")[-1]


def _number(v: dict, key: str, origin: str) -> float:
    value = v.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{origin}: {key} must be a finite number, got {value!r}")
    return float(value)


def _flag(v: dict, key: str, origin: str) -> bool:
    value = v.get(key)
    if not isinstance(value, bool):
        raise ConfigError(f"{origin}: {key} must be true or false, got {value!r}")
    return value


def map_roll(values: dict[str, Any], origin: str, release: Release | None = None) -> Mapped:
    """ROLL's keys (flattened) -> klgrpo keys under ``release``'s rules (None: the newest); absent keys take the
    config dataclasses' defaults of that release."""
    release = release or newest()
    row, label = release.release or {}, release.label
    if set(values) & set(AGENTIC) or any(k.split(".")[0] in AGENTIC for k in values):
        raise ConfigError(f"{origin}: a ROLL agentic pipeline config ({', '.join(AGENTIC)}); explain reads ROLL's "
                          "RLVR pipeline (examples/*rlvr*)")
    v = {**row["defaults"], **values}
    estimator = v["adv_estimator"]
    if estimator not in row["adv_estimators"]:
        raise NotInRange(f"{origin}: adv_estimator {estimator!r} is none of {label}'s "
                         f"({', '.join(row['adv_estimators'])}); pass the release you run, e.g. --version roll==0.3.0")
    out = Mapped()
    _name_the_rest(values, out)
    group = int(_number(v, "num_return_sequences_in_group", origin))
    epochs = int(_number(v, "ppo_epochs", origin))
    out.off_policy = epochs > 1
    out.config.update({"rollout.group_size": group, "train.num_iterations": epochs})
    if "rollout_batch_size" in v:
        out.config["rollout.prompts_per_step"] = int(_number(v, "rollout_batch_size", origin))
    out.unmapped["actor_train.training_args"] = (
        "ROLL splits each rollout batch into backward batches of per_device_train_batch_size x "
        "gradient_accumulation_steps x the data-parallel size (the device mapping's): several per batch make the "
        "later updates off-policy, which explain cannot count from the file")
    _map_policy(v, origin, out)
    _map_advantages(v, estimator, origin, out)
    _map_kl(v, label, origin, out)
    _map_sampling(out)
    return out


def _name_the_rest(values: dict[str, Any], out: Mapped) -> None:
    for key, value in values.items():
        top = key.split(".")[0]
        if key in READ:
            continue
        if top in OBJECTIVE and value not in (False, None, 0, 0.0, "", "none"):
            out.unmapped[key] = "not read by the mapping: check that it does not change the objective"
        else:
            out.ignored.append(key)


def _map_policy(v: dict, origin: str, out: Mapped) -> None:
    ranged = _flag(v, "use_pg_clip_range", origin)
    low = _number(v, "pg_clip_low" if ranged else "pg_clip", origin)
    high = _number(v, "pg_clip_high" if ranged else "pg_clip", origin)
    mode = v["loss_agg_mode"]
    if mode not in AGGREGATIONS:
        raise ConfigError(f"{origin}: loss_agg_mode {mode!r} is none of ROLL's ({', '.join(AGGREGATIONS)})")
    out.config.update({"loss.policy_loss": "ppo_clip", "loss.eps_low": low, "loss.eps_high": high,
                       "loss.aggregation": AGGREGATIONS[mode]})
    if _flag(v, "dual_clip_loss", origin):
        # ROLL's dual clip bound is 1 + 2 x pg_clip (actor_worker.py), not verl's clip_ratio_c
        out.config["loss.dual_clip"] = 1 + 2 * _number(v, "pg_clip", origin)


def _map_advantages(v: dict, estimator: str, origin: str, out: Mapped) -> None:
    std = v.get("norm_std_type")
    if estimator == "grpo":
        std = "group"  # reward_postprocess sets both norm types to group for grpo
    elif estimator == "gae":
        out.unmapped["adv_estimator"] = ("'gae': advantages from a critic (GAE); klgrpo's are group-relative "
                                         "rewards: the config below centres the rewards without dividing")
    elif v.get("norm_mean_type") is None:
        out.unmapped["norm_mean_type"] = (f"null: {estimator} subtracts no baseline from the rewards; klgrpo's "
                                          "advantages are centred (the policy term differs, the KL term does not)")
    out.config["loss.advantage_scale"] = {"group": "group", "batch": "batch"}.get(std, "none")
    if _flag(v, "whiten_advantages", origin):
        out.unmapped["whiten_advantages"] = (
            "ROLL whitens the advantages over the batch: a KL in the rewards has its beta divided by their std; "
            "klgrpo does not whiten")


def _map_kl(v: dict, label: str, origin: str, out: Mapped) -> None:
    loss_on = _flag(v, "use_kl_loss", origin) and _number(v, "kl_loss_coef", origin) > 0
    reward_on = _flag(v, "add_token_level_kl", origin)
    beta = _number(v, "init_kl_coef", origin)
    penalty = v["kl_penalty"]
    if penalty not in ESTIMATORS:
        raise ConfigError(f"{origin}: kl_penalty {penalty!r} is none of ROLL's (kl, abs, mse, full): its config "
                          "loader (dacite) refuses it")
    if reward_on and beta > 0 and ESTIMATORS[penalty] is None:
        what = ("applies F.kl_div to the sampled tokens' log-probs only, pi(y) (log pi(y) - log ref(y)), summed over "
                "the positions: not the KL over the vocabulary" if penalty == "full" else "is |log pi - log ref|")
        raise ConfigError(f"{origin}: kl_penalty {penalty} with add_token_level_kl: {label}'s compute_approx_kl "
                          f"{what}; klgrpo has no such estimator and explain computes no verdict for it")
    target = v.get("target_kl")
    reward = {"coef": beta, "estimator": ESTIMATORS.get(penalty) or "k1", "placement": "reward",
              "is_correction": "none", "reward_mode": "reward_to_go", "shaping": "none"}
    loss = {"coef": _number(v, "kl_loss_coef", origin) if loss_on else 0.0, "estimator": "k3", "placement": "loss",
            "is_correction": "none", "reward_mode": "reward_to_go", "shaping": "clip", "clip_threshold": 10.0}
    main = loss if loss_on or not (reward_on and beta > 0) else reward
    out.config.update({f"kl.{k}": val for k, val in main.items()})
    out.config["kl.controller"] = "fixed"
    if main is reward and target is not None:
        out.config.update({"kl.controller": "adaptive", "kl.target": _number(v, "target_kl", origin),
                           "kl.horizon": _number(v, "kl_horizon", origin), "kl.kl_measure": "token_mean"})
    if main is loss and reward_on and beta > 0:
        out.extra_kl.append({k: val for k, val in reward.items()})
        out.unmapped["add_token_level_kl"] = (
            f"klgrpo has one KL term: ROLL's reward KL ({penalty}, beta {beta:g}"
            + (", adaptive" if target is not None else "") + ") beside its loss KL (k3, "
            f"{loss['coef']:g}) is left out of the config below; the verdict includes both")
    if not reward_on and beta > 0:
        out.unmapped["init_kl_coef"] = (
            f"{beta:g} without add_token_level_kl: ROLL loads the reference and logs its KL (critic/kl) but adds "
            "none to the rewards")
    if reward_on and v.get("reward_clip") not in (None, 0):
        out.unmapped["reward_clip"] = (f"ROLL clips each token's reward, KL included, to +-{v['reward_clip']}: "
                                       "the reward KL's gradient is cut where it binds")
    gamma = _number(v, "gamma", origin)
    if reward_on and beta > 0 and gamma != 1:
        out.unmapped["gamma"] = f"{gamma:g}: ROLL discounts the later tokens' KL; klgrpo sums it undiscounted"


def _map_sampling(out: Mapped) -> None:
    """actor_infer.generating_args top_p / top_k (0.7 / 50 where a generating_args block leaves them unset) are
    truncation.py's (the risk line, klgrpo's rollout keys): never listed as ignored."""
    for key in ("actor_infer.generating_args.top_p", "actor_infer.generating_args.top_k"):
        if key in out.ignored:
            out.ignored.remove(key)
