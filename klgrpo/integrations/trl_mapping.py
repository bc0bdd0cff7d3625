"""TRL 1.16's GRPOConfig and the adaptive-KL fields in klgrpo's vocabulary.

One table per vocabulary: ``TRL_FIELDS`` (TRL's own fields that shape the objective) and ``ADAPTIVE_KL_FIELDS``
(the adaptive-KL fields of ``klgrpo.trl.GRPOConfig``, the names of the Unsloth-style adaptive-KL config, with
their own defaults). :func:`map_trl` applies both; the TRL bridge (klgrpo.trl) runs its loss, beta and
controller from the result, ``klgrpo explain`` prints it, and docs/trl.md and docs/explain.md show the tables
(tests/test_trl_mapping.py checks the docs against them and the defaults against TRL's dataclass).

Nothing here imports TRL: the defaults are written down for TRL 1.16.
"""

from __future__ import annotations

from typing import Any
from typing import Mapping as MappingType

from klgrpo.integrations.mapping import FieldMapping, Mapped, drop_unread_kl_keys
from klgrpo.math.kl import DEFAULT_LOG_RATIO_CLAMP

TRL_VERSION = "1.16"

#: TRL loss_type -> (loss.policy_loss, loss.aggregation). The aggregation's normaliser carries the rest: bnpo
#: divides by the micro-batch's tokens, dapo, cispo and vespo by the accumulation window's (equal with one
#: micro-batch).
LOSS_TYPES = {
    "grpo": ("ppo_clip", "seq_mean_token_mean"),
    "bnpo": ("ppo_clip", "token_mean"),
    "dr_grpo": ("ppo_clip", "constant"),
    "dapo": ("ppo_clip", "token_mean"),
    "luspo": ("ppo_clip", "seq_mean_token_sum"),
    "cispo": ("cispo", "token_mean"),
    "sapo": ("sapo", "seq_mean_token_mean"),
    "vespo": ("vespo", "token_mean"),
}
#: The policy losses whose TRL form takes no clip settings (delta is TRL's ppo_clip guard only).
_UNCLIPPED = ("sapo", "vespo")

