"""A SkyRL config (its Hydra YAML: ``trainer:``, ``generator:``, ...; key=value overrides; or a launch script
running ``-m skyrl_train.entrypoints.main_base key=value ...``) in klgrpo's terms, by the rules of each skyrl-train
release range (``skyrl_train.json``, read from NovaSky-AI/SkyRL at every tag).

The KL, the same in every release read: ``trainer.algorithm.use_kl_loss`` (true by default) adds kl_loss_coef
(0.001) x the estimator's per-sequence token mean, averaged over sequences, to the loss, without an importance
weight (k3, the default, clamped: the forward KL's gradient, clipped at 10); ``use_kl_in_reward`` (exclusive with
it) subtracts the coefficient x the estimator at the rollout policy from each token's reward, which grpo sums into
the sequence's score before the group normalisation (verl's placement).
"""

from __future__ import annotations

import json
import math
from functools import lru_cache
from pathlib import Path
from typing import Any

from klgrpo.apps.explain.frameworks import Release, releases, table
from klgrpo.errors import ConfigError
from klgrpo.integrations.mapping import Mapped

A = "trainer.algorithm."
AGGREGATIONS = {"token_mean": "token_mean", "sequence_mean": "seq_mean_token_mean",
                "seq_mean_token_sum_norm": "constant"}
ESTIMATORS = {"k1": "k1", "k2": "k2", "k3": "k3", "abs": None}
#: trainer.algorithm keys that shape the policy term or the samples, named when set.
NOT_MAPPED = ("dynamic_sampling.type", "use_tis", "tis_imp_ratio_cap", "off_policy_correction.",
              "use_entropy_loss", "advantage_batch_normalize", "zero_variance_filter", "overlong_buffer_len",
              "overlong_buffer.")
#: Keys this mapping reads.
READ = {A + name for name in (
    "advantage_estimator", "kl_ctrl.type", "kl_ctrl.kl_target", "kl_ctrl.horizon", "kl_estimator_type",
    "use_kl_in_reward", "use_kl_loss", "kl_loss_coef", "policy_loss_type", "loss_reduction", "grpo_norm_by_std",
    "eps_clip_low", "eps_clip_high", "clip_ratio_c", "use_kl_estimator_k3", "use_abs_kl")} | {
    "trainer.train_batch_size", "trainer.policy_mini_batch_size", "trainer.update_epochs_per_batch",
    "generator.n_samples_per_prompt", "generator.sampling_params.top_p", "generator.sampling_params.top_k",
    "generator.sampling_params.min_p"}


def is_skyrl(data: dict) -> bool:
    """SkyRL's trainer and generator groups at the top level."""
    return {"trainer", "generator"} <= {str(key) for key in data}


def is_skyrl_overrides(values: dict) -> bool:
    return any(str(key).startswith(("generator.", A)) for key in values)


def newest() -> Release:
    return releases("skyrl_train")[-1]


def _number(v: dict, key: str, origin: str) -> float:
    value = v.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{origin}: {key} must be a finite number, got {value!r}")
    return float(value)


def _flag(v: dict, key: str, origin: str) -> bool:
    value = v.get(key)
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if not isinstance(value, bool):
        raise ConfigError(f"{origin}: {key} must be true or false, got {value!r}")
    return value


