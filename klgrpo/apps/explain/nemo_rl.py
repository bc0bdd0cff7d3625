"""A NeMo-RL GRPO config (``grpo:``, ``loss_fn:``, ``policy:``, ...; a recipe with ``defaults:
../../grpo_math_1B.yaml``) in klgrpo's terms, by the rules of each NeMo-RL release range (``nemo_rl.json``, read
from NVIDIA-NeMo/RL's ClippedPGLossFn and calculate_kl at every tag).

What decides the KL, per range: the estimator (k3 before 0.5.0; ``reference_policy_kl_type`` k1 / k2 / k3 from
0.5.0), its weight (ones, or with ``use_on_policy_kl_approximation`` the detached exp(logp - generation_logp),
before 0.7.0: k3's gradient follows the forward KL; from 0.7.0 the weight is in the graph, exp(logp -
logp.detach()) by default: the reverse KL on the first update), the clamps (the log-ratio at 20 from 0.4.0, the
estimate at ``kl_output_clamp_value`` from 0.5.0) and ``use_kl_in_reward`` (0.6.0: read by Reinforce++ only, the
loss keeps its KL; 0.7.0 on: the loss's beta is 0).
"""

from __future__ import annotations

import math
from typing import Any

from packaging.version import Version

from klgrpo.apps.explain.frameworks import Release, releases, table
from klgrpo.errors import ConfigError
from klgrpo.integrations.mapping import Mapped
from klgrpo.integrations.versions import NotInRange

#: loss_fn keys that shape the policy term only, each with why klgrpo's config leaves it out.
POLICY_TERM = {
    "use_importance_sampling_correction": "weights the policy term by pi_old / pi_generation (the sampler's "
                                          "mismatch); NeMo-RL's KL term keeps its own weight",
    "truncated_importance_sampling_ratio": "caps that importance weight (policy term only)",
    "truncated_importance_sampling_ratio_min": "bounds that importance weight from below (policy term only)",
    "truncated_importance_sampling_type": "how that importance weight is capped (policy term only)",
    "sequence_level_importance_ratios": "GSPO's sequence ratio on the policy term",
    "force_on_policy_ratio": "the policy term's ratio forced to 1",
    "use_cispo": "CISPO's policy term",
    "disable_ppo_ratio": "REINFORCE's policy term without the ratio",
    "positive_example_nll_weight": "an NLL term on positive examples",
}
#: The loss_fn keys explain maps (beside the policy term's above).
KL_KEYS = ("reference_policy_kl_penalty", "reference_policy_kl_type", "kl_input_clamp_value", "kl_output_clamp_value",
           "use_on_policy_kl_approximation", "use_kl_in_reward")
POLICY_KEYS = ("ratio_eps", "ratio_eps_min", "ratio_eps_max", "ratio_clip_min", "ratio_clip_max", "ratio_clip_c",
               "token_level_loss")
#: grpo keys that cannot change the objective (validation, run length, seeds, logging).
_GRPO_SPEED = ("val_", "max_val_samples", "max_num_steps", "max_num_epochs", "seed", "max_rollout_turns",
               "stop_at_validation", "batch_multiplier")
_GRPO_READ = ("num_prompts_per_step", "num_generations_per_prompt", "normalize_rewards", "use_leave_one_out_baseline",
              "adv_estimator.name")