TRL_FIELDS = (
    FieldMapping("beta", ("kl.coef", "kl.monitor"), 0.0, "kl.coef = beta; beta 0: no reference model, "
                                                          "kl.monitor false"),
    FieldMapping("loss_type", ("loss.policy_loss", "loss.aggregation"), "dapo",
                 "grpo: seq_mean_token_mean, bnpo and dapo: token_mean, dr_grpo: constant, luspo: "
                 "seq_mean_token_sum (ppo_clip); cispo: policy_loss cispo, token_mean; sapo: policy_loss sapo, "
                 "seq_mean_token_mean; vespo: policy_loss vespo, token_mean"),
    FieldMapping("epsilon", ("loss.eps_low",), 0.2, "eps_low = epsilon; cispo: 1 (TRL's cispo has no lower clip)"),
    FieldMapping("epsilon_high", ("loss.eps_high",), None, "unset: epsilon; cispo: epsilon_high - 1 (TRL caps "
                                                           "the ratio at epsilon_high itself)"),
    FieldMapping("delta", ("loss.delta",), None, "unset: 0 (off); ignored by cispo, as in TRL"),
    FieldMapping("importance_sampling_level", ("loss.policy_loss",), "token", "sequence: gspo"),
    FieldMapping("use_bias_correction_kl", ("kl.is_correction",), True, "true: in_graph, false: none"),
    FieldMapping("num_iterations", ("train.num_iterations",), 1, "same value"),
    FieldMapping("scale_rewards", ("loss.advantage_scale",), "group", "group or true: group, batch: batch, "
                                                                      "none or false: none (std_eps 1e-4, ddof 1)"),
    FieldMapping("num_generations", ("rollout.group_size",), 8, "same value"),
    FieldMapping("max_completion_length", ("rollout.max_new_tokens",), 512, "same value"),
    FieldMapping("temperature", ("rollout.temperature",), 1.0, "same value"),
    FieldMapping("top_p", ("rollout.top_p",), 1.0, "same value"),
    FieldMapping("top_k", ("rollout.top_k",), 0, "same value"),
    FieldMapping("mask_truncated_completions", ("rollout.mask_truncated",), False, "same value"),
    FieldMapping("learning_rate", ("optim.lr",), 1e-6, "same value"),
    FieldMapping("sync_ref_model", ("kl.sync_every", "kl.sync_alpha"), False,
                 "true: kl.sync_every = ref_model_sync_steps, kl.sync_alpha = ref_model_mixup_alpha"),
    FieldMapping("ref_model_sync_steps", ("kl.sync_every",), 512, "read when sync_ref_model is true"),
    FieldMapping("ref_model_mixup_alpha", ("kl.sync_alpha",), 0.6, "read when sync_ref_model is true"),
    FieldMapping("entropy_coef", ("loss.entropy_coef",), 0.0, "same value (the bonus's mean per-token entropy, as "
                                                              "TRL's, whatever the loss_type)"),
    FieldMapping("use_adaptive_entropy", ("loss.entropy_controller",), False, "true: adaptive, false: fixed"),
    FieldMapping("entropy_target", ("loss.entropy_target",), 0.2, "same value"),
    FieldMapping("entropy_coef_delta", ("loss.entropy_coef_delta",), 0.005, "same value"),
    FieldMapping("entropy_coef_min", ("loss.entropy_coef_min",), 0.0, "same value"),
    FieldMapping("entropy_coef_max", ("loss.entropy_coef_max",), 1.0, "same value"),
    FieldMapping("top_entropy_quantile", ("loss.top_entropy_quantile",), 1.0,
                 "same value; at importance_sampling_level sequence: none"),
    FieldMapping("off_policy_mask_threshold", ("loss.off_policy_mask_threshold",), None,
                 "unset: 0 (off); a value > 0: same value"),
    FieldMapping("sapo_temperature_pos", ("loss.sapo_temperature_pos",), 1.0, "same value"),
    FieldMapping("sapo_temperature_neg", ("loss.sapo_temperature_neg",), 1.05, "same value"),
    FieldMapping("vespo_k_pos", ("loss.vespo_k_pos",), 2.0, "same value"),
    FieldMapping("vespo_lambda_pos", ("loss.vespo_lambda_pos",), 3.0, "same value"),
    FieldMapping("vespo_k_neg", ("loss.vespo_k_neg",), 3.0, "same value"),
    FieldMapping("vespo_lambda_neg", ("loss.vespo_lambda_neg",), 2.0, "same value"),
)

ADAPTIVE_KL_FIELDS = (
    FieldMapping("kl_adaptation_method", ("kl.shaping", "kl.controller"), "none",
                 "none, clip, sigmoid, length_normalized: kl.shaping; dynamic: kl.controller dynamic"),
    FieldMapping("kl_clip_threshold", ("kl.clip_threshold",), 1.0, "same value"),
    FieldMapping("kl_target", ("kl.target", "kl.shaping_target"), 0.1, "both: the sigmoid's level and the "
                                                                     "controllers' target"),
    FieldMapping("dynamic_beta_decay", ("kl.decay",), 0.9, "same value"),
    FieldMapping("reward_threshold", ("kl.reward_threshold",), 0.8, "same value"),
    FieldMapping("beta_min", ("kl.beta_min",), 0.0, "same value"),
    FieldMapping("beta_schedule_steps", ("kl.schedule_steps",), 1000, "same value"),
    FieldMapping("kl_estimator", ("kl.estimator",), "k3", "same value"),
    FieldMapping("kl_importance_weight", ("kl.is_correction",), None,
                 "unset: in_graph when use_bias_correction_kl is true, else none"),
    FieldMapping("kl_controller", ("kl.controller",), None, "unset: dynamic for kl_adaptation_method dynamic, "
                                                            "else fixed"),
    FieldMapping("kl_horizon", ("kl.horizon",), 10000.0, "same value"),
)

