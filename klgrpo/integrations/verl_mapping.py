"""verl's PPO/GRPO trainer config in klgrpo's vocabulary (``klgrpo explain``).

Names and defaults are those of verl's ``verl/trainer/config/_generated_ppo_trainer.yaml`` and
``verl/trainer/ppo/core_algos.py`` at 0.8.0.dev (git describe v0.7.0-125-gb178a3cd5, January 2026); docs/explain.md
lists them and derives each formula. :func:`map_verl` takes the config as dotted keys
(``actor_rollout_ref.actor.kl_loss_type``) with verl's defaults for what is absent.

What decides the KL changed across verl releases: the KL defaults, when the KL goes into the reward and each
estimator's value and gradient come from klgrpo/integrations/versions/verl.json, the row of the release range
the config is mapped under (the newest row without one), never from a copy here.

verl has two KL terms: ``use_kl_loss`` puts ``kl_loss_coef * agg(k(l))`` into the actor loss (no importance
weight, the policy loss's aggregation), ``use_kl_in_reward`` subtracts ``kl_ctrl.kl_coef * k(l_old)`` per token
from the token-level scores, which GRPO's outcome advantage sums over the sequence before the group
normalisation (klgrpo's ``kl.reward_mode sequence_score``). klgrpo's config has one KL term; when both are on with
different estimators or coefficients, the reward term goes into ``Mapped.extra_kl`` and ``unmapped``.
"""

from __future__ import annotations

import math
from typing import Any

from klgrpo.errors import ConfigError
from klgrpo.integrations.mapping import FieldMapping, Mapped, drop_unread_kl_keys
from klgrpo.integrations.versions import NotInRange, RewardKL, RLRange, newest, rl_profiles

VERL_VERSION = "0.8.0.dev (v0.7.0-125-gb178a3cd5)"
ACTOR = "actor_rollout_ref.actor."
ALGORITHM = "algorithm."
#: The newest range's KL defaults (verl.json): the table's defaults below.
_KL = newest("verl").defaults