def map_skyrl(values: dict[str, Any], origin: str, release: Release | None = None) -> Mapped:
    """SkyRL's dotted keys -> klgrpo keys under ``release``'s rules (None: the newest); unset keys take
    ppo_base_config.yaml's values of that release."""
    release = release or newest()
    row, label = release.release or {}, release.label
    for key in values:
        if key in row["defaults"] or key not in {A + "use_kl_estimator_k3", A + "use_abs_kl"}:
            continue
        from klgrpo.integrations.versions import NotInRange

        raise NotInRange(f"{origin}: {key} is not a key of {label} (removed in 0.4.0: use "
                         f"{A}kl_estimator_type); pass the release you run, e.g. --version skyrl_train==0.3.0")
    v = {**row["defaults"], **values}
    out = Mapped()
    for key, value in values.items():
        name = key[len(A):] if key.startswith(A) else ""
        if key not in READ and name.startswith(NOT_MAPPED) and value not in (False, None, 0, 0.0, -1, -1.0, "null"):
            out.unmapped[key] = "not read by the mapping: check that it does not change the objective"
        elif key not in READ:
            out.ignored.append(key)
    group = int(_number(v, "generator.n_samples_per_prompt", origin))
    batch = _number(v, "trainer.train_batch_size", origin)
    mini = _number(v, "trainer.policy_mini_batch_size", origin) or batch
    epochs = int(_number(v, "trainer.update_epochs_per_batch", origin))
    updates = batch / mini
    out.off_policy = epochs > 1 or updates > 1
    out.config.update({"rollout.group_size": group, "rollout.prompts_per_step": int(batch),
                       "train.num_iterations": epochs})
    if updates > 1:
        out.unmapped["trainer.policy_mini_batch_size"] = (
            f"{updates:g} updates per batch on different prompts; klgrpo updates once per batch per iteration "
            "(train.num_iterations): the off-policy verdict holds for SkyRL's later mini-batches")
    _map_policy(v, origin, out)
    _map_kl(v, row, label, origin, out)
    return out


def _map_policy(v: dict, origin: str, out: Mapped) -> None:
    reduction = v[A + "loss_reduction"]
    if reduction not in AGGREGATIONS:
        raise ConfigError(f"{origin}: {A}loss_reduction {reduction!r} is none of SkyRL's ({', '.join(AGGREGATIONS)})")
    policy = v[A + "policy_loss_type"]
    mapped = {"regular": "ppo_clip", "dual_clip": "ppo_clip", "gspo": "gspo"}.get(policy)
    out.config.update({"loss.eps_low": _number(v, A + "eps_clip_low", origin),
                       "loss.eps_high": _number(v, A + "eps_clip_high", origin),
                       "loss.aggregation": AGGREGATIONS[reduction]})
    if mapped is None:
        out.unmapped[A + "policy_loss_type"] = f"{policy!r}: not mapped (klgrpo's policy term below is ppo_clip)"
        mapped = "ppo_clip"
    out.config["loss.policy_loss"] = mapped
    out.config["loss.dual_clip"] = _number(v, A + "clip_ratio_c", origin) if policy == "dual_clip" else 0.0
    estimator = v[A + "advantage_estimator"]
    if estimator != "grpo":
        out.unmapped[A + "advantage_estimator"] = (
            f"{estimator!r}: klgrpo's advantages are group-relative rewards (SkyRL's grpo); the config below "
            "centres the rewards without dividing")
    scale = "group" if estimator == "grpo" and _flag(v, A + "grpo_norm_by_std", origin) else "none"
    out.config.update({"loss.advantage_scale": scale, "loss.std_eps": 1e-6, "loss.std_ddof": 1})


def _estimator(v: dict, row: dict, origin: str) -> str:
    name = v[A + "kl_estimator_type"]
    for flag, forced in row.get("deprecated", {}).items():  # validate_cfg: use_abs_kl first, then the k3 flag
        if _flag(v, flag, origin):
            name = forced
            break
    if name not in ESTIMATORS:
        raise ConfigError(f"{origin}: {A}kl_estimator_type {name!r} is none of SkyRL's (k1, k2, k3, abs): "
                          "compute_approx_kl raises ValueError")
    return name