#: TRL 1.16's defaults of the fields the mapping reads beyond the tables.
TRL_OTHER_DEFAULTS = {
    "gradient_accumulation_steps": 1, "steps_per_generation": None, "use_vllm": False, "vllm_mode": "colocate",
    "vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": "sequence_mask",
    "vllm_importance_sampling_clip_min": None, "vllm_importance_sampling_clip_max": 3.0,
    "vllm_importance_sampling_cap": None, "vllm_server_base_url": None, "vllm_server_host": "0.0.0.0",
    "vllm_server_port": 8000, "vllm_group_port": 51216,
    "multi_objective_aggregation": "sum_then_normalize", "reward_weights": None,
}
TRL_DEFAULTS = {**{row.field: row.default for row in TRL_FIELDS}, **TRL_OTHER_DEFAULTS}
ADAPTIVE_KL_DEFAULTS = {row.field: row.default for row in ADAPTIVE_KL_FIELDS}
#: Fields TRL's trainer applies around the loss that klgrpo's own trainer has no counterpart for; the bridge
#: keeps TRL's (it runs inside TRL's trainer), ``klgrpo explain`` names them.
TRL_RUNTIME_FIELDS = ("steps_per_generation", "multi_objective_aggregation", "reward_weights")
SCALE_REWARDS = {"group": "group", True: "group", "true": "group", "batch": "batch", "none": "none", False: "none",
                 "false": "none"}


def resolved_controller(values: MappingType[str, Any]) -> str:
    if values["kl_controller"] is not None:
        return values["kl_controller"]
    return "dynamic" if values["kl_adaptation_method"] == "dynamic" else "fixed"


def resolved_is_correction(values: MappingType[str, Any]) -> str:
    if values["kl_importance_weight"] is not None:
        return values["kl_importance_weight"]
    return "in_graph" if values["use_bias_correction_kl"] else "none"


def map_trl(fields: MappingType[str, Any], defaults: MappingType[str, Any] | None = None) -> Mapped:
    """TRL (and adaptive-KL) field values -> klgrpo keys; absent fields take ``defaults`` (another TRL release's,
    klgrpo.integrations.versions) or else TRL 1.16's (and the adaptive-KL fields') defaults. Fields whose
    objective klgrpo's math lacks land in ``unmapped`` with the reason."""
    v = {**TRL_DEFAULTS, **ADAPTIVE_KL_DEFAULTS, **(defaults or {}), **fields}
    out = Mapped()
    _map_kl(v, out)
    _map_policy(v, out)
    _map_sampler(v, out)
    _map_rest(v, out)
    drop_unread_kl_keys(out.config)
    return out


def _map_kl(v: dict, out: Mapped) -> None:
    method = v["kl_adaptation_method"]
    out.config.update({
        "kl.coef": float(v["beta"]), "kl.monitor": v["beta"] != 0.0, "kl.estimator": v["kl_estimator"],
        "kl.placement": "loss", "kl.is_correction": resolved_is_correction(v),
        "kl.controller": resolved_controller(v), "kl.shaping": "none" if method == "dynamic" else method,
        "kl.clip_threshold": v["kl_clip_threshold"], "kl.target": v["kl_target"],
        "kl.shaping_target": v["kl_target"], "kl.decay": v["dynamic_beta_decay"],
        "kl.reward_threshold": v["reward_threshold"], "kl.beta_min": v["beta_min"],
        "kl.schedule_steps": v["beta_schedule_steps"], "kl.horizon": v["kl_horizon"],
        "kl.log_ratio_clamp": DEFAULT_LOG_RATIO_CLAMP,
    })
    if v["sync_ref_model"]:
        out.config.update({"kl.sync_every": v["ref_model_sync_steps"], "kl.sync_alpha": v["ref_model_mixup_alpha"]})