VERL_FIELDS = (
    FieldMapping(ACTOR + "use_kl_loss", ("kl.placement",), _KL[ACTOR + "use_kl_loss"], "true: the KL enters the loss"),
    FieldMapping(ACTOR + "kl_loss_coef", ("kl.coef",), _KL[ACTOR + "kl_loss_coef"], "beta of the loss KL"),
    FieldMapping(ACTOR + "kl_loss_type", ("kl.estimator", "kl.shaping", "kl.clip_threshold"),
                 _KL[ACTOR + "kl_loss_type"],
                 "kl, k1: k1; mse, k2: k2; low_var_kl, k3: k3 with kl.shaping clip at 10; abs and the names "
                 "ending in +: none (verl.json's estimators, per release)"),
    FieldMapping(ALGORITHM + "use_kl_in_reward", ("kl.placement", "kl.reward_mode"),
                 _KL[ALGORITHM + "use_kl_in_reward"],
                 "true: the KL enters the reward, summed into the sequence's score (sequence_score)"),
    FieldMapping(ALGORITHM + "kl_penalty", ("kl.estimator",), _KL[ALGORITHM + "kl_penalty"],
                 "the reward KL's estimator, as kl_loss_type"),
    FieldMapping(ALGORITHM + "kl_ctrl.type", ("kl.controller",), _KL[ALGORITHM + "kl_ctrl.type"],
                 "fixed or adaptive (reward KL only)"),
    FieldMapping(ALGORITHM + "kl_ctrl.kl_coef", ("kl.coef",), _KL[ALGORITHM + "kl_ctrl.kl_coef"],
                 "beta of the reward KL"),
    FieldMapping(ALGORITHM + "kl_ctrl.target_kl", ("kl.target",), _KL[ALGORITHM + "kl_ctrl.target_kl"],
                 "adaptive: the target KL"),
    FieldMapping(ALGORITHM + "kl_ctrl.horizon", ("kl.horizon",), _KL[ALGORITHM + "kl_ctrl.horizon"],
                 "adaptive: the horizon in samples"),
    FieldMapping(ALGORITHM + "adv_estimator", ("loss.advantage_scale",), "gae",
                 "grpo: group-normalised rewards (std_eps 1e-6, ddof 1); gae and the others: none"),
    FieldMapping(ALGORITHM + "norm_adv_by_std_in_grpo", ("loss.advantage_scale",), True,
                 "true: group, false: none"),
    FieldMapping(ACTOR + "clip_ratio", ("loss.eps_low", "loss.eps_high"), 0.2, "when clip_ratio_low/high are unset"),
    FieldMapping(ACTOR + "clip_ratio_low", ("loss.eps_low",), 0.2, "same value"),
    FieldMapping(ACTOR + "clip_ratio_high", ("loss.eps_high",), 0.2, "same value"),
    FieldMapping(ACTOR + "clip_ratio_c", ("loss.dual_clip",), 3.0, "same value"),
    FieldMapping(ACTOR + "loss_agg_mode", ("loss.aggregation",), "token-mean",
                 "token-mean: token_mean, seq-mean-token-sum: seq_mean_token_sum, seq-mean-token-mean: "
                 "seq_mean_token_mean, seq-mean-token-sum-norm: constant"),
    FieldMapping(ACTOR + "policy_loss.loss_mode", ("loss.policy_loss",), "vanilla",
                 "vanilla: ppo_clip; gspo: gspo (seq_mean_token_mean); the others: none"),
    FieldMapping(ACTOR + "ppo_epochs", ("train.num_iterations",), 1, "same value"),
    FieldMapping(ACTOR + "ppo_mini_batch_size", (), 256, "fewer prompts than data.train_batch_size: several "
                                                         "updates per batch, the later ones off-policy"),
    FieldMapping("data.train_batch_size", ("rollout.prompts_per_step",), 1024, "same value"),
    FieldMapping(ACTOR + "entropy_coeff", ("loss.entropy_coef",), 0.0,
                 "same value: the bonus's token mean over the response tokens at the rollout temperature; with "
                 "another loss_agg_mode verl aggregates the entropy by it (named in unmapped)"),
    FieldMapping("actor_rollout_ref.rollout.n", ("rollout.group_size",), 1, "same value"),
    FieldMapping("actor_rollout_ref.rollout.temperature", ("rollout.temperature",), 1.0, "same value"),
    FieldMapping("data.max_response_length", ("rollout.max_new_tokens",), 512, "same value"),
    FieldMapping(ACTOR + "optim.lr", ("optim.lr",), 1e-6, "same value"),
)
VERL_DEFAULTS = {row.field: row.default for row in VERL_FIELDS}

#: When each range puts the KL into the reward (verl.json's reward_kl), as a rule on the config's values.
REWARD_RULES = {
    RewardKL.ALWAYS: lambda v: True,
    RewardKL.UNLESS_KL_LOSS: lambda v: not v[ACTOR + "use_kl_loss"],
    RewardKL.WITH_USE_KL_IN_REWARD: lambda v: bool(v[ALGORITHM + "use_kl_in_reward"]),
}
#: The KL keys of some verl release (verl.json): a config that sets one its range lacks cannot run there.
KL_KEYS = tuple(dict.fromkeys(key for p in rl_profiles("verl") for key in p.defaults))
#: klgrpo's clip_threshold where no estimator is clipped (the key is dropped then).
LOW_VAR_KL_CAP = 10.0
AGGREGATIONS = {"token-mean": "token_mean", "seq-mean-token-sum": "seq_mean_token_sum",
                "seq-mean-token-mean": "seq_mean_token_mean", "seq-mean-token-sum-norm": "constant"}
POLICY_LOSSES = {"vanilla": "ppo_clip", "gspo": "gspo"}
#: verl's top-level groups; keys under them that the table does not read are speed, memory, I/O or logging.
ROOTS = ("actor_rollout_ref", "data", "reward_manager", "critic", "reward_model", "algorithm",
         "custom_reward_function", "trainer", "global_profiler", "transfer_queue", "ray_kwargs", "ray_init",
         "hydra", "defaults")