def flatten(data: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def is_nemo_rl(data: dict) -> bool:
    """NeMo-RL's top-level groups with its loss_fn or grpo group, or both of those beside other groups (a newer
    release's, named as not read)."""
    top = {str(key) for key in data}
    return bool(top & {"loss_fn", "grpo"}) and top <= set(table("nemo_rl")["groups"]) or {"loss_fn", "grpo"} <= top


def newest() -> Release:
    return releases("nemo_rl")[-1]


def _number(v: dict, key: str, origin: str, allow_none: bool = False) -> float | None:
    value = v.get(key)
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{origin}: {key} must be a finite number, got {value!r}")
    return float(value)


def _flag(v: dict, key: str, origin: str) -> bool:
    value = v.get(key, False)
    if not isinstance(value, bool):
        raise ConfigError(f"{origin}: {key} must be true or false, got {value!r}")
    return value


#: The base config whose values at each release are the table's defaults.
BASE = "grpo_math_1B.yaml"
#: How many ``defaults:`` files a chain may follow (NeMo-RL's recipes use one or two).
MAX_INHERITED = 8


def inherited(values: dict[str, Any], origin: str) -> tuple[dict[str, Any], list[str]]:
    """The file's keys over those of the config its ``defaults:`` names (OmegaConf's merge: the file wins), that
    file's own ``defaults:`` followed in turn, up to the base (grpo_math_1B.yaml, the table's defaults) or a file
    not beside it; returns the merged keys and the files read."""
    from pathlib import Path

    from klgrpo.apps.explain.reading import load_yaml, read_text

    merged, read = dict(values), []
    here = Path(origin).parent if origin != "<stdin>" else None
    while here is not None and isinstance(merged.get("defaults"), str) and len(read) < MAX_INHERITED:
        base = merged["defaults"]
        parent = here / base
        if base.endswith(BASE) or not parent.is_file():
            break
        text, where = read_text(str(parent))
        data = load_yaml(text, where)
        if not isinstance(data, dict):
            raise ConfigError(f"{where} (the defaults of {origin}) is no YAML mapping")
        parent_values = flatten(data)
        parent_values.pop("defaults", None)
        merged = {**parent_values, **{k: v for k, v in merged.items() if k != "defaults"}}
        if data.get("defaults") is not None:
            merged["defaults"] = data["defaults"]
        read.append(base)
        here = parent.parent
    return merged, read


def map_nemo_rl(values: dict[str, Any], origin: str, release: Release | None = None) -> Mapped:
    """NeMo-RL's dotted keys -> klgrpo keys under ``release``'s rules (None: the newest); a recipe's ``defaults:``
    file beside it is read (:func:`inherited`); keys left unset take grpo_math_1B.yaml's values at that release
    (what the chain inherits last)."""
    values, read = inherited(values, origin)
    release = release or newest()
    row = release.release or {}
    label = release.label
    keys_here = {key.split(".", 1)[1] for key in row["defaults"] if key.startswith("loss_fn.")} | set(POLICY_TERM)
    if row["kl_types"] != ["k3"]:
        keys_here |= {"reference_policy_kl_type", "kl_input_clamp_value", "kl_output_clamp_value"}
    for key in values:
        name = key.split(".", 1)[1] if key.startswith("loss_fn.") else None
        if name in (*KL_KEYS, *POLICY_KEYS) and name not in keys_here:
            raise NotInRange(f"{origin}: {key} is not a key of {label} (klgrpo/apps/explain/nemo_rl.json); drop it "
                             "or pass the release you run, e.g. --version nemo_rl==0.7.0")
    v = {**row["defaults"], **values}
    out = Mapped()
    _name_the_rest(values, out)
    if read:
        missing = out.unmapped.get("defaults")
        out.unmapped["defaults"] = (f"inherits {' <- '.join(read)} (read beside the file); " + (
            f"then {missing}" if missing else
            f"the keys the chain leaves unset take examples/configs/{BASE}'s values at the release"))
    prompts = int(_number(v, "grpo.num_prompts_per_step", origin) or 0)
    group = int(_number(v, "grpo.num_generations_per_prompt", origin) or 0)
    batch = _number(v, "policy.train_global_batch_size", origin) or 1
    updates = prompts * group / batch
    out.off_policy = updates > 1
    if out.off_policy:
        out.unmapped["policy.train_global_batch_size"] = (
            f"{updates:g} updates per step on different samples; klgrpo updates once per batch per iteration "
            "(train.num_iterations): the off-policy verdict holds for NeMo-RL's later updates")
    if _map_kl(v, row, label, origin, out) == "unit_in_graph" and out.off_policy and out.config["kl.coef"] > 0:
        out.unmapped["loss_fn.use_on_policy_kl_approximation"] = (
            f"false: {label} weighs the KL by exp(logp - logp.detach()), 1 in value on every update; klgrpo's "
            "in_graph weight is pi / pi_old, so on the later updates the off-policy verdict is klgrpo's, not "
            "NeMo-RL's (set it true: exp(logp - generation_logp), klgrpo's in_graph)")
    _map_policy(v, origin, out)
    out.config.update({"rollout.group_size": group, "rollout.prompts_per_step": prompts,
                       "loss.advantage_scale": "group" if v.get("grpo.normalize_rewards", True) else "none"})
    if v.get("grpo.use_leave_one_out_baseline"):
        out.unmapped["grpo.use_leave_one_out_baseline"] = (
            "each sample's baseline is the mean of the OTHER samples of its group (RLOO); klgrpo's is the group "
            "mean with the sample in it: the policy term's advantages differ, the KL term does not")
    _map_sampling(v, release, out)
    return out


def _map_sampling(v: dict, release: Release, out: Mapped) -> None:
    """policy.generation.top_p / top_k: carried into klgrpo's rollout keys (trained as drawn), and named."""
    top_p, top_k = v.get("policy.generation.top_p"), v.get("policy.generation.top_k")
    on = []
    if isinstance(top_p, (int, float)) and not isinstance(top_p, bool) and 0 < top_p < 1:
        out.config["rollout.top_p"] = float(top_p)
        on.append(f"top_p {top_p:g}")
    if isinstance(top_k, int) and not isinstance(top_k, bool) and top_k > 0:
        out.config["rollout.top_k"] = top_k
        on.append(f"top_k {top_k}")
    for key in ("policy.generation.top_p", "policy.generation.top_k"):
        if key in out.ignored:
            out.ignored.remove(key)
    if on:
        out.config["rollout.truncation"] = "policy"
        since = "" if release.low >= Version("0.6.0") else "from NeMo-RL 0.6.0, "
        out.unmapped["policy.generation"] = (
            f"{', '.join(on)}: a sampling filter; {since}NeMo-RL's policy term scores the filtered distribution and "
            "its KL the full softmax (curr_logprobs_unfiltered; before 0.6.0 not read by explain); klgrpo's "
            "rollout.truncation policy (below) scores both terms over the kept set")


def _name_the_rest(values: dict[str, Any], out: Mapped) -> None:
    for key in values:
        group, _, name = key.partition(".")
        if group == "loss_fn" and name in POLICY_TERM:
            if values[key] not in (False, None, 0, 0.0):
                out.unmapped[key] = f"{POLICY_TERM[name]}: not mapped; the KL verdict does not depend on it"
        elif group == "loss_fn" and name not in (*KL_KEYS, *POLICY_KEYS):
            out.unmapped[key] = "not read by the mapping: check that it does not change the objective"
        elif group == "grpo" and name not in _GRPO_READ:
            section = name.split(".")[0]
            off = values[key] in (False, None, 0, 0.0, "") or values.get(f"grpo.{section}.enabled") is False or (
                section == "dynamic_sampling_max_gen_batches" and not values.get("grpo.use_dynamic_sampling"))
            if off or name.startswith(_GRPO_SPEED + ("async_grpo", "adv_estimator.")):
                out.ignored.append(key)  # off, or not the objective (adv_estimator's others mirror grpo's keys)
            else:
                out.unmapped[key] = "not read by the mapping: check that it does not change the objective"
        elif key == "defaults":
            base = str(values[key])
            if not base.endswith(BASE):
                out.unmapped[key] = (f"{base}: the config it inherits is not beside the file, not read; the keys "
                                     "it leaves unset take examples/configs/grpo_math_1B.yaml's values at the "
                                     "release (put the file beside it for the exact verdict)")
        elif group not in table("nemo_rl")["groups"]:
            out.unmapped[key] = "not a NeMo-RL group explain knows: check that it does not change the objective"
        elif group not in ("loss_fn", "grpo") and key != "policy.train_global_batch_size":
            out.ignored.append(key)


def _clamp(row: dict, field: str, v: dict, origin: str) -> float | None:
    spec = row[field]
    if isinstance(spec, str):
        return _number(v, spec, origin, allow_none=True)
    return spec


def _map_kl(v: dict, row: dict, label: str, origin: str, out: Mapped) -> str:
    """The KL term's keys; returns the weight NeMo-RL puts on the estimate (the table's name)."""
    beta = _number(v, "loss_fn.reference_policy_kl_penalty", origin)
    if beta < 0:
        raise ConfigError(f"{origin}: loss_fn.reference_policy_kl_penalty must be >= 0, got {beta:g}")
    kl_type = v.get("loss_fn.reference_policy_kl_type", "k3")
    if kl_type not in row["kl_types"]:
        raise ConfigError(f"{origin}: loss_fn.reference_policy_kl_type {kl_type!r} is none of {label}'s "
                          f"({', '.join(row['kl_types'])}): calculate_kl raises ValueError")
    in_reward = _flag(v, "loss_fn.use_kl_in_reward", origin) if row["kl_in_reward"] else False
    estimator = str(v.get("grpo.adv_estimator.name", "grpo"))
    if in_reward and estimator == "reinforce_plus_plus":
        raise ConfigError(
            f"{origin}: loss_fn.use_kl_in_reward with grpo.adv_estimator.name reinforce_plus_plus: {label} subtracts "
            "beta x each token's KL from that token's advantage (no sum over the later tokens) and whitens the "
            "batch; klgrpo has no such placement and explain computes no verdict for it")
    if in_reward and row["kl_in_reward"] == "instead_of_loss":
        out.unmapped["loss_fn.use_kl_in_reward"] = (
            f"{label} sets the loss's KL coefficient to 0 and only the Reinforce++ estimator reads the KL; with "
            f"grpo.adv_estimator.name {estimator} no KL term is left (beta 0 below)")
        beta = 0.0
    elif in_reward:
        out.unmapped["loss_fn.use_kl_in_reward"] = (
            f"read by the Reinforce++ estimator only in {label}; with grpo.adv_estimator.name {estimator} the "
            "loss keeps its KL (below)")
    on_policy = _flag(v, "loss_fn.use_on_policy_kl_approximation", origin) if (
        row["on_policy_weight"] is not None) else False
    weight = row["on_policy_weight"] if on_policy else row["weight"]
    correction = {"none": "none", "detached": "detached", "in_graph": "in_graph", "unit_in_graph": "in_graph"}[weight]
    out.config.update({"kl.coef": beta, "kl.estimator": kl_type, "kl.placement": "loss",
                       "kl.is_correction": correction, "kl.controller": "fixed"})
    output = _clamp(row, "output_clamp", v, origin)
    if output is not None and beta > 0:
        if output <= 0:
            raise ConfigError(f"{origin}: loss_fn.kl_output_clamp_value must be > 0 or null, got {output:g}")
        out.config.update({"kl.shaping": "clip", "kl.clip_threshold": output})
        if kl_type == "k1":
            out.unmapped["loss_fn.kl_output_clamp_value"] = (
                f"NeMo-RL also clamps k1 from below at -{output:g}; klgrpo's clip shaping caps it from above only")
    else:
        out.config["kl.shaping"] = "none"
    clamp = _clamp(row, "input_clamp", v, origin)
    if clamp is None:
        out.config["kl.log_ratio_clamp"] = 20.0
        if beta > 0:
            out.unmapped["log-ratio clamp"] = (
                f"{label} clamps no log-ratio; klgrpo's guard (20, its least) differs only where |log pi - log "
                "ref| > 20")
    else:
        if clamp <= 0 and kl_type == "k3":
            raise ConfigError(f"{origin}: loss_fn.kl_input_clamp_value must be > 0 for k3 (exp of an unclamped "
                              f"log-ratio overflows), got {clamp:g}")
        out.config["kl.log_ratio_clamp"] = clamp if clamp > 0 else 0.0
    return weight


def _map_policy(v: dict, origin: str, out: Mapped) -> None:
    low = v.get("loss_fn.ratio_clip_min", v.get("loss_fn.ratio_eps_min", v.get("loss_fn.ratio_eps", 0.2)))
    high = v.get("loss_fn.ratio_clip_max", v.get("loss_fn.ratio_eps_max", v.get("loss_fn.ratio_eps", 0.2)))
    dual = v.get("loss_fn.ratio_clip_c")
    token_level = v.get("loss_fn.token_level_loss", True)
    if not isinstance(token_level, bool):
        raise ConfigError(f"{origin}: loss_fn.token_level_loss must be true or false, got {token_level!r}")
    for key, value in (("ratio_clip_min", low), ("ratio_clip_max", high)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{origin}: loss_fn.{key} must be a finite number, got {value!r}")
    out.config.update({"loss.policy_loss": "ppo_clip", "loss.eps_low": float(low), "loss.eps_high": float(high),
                       "loss.dual_clip": float(dual) if dual is not None else 0.0,
                       "loss.aggregation": "token_mean" if token_level else "seq_mean_token_mean"})