def _map_policy(v: dict, out: Mapped) -> None:
    loss_type, sequence = v["loss_type"], v["importance_sampling_level"] == "sequence"
    if loss_type not in LOSS_TYPES:
        out.unmapped["loss_type"] = f"not a TRL {TRL_VERSION} loss type; choose one of: {', '.join(LOSS_TYPES)}"
        return
    policy, aggregation = LOSS_TYPES[loss_type]
    eps_high = v["epsilon"] if v["epsilon_high"] is None else v["epsilon_high"]
    eps_low, delta = v["epsilon"], v["delta"]
    if policy == "cispo":  # TRL: weight = sg(min(ratio, epsilon_high)), no lower bound
        eps_low, eps_high, delta = 1.0, eps_high - 1.0, None
    if policy in _UNCLIPPED:
        delta = None
    if sequence:
        _sequence_level(v, policy, out)
        policy = "vespo" if policy == "vespo" else "gspo"  # vespo's weight is its own sequence ratio
    out.config.update({"loss.policy_loss": policy, "loss.aggregation": aggregation, "loss.eps_low": float(eps_low),
                       "loss.eps_high": float(eps_high), "loss.delta": float(delta or 0.0)})
    if policy == "vespo" and v["use_vllm"] and v["vllm_importance_sampling_correction"]:
        out.unmapped["use_vllm"] = ("TRL's vespo folds vLLM's importance ratio into its Gamma weight; klgrpo samples "
                                    "with the policy it trains (set vllm_importance_sampling_correction false)")
    _map_entropy_and_masks(v, out)


def _map_entropy_and_masks(v: dict, out: Mapped) -> None:
    """The entropy bonus and its controller, the top-entropy and off-policy masks, SAPO's and VESPO's settings."""
    out.config.update({
        "loss.entropy_coef": float(v["entropy_coef"]),
        "loss.entropy_controller": "adaptive" if v["use_adaptive_entropy"] else "fixed",
        **{f"loss.{name}": float(v[name]) for name in (
            "entropy_target", "entropy_coef_delta", "entropy_coef_min", "entropy_coef_max", "top_entropy_quantile",
            "sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg",
            "vespo_lambda_neg")},
    })
    threshold = v["off_policy_mask_threshold"]
    if threshold is not None and threshold <= 0:
        out.unmapped["off_policy_mask_threshold"] = ("klgrpo's loss.off_policy_mask_threshold 0 is off; give a "
                                                     "threshold > 0 (DeepSeek-V3.2 suggests about 0.5), or None")
    else:
        out.config["loss.off_policy_mask_threshold"] = float(threshold or 0.0)


def _sequence_level(v: dict, policy: str, out: Mapped) -> None:
    """importance_sampling_level 'sequence' is klgrpo's gspo where TRL's and klgrpo's terms agree."""
    why = {
        "loss_type": (policy in ("cispo", "sapo"), f"klgrpo's {policy} weights each token by its own ratio, not "
                                                   f"the sequence's"),
        "delta": (v["delta"] is not None, "klgrpo's gspo has no delta cap (set delta to None)"),
        "use_bias_correction_kl": (
            v["beta"] != 0.0 and v["kl_importance_weight"] is None and v["use_bias_correction_kl"],
            "at importance_sampling_level 'sequence' TRL weights the KL term by the sequence ratio; klgrpo's KL "
            "weight is per token (set use_bias_correction_kl false, or kl_importance_weight to accept klgrpo's)"),
        "top_entropy_quantile": (v["top_entropy_quantile"] < 1.0 and policy != "vespo",
                                 "TRL's entropy mask is per token; klgrpo's gspo takes per-sequence factors only"),
        "vllm_importance_sampling_mode": (
            v["use_vllm"] and v["vllm_importance_sampling_correction"]
            and str(v["vllm_importance_sampling_mode"]).startswith("token"),
            "a token-level vLLM ratio is per token; klgrpo's gspo takes per-sequence factors only (use a "
            "sequence_* mode)"),
    }
    for name, (bad, reason) in why.items():
        if bad:
            out.unmapped[name] = reason