def _map_kl(v: dict, row: dict, label: str, origin: str, out: Mapped) -> None:
    loss_on, reward_on = _flag(v, A + "use_kl_loss", origin), _flag(v, A + "use_kl_in_reward", origin)
    if loss_on and reward_on:
        raise ConfigError(f"{origin}: {A}use_kl_loss and {A}use_kl_in_reward are both true; SkyRL refuses it "
                          "(validate_cfg: they are mutually exclusive)")
    coef = _number(v, A + "kl_loss_coef", origin)
    name = _estimator(v, row, origin)
    if (loss_on or reward_on) and coef > 0 and ESTIMATORS[name] is None:
        raise ConfigError(f"{origin}: {A}kl_estimator_type abs (|log pi - log ref|): klgrpo has no such estimator "
                          "and explain computes no verdict for it")
    estimator = ESTIMATORS[name] or "k3"
    on = loss_on or reward_on
    out.config.update({"kl.coef": coef if on else 0.0, "kl.estimator": estimator,
                       "kl.placement": "reward" if reward_on else "loss", "kl.is_correction": "none",
                       "kl.controller": "fixed", "kl.log_ratio_clamp": 20.0,
                       "kl.shaping": "clip" if estimator == "k3" and loss_on else "none"})
    if estimator == "k3" and loss_on:
        out.config["kl.clip_threshold"] = 10.0
    if reward_on:
        adv = v[A + "advantage_estimator"]
        # grpo and rloo sum the token rewards into the sequence's score before the baseline; reinforce++ sums them
        # to the end of the sequence (and whitens the batch)
        out.config["kl.reward_mode"] = "reward_to_go" if adv == "reinforce++" else "sequence_score"
        if adv == "reinforce++":
            out.unmapped[A + "advantage_estimator"] = (
                "'reinforce++': the returns (the reward KL summed to the end) are whitened over the batch: the KL's "
                "beta is divided by their std; klgrpo does not whiten")
        if v[A + "kl_ctrl.type"] == "adaptive":
            out.config.update({"kl.controller": "adaptive", "kl.target": _number(v, A + "kl_ctrl.kl_target", origin),
                               "kl.horizon": _number(v, A + "kl_ctrl.horizon", origin),
                               "kl.kl_measure": "token_mean"})
        if estimator == "k3":
            out.unmapped[A + "kl_estimator_type"] = ("k3 in the reward: SkyRL clamps its value to [-10, 10]; klgrpo's "
                                                     "reward KL is not clamped (equal below 10)")
    if loss_on and coef > 0 and v[A + "loss_reduction"] != "sequence_mean":
        out.unmapped[A + "loss_reduction"] = (
            f"{v[A + 'loss_reduction']}: the policy term's; SkyRL's KL loss is each sequence's token mean averaged "
            "over sequences (seq-mean-token-mean) whatever loss_reduction, klgrpo's takes loss.aggregation: the "
            "token verdict is the same, the KL's weighting of long completions differs")
    if not on and coef > 0:
        out.unmapped[A + "kl_loss_coef"] = f"{coef:g} with use_kl_loss and use_kl_in_reward false: no KL term"
        out.kl_off = f"{A}use_kl_loss and {A}use_kl_in_reward are false, so {A}kl_loss_coef {coef:g} is never read"


@lru_cache(maxsize=None)
def _key_table() -> dict[str, Any]:
    """skyrl_train_keys.json (tools/skyrl_keys.py): each Hydra config key -> the skyrl-train releases that have it."""
    return json.loads((Path(__file__).with_name("skyrl_train_keys.json")).read_text(encoding="utf-8"))


def _has_key(key: str, release: str) -> bool:
    table = _key_table()
    if release in table["keys"].get(key, ()):
        return True
    parts = key.split(".")  # inside a subtree whose contents are free at that release
    return any(release in table["open"].get(".".join(parts[:i]), ()) for i in range(1, len(parts)))


def check_keys_at_releases(keys: list[str], clauses: list, origin: str) -> None:
    """With ``--version`` clauses for skyrl_train: refused in one line where no release they allow has every key
    the script overrides without ``+`` (Hydra's struct config stops such a run at once). Releases the key table does
    not know are not judged."""
    if not clauses:
        return
    from klgrpo.integrations.versions.clauses import specifier_set

    allowed = [r for r in _key_table()["read"] if specifier_set(clauses).contains(r, prereleases=True)]
    if not allowed:
        return
    missing = {release: next((k for k in keys if not _has_key(k, release)), None) for release in allowed}
    if any(key is None for key in missing.values()):
        return
    release = allowed[-1]
    key = missing[release]
    having = _key_table()["keys"].get(key, [])
    where = (f"skyrl-train {having[0] if len(having) == 1 else having[0] + ' to ' + having[-1]} have it; pass the "
             f"release you run, e.g. --version skyrl_train=={having[-1]}" if having else
             f"no skyrl-train release has it: add it with +{key}=... or, for the renamed package skyrl, leave "
             "--version out")
    from klgrpo.integrations.versions import NotInRange

    raise NotInRange(f"{origin}: {key} is not a key of skyrl-train {release}'s config, so Hydra stops the run at "
                     f"once ({where})")


def entry_points() -> tuple[str, ...]:
    return tuple(table("skyrl_train")["entry_points"])