#: The keys of the two groups that hold the objective; a key there that is not listed is a typo.
ACTOR_KEYS = ("_target_", "calculate_entropy", "calculate_sum_pi_squared", "checkpoint", "clip_ratio",
              "clip_ratio_c", "clip_ratio_high", "clip_ratio_low", "data_loader_seed", "entropy_checkpointing",
              "entropy_coeff", "entropy_from_logits_with_chunking", "freeze_vision_tower", "fsdp_config",
              "grad_clip", "kl_loss_coef", "kl_loss_type", "loss_agg_mode", "loss_scale_factor", "optim",
              "policy_loss", "ppo_epochs", "ppo_max_token_len_per_gpu", "ppo_micro_batch_size",
              "ppo_micro_batch_size_per_gpu", "ppo_mini_batch_size", "profiler", "rollout_n", "router_replay",
              "shuffle", "strategy", "sum_pi_squared_checkpointing", "tau_neg", "tau_pos",
              "ulysses_sequence_parallel_size", "use_dynamic_bsz", "use_fused_kernels", "use_kl_loss",
              "use_prefix_grouper", "use_remove_padding", "use_torch_compile", "megatron", "nccl_timeout")
ALGORITHM_KEYS = ("_target_", "adv_estimator", "gamma", "kl_ctrl", "kl_penalty", "lam", "norm_adv_by_std_in_grpo",
                  "pf_ppo", "rollout_correction", "use_kl_in_reward", "use_pf_ppo")
KL_CTRL_KEYS = ("_target_", "type", "kl_coef", "horizon", "target_kl")


def check_keys(values: dict[str, Any], origin: str) -> tuple[list[str], dict[str, str]]:
    """(the keys the mapping does not read: speed, memory, I/O, logging; the keys explain does not know, each with
    why). A key unknown here may be a typo or a key of a verl release newer than these lists (0.9's
    ``algorithm.gdpo_*``): it is named, never fatal, while another key is verl's; a file of unknown keys alone is
    no verl config (ConfigError)."""
    import difflib

    known = set(VERL_DEFAULTS)
    ignored: list[str] = []
    unknown: dict[str, str] = {}
    for key in values:
        parts = key.split(".")
        group_keys = {ACTOR: ACTOR_KEYS, ALGORITHM: ALGORITHM_KEYS, ALGORITHM + "kl_ctrl.": KL_CTRL_KEYS}
        bad = parts[0] not in ROOTS
        for prefix, names in group_keys.items():
            depth = prefix.count(".")
            if key.startswith(prefix) and len(parts) > depth and parts[depth] not in names:
                bad = True
        if bad:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            unknown[key] = f"did you mean {close[0]}?" if close else f"verl's groups are: {', '.join(ROOTS[:9])};"
        elif key not in known:
            ignored.append(key)
    if unknown and len(unknown) == len(values):
        key, hint = next(iter(unknown.items()))
        raise ConfigError(f"{origin}: unknown verl key {key!r}; {hint.rstrip(';')}")
    return ignored, {key: (f"not a verl key explain knows ({hint} or a key of a release after {VERL_VERSION}): the "
                           "verdict leaves it out; check that it does not change the objective")
                     for key, hint in unknown.items()}


#: Keys of the objective's groups that change speed, memory, I/O or logging only.
SPEED_ONLY = tuple(ACTOR + name for name in (
    "fsdp_config", "ppo_micro_batch_size", "ppo_micro_batch_size_per_gpu", "use_dynamic_bsz",
    "ppo_max_token_len_per_gpu", "ulysses_sequence_parallel_size", "use_remove_padding", "use_torch_compile",
    "use_fused_kernels", "entropy_checkpointing", "entropy_from_logits_with_chunking", "checkpoint", "profiler",
    "strategy", "_target_", "calculate_entropy", "data_loader_seed", "shuffle", "megatron", "nccl_timeout"))


def _not_read(keys: list[str], out: Mapped) -> None:
    """Keys of the actor and algorithm groups outside the table may change the objective: named, not ignored."""
    for key in keys:
        if key.startswith((ACTOR, ALGORITHM)) and not key.startswith(SPEED_ONLY):
            out.unmapped[key] = "not read by the mapping: check that it does not change the objective"
        else:
            out.ignored.append(key)