def _map_sampler(v: dict, out: Mapped) -> None:
    """use_vllm: klgrpo's vLLM sampler of the same mode (server: at the address TRL's client would use, its base
    URL or host and port, the weights over the NCCL group on TRL's group port, as TRL sends them); TRL's vLLM
    importance ratio is rollout.sampler_correction with the same mode and bounds (vllm_importance_sampling_cap:
    the deprecated name of clip_max)."""
    if not v["use_vllm"]:
        return
    out.config["rollout.sampler"] = "vllm_server" if v["vllm_mode"] == "server" else "vllm"
    if v["vllm_mode"] == "server":
        out.config["rollout.vllm.server_url"] = (v["vllm_server_base_url"]
                                                 or f"http://{v['vllm_server_host']}:{v['vllm_server_port']}")
        out.config["rollout.vllm.weight_transfer"] = "nccl"
        out.config["rollout.vllm.group_port"] = int(v["vllm_group_port"])
    if not v["vllm_importance_sampling_correction"] or "use_vllm" in out.unmapped:  # vespo: see _map_policy
        return
    clip_max = v["vllm_importance_sampling_cap"] or v["vllm_importance_sampling_clip_max"]
    out.config.update({"rollout.sampler_correction": v["vllm_importance_sampling_mode"],
                       "rollout.sampler_correction_min": float(v["vllm_importance_sampling_clip_min"] or 0.0),
                       "rollout.sampler_correction_max": float(clip_max or 0.0)})
    if v["beta"] != 0.0:
        out.unmapped["vllm_importance_sampling_correction"] = (
            "TRL weights the policy term by vLLM's ratio and leaves the KL term unweighted, so with samples from vLLM "
            "its KL gradient follows neither KL; klgrpo weights both terms (the same policy term, a KL term whose "
            "gradient follows the reverse KL): docs/kl_guide.md, 'A sampler that is not the policy'")
        out.source_runtime.add("vllm_importance_sampling_correction")  # klgrpo.trl: TRL's trainer applies its ratio


def _map_rest(v: dict, out: Mapped) -> None:
    if v["scale_rewards"] not in SCALE_REWARDS:
        out.unmapped["scale_rewards"] = f"{v['scale_rewards']!r} is not one of TRL's scalings"
    else:
        out.config["loss.advantage_scale"] = SCALE_REWARDS[v["scale_rewards"]]
    out.config.update({
        "loss.std_eps": 1e-4, "loss.std_ddof": 1, "train.num_iterations": int(v["num_iterations"]),
        "rollout.group_size": v["num_generations"], "rollout.max_new_tokens": v["max_completion_length"],
        "rollout.temperature": v["temperature"], "rollout.top_p": v["top_p"], "rollout.top_k": v["top_k"],
        "rollout.mask_truncated": v["mask_truncated_completions"], "optim.lr": v["learning_rate"],
    })
    accumulation = v["gradient_accumulation_steps"]
    steps_per_generation = v["steps_per_generation"] or accumulation
    out.off_policy = v["num_iterations"] > 1 or steps_per_generation > accumulation
    runtime = {
        "steps_per_generation": (steps_per_generation > accumulation,
                                 "one generation feeds several optimizer steps on different completions; "
                                 "klgrpo's train.num_iterations reuses the whole batch"),
        "multi_objective_aggregation": (v["multi_objective_aggregation"] != "sum_then_normalize",
                                        "klgrpo sums the weighted rewards, then normalises"),
        "reward_weights": (v["reward_weights"] is not None, "give each reward its weight in rewards.functions"),
    }
    for name, (bad, reason) in runtime.items():
        if bad and name not in out.unmapped:
            out.unmapped[name] = reason
            out.source_runtime.add(name)
