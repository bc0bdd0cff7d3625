"""A ROLL RLVR pipeline config (flat keys beside ``actor_train:``, ``actor_infer:``, ``reference:``, ...) in klgrpo's
terms, by the rules of each ROLL release range (``roll.json``, read from alibaba/ROLL at every tag).

ROLL has two KL terms: ``use_kl_loss`` adds kl_loss_coef x k3 (clamped to [-10, 10], no importance weight: the
forward KL's gradient) to the loss, aggregated by ``loss_agg_mode``; ``add_token_level_kl`` subtracts the KL
controller's beta (``init_kl_coef``; adaptive with ``target_kl``) x ``kl_penalty``'s estimate at the rollout policy
from each token's reward after the response-level normalisation, summed to the end (klgrpo's reward_to_go).
``init_kl_coef`` alone (its default is 0.2) loads the reference and logs the KL but adds none. A
``generating_args`` block samples with top_p 0.7 and top_k 50 where it leaves them unset.

Keys per release (``roll_keys.json``, tools/roll_keys.py): ROLL's loader (dacite's ``from_dict``, not strict) drops
a key its release's dataclasses lack without a word, so explain does too (naming those the verdict would read), and
refuses, with ``--version``, only a mapping under a field the release holds as a plain value: dacite's type check
stops such a run.
"""

from __future__ import annotations

import json
import math
from functools import lru_cache
from pathlib import Path
from typing import Any

from packaging.version import Version

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
             "whiten_rewards", "add_len_reward", "rl_loss_coef", "train_infer_correction", "use_opd", "is_pure_opd",
             "reward_norm", "reward_shift", "reward_scale")
AGENTIC = ("custom_envs", "train_env_manager", "val_env_manager")
#: The on-policy distillation launcher's keys: it builds the config with dacite's type check off (not judged).
DISTILL = ("is_pure_opd", "pure_opd_pipeline_type", "teacher", "student_train", "student_infer")


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
    out = Mapped()
    values = _drop_missing(values, release, out)
    v = {**row["defaults"], **values}
    estimator = v["adv_estimator"]
    if estimator not in row["adv_estimators"]:
        raise NotInRange(f"{origin}: adv_estimator {estimator!r} is none of {label}'s "
                         f"({', '.join(row['adv_estimators'])}); pass the release you run, e.g. --version roll==0.3.0")
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


def _drop_missing(values: dict[str, Any], release: Release, out: Mapped) -> dict[str, Any]:
    """The file's keys without those of the mapping (READ) or of the objective (OBJECTIVE) that no release of the
    range has: ROLL drops them (dacite, not strict) and so does the verdict; named where set to something other
    than the range's default or off."""
    tags = [t for t in _key_table()["read"]
            if Version(t) >= release.low and (release.high is None or Version(t) < release.high)]
    if not tags:
        return values
    kept = {}
    for key, value in values.items():
        watched = key in READ or key.split(".")[0] in OBJECTIVE
        if not watched or any(_judge(key, tag) is None for tag in tags):
            kept[key] = value
            continue
        default = release.defaults.get(key, None)
        if value != default and value not in (False, None, 0, 0.0, "", "none"):
            span = tags[0] if len(tags) == 1 else f"{tags[0]} to {tags[-1]}"
            out.unmapped[key] = (f"not a field of ROLL {span}'s config: its loader (dacite's from_dict, not strict) "
                                 "drops it without a word, so the run, and the verdict here, go on without it")
        else:
            out.ignored.append(key)
    return kept


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
    unread = [f"{key} {_number(v, key, origin):g}" for key in ("kl_loss_coef", "init_kl_coef")
              if _number(v, key, origin) > 0]
    if not loss_on and not (reward_on and beta > 0) and unread:
        out.kl_off = (f"use_kl_loss and add_token_level_kl are false, so {' and '.join(unread)} "
                      f"{'add' if len(unread) > 1 else 'adds'} no KL (ROLL's defaults where unset)")
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


@lru_cache(maxsize=None)
def _key_table() -> dict[str, Any]:
    """roll_keys.json (tools/roll_keys.py): each RLVR config key -> the ROLL releases whose dataclasses have it."""
    return json.loads((Path(__file__).with_name("roll_keys.json")).read_text(encoding="utf-8"))


def _judge(key: str, release: str) -> tuple[str, str] | None:
    """None where ``release``'s config has ``key`` (or it lies in a field whose contents are free); ("dropped",
    path): its shortest path the dataclasses lack (dacite drops it); ("refused", path): a mapping under ``path``,
    a plain value there (dacite's type check stops the run)."""
    table = _key_table()
    parts = key.split(".")
    for end in range(1, len(parts) + 1):
        path = ".".join(parts[:end])
        if release in table["open"].get(path, ()):
            return None
        if release not in table["keys"].get(path, ()):
            return "dropped", path
        if end < len(parts) and release not in table["nested"].get(path, ()):
            return "refused", path
    return None


def _has_key(key: str, release: str) -> bool:
    return _judge(key, release) is None


def check_keys_at_releases(keys: list[str], clauses: list, origin: str) -> None:
    """With ``--version`` clauses for roll: refused in one line where every release they allow stops on the file's
    keys, a mapping under a field that release holds as a plain value (dacite's type check: WrongTypeError). A key
    the release's dataclasses lack is not refused: ROLL drops it (``_drop_missing`` names those the verdict reads).
    Releases the key table does not know, and the distillation launcher's configs, are not judged."""
    if not clauses or any(key.split(".")[0] in DISTILL for key in keys):
        return
    from klgrpo.integrations.versions.clauses import specifier_set

    allowed = [r for r in _key_table()["read"] if specifier_set(clauses).contains(r, prereleases=True)]
    if not allowed:
        return
    refused = {release: _refused(keys, release) for release in allowed}
    if any(found is None for found in refused.values()):
        return
    release = allowed[-1]
    key, path = refused[release]
    having = [r for r in _key_table()["read"] if _has_key(key, r)]
    where = (f"ROLL {having[0] if len(having) == 1 else having[0] + ' to ' + having[-1]} have it; pass the release "
             f"you run, e.g. --version roll=={having[-1]}" if having else "no ROLL release read has it")
    raise NotInRange(f"{origin}: {key} is not a key of ROLL {release}'s config: {path} is a plain value there, not a "
                     f"mapping, so its loader (dacite's type check) stops the run at once ({where})")


def _refused(keys: list[str], release: str) -> tuple[str, str] | None:
    """The first key ``release`` refuses, with the plain-valued path it lies under."""
    for key in keys:
        judged = _judge(key, release)
        if judged is not None and judged[0] == "refused":
            return key, judged[1]
    return None