def _check_type(key: str, value: Any, origin: str) -> None:
    if value is None and key in (ACTOR + "clip_ratio_low", ACTOR + "clip_ratio_high"):
        return  # null: clip_ratio
    default = VERL_DEFAULTS[key]
    kind = bool if isinstance(default, bool) else (int, float) if isinstance(default, (int, float)) else str
    if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
        name = {bool: "true or false", str: "a name"}.get(kind, "a number")
        raise ConfigError(f"{origin}: {key} must be {name}, got {value!r}")
    if kind is not bool and kind is not str and not math.isfinite(value):  # .nan, .inf: every loss would be NaN
        raise ConfigError(f"{origin}: {key} must be a finite number, got {value!r}")


def map_verl(values: dict[str, Any], origin: str = "config", release: RLRange | None = None) -> Mapped:
    """verl dotted keys -> klgrpo keys under ``release``'s rules (a range of verl.json; None: the newest); absent
    keys take that range's defaults. NotInRange where the config sets a KL key the range lacks."""
    row = release or newest("verl")
    label = row.label
    for key in values:
        if key in KL_KEYS and key not in row.defaults:
            raise NotInRange(f"{origin}: {key} is not a key of {label} (klgrpo/integrations/versions/verl.json); "
                             "drop it or pass the release you run, e.g. --version verl==0.4")
    unread, unknown = check_keys(values, origin)
    for key in values:
        if key in VERL_DEFAULTS:
            _check_type(key, values[key], origin)
    v = {**VERL_DEFAULTS, **row.defaults, **values}
    out = Mapped(unmapped=unknown)
    _not_read(unread, out)
    _map_policy(v, out)
    _map_advantages(v, out)
    _map_kl(v, out, row, label, origin)
    mini_batches = v["data.train_batch_size"] / v[ACTOR + "ppo_mini_batch_size"]
    out.off_policy = v[ACTOR + "ppo_epochs"] > 1 or mini_batches > 1
    if mini_batches > 1:
        out.unmapped[ACTOR + "ppo_mini_batch_size"] = (
            f"{mini_batches:g} updates per batch on different prompts; klgrpo updates once per batch per "
            f"iteration (train.num_iterations): the off-policy verdict holds for verl's later mini-batches")
    drop_unread_kl_keys(out.config)
    return out


def _map_policy(v: dict, out: Mapped) -> None:
    mode = v[ACTOR + "policy_loss.loss_mode"]
    aggregation = v[ACTOR + "loss_agg_mode"]
    if mode not in POLICY_LOSSES:
        out.unmapped[ACTOR + "policy_loss.loss_mode"] = f"{mode!r}: {_none_of(POLICY_LOSSES)}"
    if aggregation not in AGGREGATIONS:
        out.unmapped[ACTOR + "loss_agg_mode"] = f"{aggregation!r}: {_none_of(AGGREGATIONS)}"
    policy = POLICY_LOSSES.get(mode, "ppo_clip")
    low, high = v[ACTOR + "clip_ratio_low"], v[ACTOR + "clip_ratio_high"]  # null: clip_ratio
    out.config.update({
        "loss.policy_loss": policy,
        "loss.aggregation": "seq_mean_token_mean" if policy == "gspo" else AGGREGATIONS.get(aggregation,
                                                                                              "token_mean"),
        "loss.eps_low": float(low if low is not None else v[ACTOR + "clip_ratio"]),
        "loss.eps_high": float(high if high is not None else v[ACTOR + "clip_ratio"]),
        "loss.dual_clip": float(v[ACTOR + "clip_ratio_c"]) if policy == "ppo_clip" else 0.0,
        "train.num_iterations": int(v[ACTOR + "ppo_epochs"]),
        "rollout.group_size": int(v["actor_rollout_ref.rollout.n"]),
        "rollout.prompts_per_step": int(v["data.train_batch_size"]),
        "rollout.temperature": float(v["actor_rollout_ref.rollout.temperature"]),
        "rollout.max_new_tokens": int(v["data.max_response_length"]),
        "optim.lr": float(v[ACTOR + "optim.lr"]),
    })
    _map_entropy(v, out)


def _map_entropy(v: dict, out: Mapped) -> None:
    """verl subtracts entropy_coeff * agg(H) with the policy loss's loss_agg_mode; klgrpo's bonus (TRL's) is the
    token mean whatever loss.aggregation: the same under token-mean (per micro-batch, weighted by its share of
    the mini-batch, as klgrpo weighs it), another number under the other modes."""
    coef, mode = float(v[ACTOR + "entropy_coeff"]), v[ACTOR + "loss_agg_mode"]
    if coef:
        out.config["loss.entropy_coef"] = coef
    if coef and mode != "token-mean":
        out.unmapped[ACTOR + "entropy_coeff"] = (
            f"verl aggregates the entropy as loss_agg_mode {mode} does; klgrpo's bonus is the token mean over the "
            "loss-mask tokens (TRL's) whatever loss.aggregation: equal under token-mean only")


def _none_of(names) -> str:
    return f"no klgrpo counterpart (mapped: {', '.join(names)})"


def _map_advantages(v: dict, out: Mapped) -> None:
    estimator = v[ALGORITHM + "adv_estimator"]
    if estimator != "grpo":
        out.unmapped[ALGORITHM + "adv_estimator"] = (
            f"{estimator!r}: klgrpo's advantages are group-relative rewards (verl's 'grpo'); {estimator} divides by "
            "no group std, so the config below centres the rewards without dividing (advantage_scale none)")
    scale = "group" if estimator == "grpo" and v[ALGORITHM + "norm_adv_by_std_in_grpo"] else "none"
    out.config.update({"loss.advantage_scale": scale, "loss.std_eps": 1e-6, "loss.std_ddof": 1})


#: Every KL type name some verl release has (verl.json): another name is no verl KL type at all.
KL_TYPES = tuple(dict.fromkeys(name for p in rl_profiles("verl") for name in p.estimators))


def _estimator(name: Any, key: str, out: Mapped, row: RLRange, label: str,
               origin: str) -> tuple[str, str, float] | None:
    """(klgrpo estimator, loss shaping, cap) of the KL type ``name`` in the range's row; None (named in unmapped)
    where klgrpo has no counterpart. A name no verl release has is a ConfigError; one this range lacks, or one
    whose function raises there (``k3+`` before 0.8, ``full``), is a NotInRange: the range cannot run it."""
    found = row.estimators.get(name) if isinstance(name, str) else None
    if found is None and name not in KL_TYPES:
        raise ConfigError(f"{origin}: {key} {name!r} is no KL type of any verl release; verl's are: "
                          f"{', '.join(KL_TYPES)}")
    if found is None:
        raise NotInRange(f"{origin}: {key} {name!r} is not a KL type of {label} (it has: "
                         f"{', '.join(row.estimators)}); pass the release you run, e.g. --version verl==0.8")
    if found.raises:
        raise NotInRange(f"{origin}: {key} {name!r}: verl's kl_penalty {found.formula} in {label} (core_algos.py): "
                         "the run stops at its first KL; pick another KL type or the release that has it")
    if found.estimator is None:
        out.unmapped[key] = f"{name!r} in {label}: {found.why}"
        return None
    # a cap on k3 (>= 0: the upper bound only) is klgrpo's clip shaping there, zero gradient above
    if found.cap is not None and found.estimator != "k3":
        out.unmapped[key] = (f"{name!r}: verl caps the value at {found.cap:g}, klgrpo's {found.estimator} does not "
                             "(equal below the cap" + ("; the gradient, k2's, is not capped in either)"
                                                       if found.estimator.endswith("_st") else ")"))
    shaping = "clip" if found.cap is not None and found.estimator == "k3" else "none"
    return found.estimator, shaping, found.cap or LOW_VAR_KL_CAP


def _part(estimator: tuple[str, str, float], coef: float, placement: str) -> dict[str, Any]:
    name, shaping, cap = estimator
    part = {"coef": float(coef), "estimator": name, "placement": placement, "is_correction": "none",
            "reward_mode": "sequence_score" if placement == "reward" else "reward_to_go", "shaping": "none",
            "clip_threshold": cap}
    if placement == "loss":  # klgrpo shapes the loss term only; verl clamps the reward value too (noted)
        part["shaping"] = shaping
    return part


def _map_kl(v: dict, out: Mapped, row: RLRange, label: str, origin: str) -> None:
    loss_on, reward_on = bool(v[ACTOR + "use_kl_loss"]), REWARD_RULES[row.reward_kl](v)
    loss_est = (_estimator(v[ACTOR + "kl_loss_type"], ACTOR + "kl_loss_type", out, row, label, origin) if loss_on
                else None)
    reward_est = (_estimator(v[ALGORITHM + "kl_penalty"], ALGORITHM + "kl_penalty", out, row, label, origin)
                  if reward_on else None)
    controller = v[ALGORITHM + "kl_ctrl.type"]
    if reward_on and controller not in ("fixed", "adaptive"):
        out.unmapped[ALGORITHM + "kl_ctrl.type"] = f"{controller!r} is not a verl KL controller"
    parts = []
    if loss_est:
        parts.append(_part(loss_est, v[ACTOR + "kl_loss_coef"], "loss"))
    if reward_est:
        parts.append(_part(reward_est, v[ALGORITHM + "kl_ctrl.kl_coef"], "reward"))
        if reward_est[1] == "clip":
            out.unmapped[ALGORITHM + "kl_penalty"] = (
                f"{v[ALGORITHM + 'kl_penalty']} caps the reward KL at {reward_est[2]:g}; klgrpo's reward KL is not "
                f"capped (equal below {reward_est[2]:g})")
        if controller == "adaptive":
            out.unmapped[ALGORITHM + "kl_ctrl.target_kl"] = (
                "verl's adaptive controller reads the mean over sequences of each sequence's mean KL; klgrpo's "
                "reads the mean per-token KL (kl.kl_measure token_mean; equal when all lengths are equal)")
    both = (len(parts) == 2 and parts[0]["estimator"] == parts[1]["estimator"] and parts[0]["coef"] ==
            parts[1]["coef"] and parts[0]["shaping"] == "none" and controller == "fixed")
    if both:
        parts = [{**parts[0], "placement": "both", "reward_mode": "sequence_score"}]
    elif len(parts) == 2:
        out.extra_kl.append(parts.pop())
        out.unmapped[ALGORITHM + "use_kl_in_reward"] = (
            "klgrpo has one KL term: one estimator and one coefficient for both placements; verl's reward KL "
            f"({v[ALGORITHM + 'kl_penalty']}, beta {v[ALGORITHM + 'kl_ctrl.kl_coef']}) beside its loss KL "
            f"({v[ACTOR + 'kl_loss_type']}, beta {v[ACTOR + 'kl_loss_coef']}) is left out of the config below; "
            "the verdict includes both")
    unread = [f"{key} {float(v[key]):g}" for key in (ACTOR + "kl_loss_coef", ALGORITHM + "kl_ctrl.kl_coef")
              if float(v[key]) > 0]
    if not parts and unread:
        switches = ACTOR + "use_kl_loss" + (f" and {ALGORITHM}use_kl_in_reward are" if
                                            row.reward_kl == RewardKL.WITH_USE_KL_IN_REWARD else " is")
        out.kl_off = f"{switches} false, so {' and '.join(unread)} {'are' if len(unread) > 1 else 'is'} never read"
    main = parts[0] if parts else {"coef": 0.0, "estimator": "k1", "placement": "loss", "is_correction": "none",
                                   "reward_mode": "reward_to_go", "shaping": "none",
                                   "clip_threshold": LOW_VAR_KL_CAP}
    reward_controller = reward_on and main["placement"] != "loss" and controller == "adaptive"
    out.config.update({
        "kl.coef": main["coef"], "kl.monitor": bool(parts), "kl.estimator": main["estimator"],
        "kl.placement": main["placement"], "kl.reward_mode": main["reward_mode"], "kl.is_correction": "none",
        "kl.shaping": main["shaping"], "kl.clip_threshold": main["clip_threshold"],
        "kl.controller": "adaptive" if reward_controller else "fixed",
        "kl.target": float(v[ALGORITHM + "kl_ctrl.target_kl"]), "kl.horizon": float(v[ALGORITHM + "kl_ctrl.horizon"]),
    })
