"""klgrpo's KL regularisation on TRL's own GRPOTrainer (``pip install "klgrpo[trl]"``).

    from klgrpo.trl import GRPOConfig, GRPOTrainer      # instead of: from trl import ...
    args = GRPOConfig(..., beta=0.001, kl_adaptation_method="length_normalized")

Only the loss and beta change: ``GRPOTrainer._compute_loss`` computes the per-token log-probs exactly as TRL
does and hands TRL's tensors to :func:`klgrpo.math.objective.grpo_objective`, the objective klgrpo's own
trainer and ``klgrpo verify-kl`` use; beta comes from a klgrpo controller updated once per optimizer step.
Generation (vLLM included), data, rewards, accelerate / DeepSpeed / FSDP, logging and checkpoints stay TRL's.
With the defaults (kl_adaptation_method "none", estimator k3, the importance weight TRL's
``use_bias_correction_kl`` selects) loss and gradient equal stock TRL's for every loss_type (grpo, bnpo, dr_grpo,
dapo, luspo, cispo, sapo, vespo), with delta, importance_sampling_level "sequence" (GSPO), the entropy bonus and
its adaptive controller, the top-entropy and the off-policy masks; klgrpo.integrations.trl_mapping holds the one
table from TRL's and the adaptive-KL fields to klgrpo's config. docs/trl.md has the details.
"""

from __future__ import annotations

from importlib import metadata

SUPPORTED_TRL = ">=1.16,<1.17"


def _check_trl_version() -> None:
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    try:
        found = metadata.version("trl")
    except metadata.PackageNotFoundError:
        found = None
    if found is None or Version(found) not in SpecifierSet(SUPPORTED_TRL):
        have = "TRL is not installed" if found is None else f"TRL {found} is installed"
        raise ImportError(f'klgrpo.trl supports TRL {SUPPORTED_TRL} but {have}; run: pip install "klgrpo[trl]"')


_check_trl_version()

import json  # noqa: E402  (after the version check, so a wrong TRL fails with the one-line message)
import os  # noqa: E402
import warnings  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import trl  # noqa: E402

from klgrpo.config.schema import GRPOConfig as KlgrpoConfig  # noqa: E402
from klgrpo.config.terms import build_entropy_controller  # noqa: E402
from klgrpo.config.terms import build_kl_controller as build_controller_from_config  # noqa: E402
from klgrpo.errors import ConfigError  # noqa: E402
from klgrpo.integrations.mapping import mapped_objective  # noqa: E402
from klgrpo.integrations.trl_mapping import (  # noqa: E402
    ADAPTIVE_KL_DEFAULTS,
    ADAPTIVE_KL_FIELDS,
    LOSS_TYPES,
    TRL_DEFAULTS,
    map_trl,
    resolved_controller,
    resolved_is_correction,
)
from klgrpo.math.aggregation import Normalizer  # noqa: E402
from klgrpo.math.kl import ESTIMATORS  # noqa: E402
from klgrpo.math.kl_control import CONTROLLERS, KLController  # noqa: E402
from klgrpo.math.kl_shaping import SHAPINGS  # noqa: E402
from klgrpo.math.objective import ObjectiveInputs, entropy_threshold  # noqa: E402
from klgrpo.math.policy_loss import IS_CORRECTIONS  # noqa: E402
from klgrpo.store.checkpoint import check_checkpoint  # noqa: E402

#: The method names of the original adaptive-KL GRPOConfig: klgrpo's shapings plus the dynamic schedule.
KL_ADAPTATION_METHODS = (*SHAPINGS.names(), "dynamic")
CONTROLLER_FILE = "klgrpo_kl_controller.json"


def _help(text: str, choices: tuple[str, ...] | None = None) -> dict[str, Any]:
    return {"help": text} if choices is None else {"help": text, "choices": list(choices)}


@dataclass
class GRPOConfig(trl.GRPOConfig):
    """TRL's GRPOConfig plus the adaptive-KL fields; every TRL field keeps its meaning and default."""

    kl_adaptation_method: str = field(default=ADAPTIVE_KL_DEFAULTS["kl_adaptation_method"], metadata=_help(
        "How the KL penalty adapts: 'none' (TRL's behaviour), 'clip' (per-token KL = min(KL, kl_clip_threshold)), "
        "'sigmoid' (per-token KL = sigmoid(KL - kl_target) * KL), 'length_normalized' (per-token KL divided by "
        "the completion's length), 'dynamic' (beta *= dynamic_beta_decay while the mean reward exceeds "
        "reward_threshold; beta = beta_min after beta_schedule_steps steps).", KL_ADAPTATION_METHODS))
    kl_clip_threshold: float = field(default=ADAPTIVE_KL_DEFAULTS["kl_clip_threshold"], metadata=_help(
        "clip: upper bound on the per-token KL; tokens above it get no KL gradient."))
    kl_target: float = field(default=ADAPTIVE_KL_DEFAULTS["kl_target"], metadata=_help(
        "sigmoid: the KL level where the gate is 1/2; also the target KL of the adaptive, step and dual "
        "controllers (mean per-token KL)."))
    dynamic_beta_decay: float = field(default=ADAPTIVE_KL_DEFAULTS["dynamic_beta_decay"], metadata=_help(
        "dynamic: multiply beta by this after each step whose mean reward exceeds reward_threshold."))
    reward_threshold: float = field(default=ADAPTIVE_KL_DEFAULTS["reward_threshold"], metadata=_help(
        "dynamic: the mean reward above which beta decays."))
    beta_min: float = field(default=ADAPTIVE_KL_DEFAULTS["beta_min"], metadata=_help(
        "dynamic and dual: lower bound on beta (dynamic sets beta to it after beta_schedule_steps steps)."))
    beta_schedule_steps: int = field(default=ADAPTIVE_KL_DEFAULTS["beta_schedule_steps"], metadata=_help(
        "dynamic: after this many optimizer steps beta = beta_min (0: never)."))
    kl_estimator: str = field(default=ADAPTIVE_KL_DEFAULTS["kl_estimator"], metadata=_help(
        "Per-token KL estimator (klgrpo verify-kl proves what each one's gradient does): 'k3' (TRL's), 'k1', "
        "'k2', 'k1_st', 'k3_st' (value of k3, reverse-KL gradient of k2).", tuple(ESTIMATORS.names())))
    kl_importance_weight: str | None = field(default=ADAPTIVE_KL_DEFAULTS["kl_importance_weight"], metadata=_help(
        "Importance weight w = pi/pi_old on the KL term: 'in_graph' (w keeps its gradient), 'detached', 'none'. "
        "Unset: 'in_graph' when use_bias_correction_kl is true (TRL's default), else 'none'.", IS_CORRECTIONS))
    kl_controller: str | None = field(default=ADAPTIVE_KL_DEFAULTS["kl_controller"], metadata=_help(
        "How beta evolves: 'fixed', 'adaptive' (Ziegler et al.: target kl_target, horizon kl_horizon), 'step', "
        "'dual' (target kl_target), 'dynamic'. Unset: 'dynamic' when kl_adaptation_method is 'dynamic', else "
        "'fixed'.", tuple(CONTROLLERS.names())))
    kl_horizon: float = field(default=ADAPTIVE_KL_DEFAULTS["kl_horizon"], metadata=_help(
        "adaptive controller: horizon in samples (Ziegler et al. used ~10000)."))

    def __post_init__(self):
        super().__post_init__()
        validate_kl_fields(self)

    @property
    def resolved_kl_controller(self) -> str:
        return resolved_controller(self._field_values())

    @property
    def resolved_kl_importance_weight(self) -> str:
        return resolved_is_correction(self._field_values())

    def _field_values(self) -> dict[str, Any]:
        names = [*TRL_DEFAULTS, *ADAPTIVE_KL_DEFAULTS]
        return {name: getattr(self, name) for name in names}


def _check_choice(name: str, value: Any, choices) -> None:
    if value not in choices:
        raise ConfigError(f"GRPOConfig.{name}={value!r} is not supported; choose one of: {', '.join(choices)}")


def validate_kl_fields(args: GRPOConfig) -> None:
    """One clear ConfigError for a field or combination the bridge cannot honour."""
    _check_choice("kl_adaptation_method", args.kl_adaptation_method, KL_ADAPTATION_METHODS)
    _check_choice("kl_estimator", args.kl_estimator, ESTIMATORS.names())
    if args.kl_importance_weight is not None:
        _check_choice("kl_importance_weight", args.kl_importance_weight, IS_CORRECTIONS)
    if args.kl_controller is not None:
        _check_choice("kl_controller", args.kl_controller, CONTROLLERS.names())
    if args.kl_adaptation_method == "dynamic" and args.resolved_kl_controller != "dynamic":
        raise ConfigError(f"GRPOConfig.kl_adaptation_method='dynamic' is the 'dynamic' controller; drop "
                          f"kl_controller={args.kl_controller!r} or pick another kl_adaptation_method")
    if args.beta == 0.0 and (args.kl_adaptation_method != "none" or args.resolved_kl_controller != "fixed"):
        raise ConfigError(f"GRPOConfig.kl_adaptation_method={args.kl_adaptation_method!r} with kl_controller="
                          f"{args.resolved_kl_controller!r} needs beta > 0 (TRL loads no reference model at beta=0)")
    build_kl_controller(args)  # the mapping's refusals, then the controller's own checks (target > 0, ...)
    target = kl_gradient_target(args)
    if args.beta != 0.0 and target in ("neither", "zero"):
        warnings.warn(f"GRPOConfig: kl_estimator={args.kl_estimator!r} with kl_importance_weight="
                      f"{args.resolved_kl_importance_weight!r} has an expected KL gradient of '{target}' (see "
                      f"`klgrpo verify-kl`); 'k3' with 'in_graph' or 'k3_st' with 'detached' follow the reverse KL",
                      stacklevel=3)


def klgrpo_config(args: GRPOConfig) -> KlgrpoConfig:
    """The klgrpo config of these fields (klgrpo.integrations.trl_mapping); ConfigError for a field whose objective
    klgrpo's math lacks. TRL's own trainer keeps the fields it applies around the loss (entropy and off-policy masks,
    vLLM's importance ratio, steps_per_generation)."""
    mapped = map_trl(args._field_values())
    for name, why in mapped.unmapped.items():
        if name not in mapped.source_runtime:
            raise ConfigError(f"GRPOConfig.{name}={getattr(args, name)!r} is not supported by klgrpo.trl: {why}")
    return mapped.klgrpo_config()


def kl_gradient_target(args: GRPOConfig) -> str:
    """What the expected per-token gradient of the unshaped KL term follows, from the estimator registry's
    declarations (which ``klgrpo verify-kl`` checks): reverse, forward, zero or neither."""
    weight = args.resolved_kl_importance_weight
    sampling = {"in_graph": "off_policy_in_graph", "detached": "off_policy_detached",
                "none": "on_policy" if args.num_iterations == 1 else "off_policy_none"}[weight]
    return ESTIMATORS[args.kl_estimator].gradient_target("loss", sampling)


def build_kl_controller(args: GRPOConfig) -> KLController:
    try:
        return build_controller_from_config(klgrpo_config(args).kl)
    except ValueError as err:
        raise ConfigError(f"GRPOConfig: kl_controller={args.resolved_kl_controller!r}: {err}") from None


def reload_colocated_weights_on_cpu(generation) -> bool:
    """On the CPU, TRL's colocated vLLM engine takes the policy's weights through vLLM's ``reload_weights``
    instead of TRL's ``model.load_weights``; returns whether it does.

    vLLM's CPU backend repacks every linear layer's weight for its GEMM kernel after loading (oneDNN, or the AMX
    kernel for bfloat16) and leaves an empty plain Parameter in its place, so TRL's ``load_weights`` into the
    running model fails at the first sync ("'Parameter' object has no attribute 'weight_loader'") on every CPU
    whose oneDNN build takes the engine's dtype (AVX512-BF16 or AMX for TRL's bfloat16 engine). ``reload_weights``
    restores the layers' loading form, loads the tensors and repacks them: klgrpo's own vLLM sampler syncs the
    same way. The tensors are TRL's (``_iter_named_params``: gathered under FSDP / ZeRO-3, LoRA merged), taken in
    one pass as ``reload_weights`` needs, with a tied output embedding sent under its own name too (TRL walks
    ``named_parameters``, which lists a tied weight once; a reload leaves a layer that gets no weight unloaded)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    tied = _tied_output_embedding(generation.accelerator.unwrap_model(generation.model))

    def weights():
        for name, tensor in generation._iter_named_params():
            yield name, tensor
            if name in tied:
                yield tied[name], tensor

    def sync_weights():
        generation.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights()})
        generation.llm.reset_prefix_cache()

    generation.sync_weights = sync_weights
    return True


def _tied_output_embedding(model) -> dict[str, str]:
    """{the input embedding's weight name: the output embedding's} where the model ties them, else {}."""
    from klgrpo.backends.weights import base_model

    base = base_model(model)
    config = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    inputs, outputs = base.get_input_embeddings(), base.get_output_embeddings()
    if not getattr(config, "tie_word_embeddings", False) or inputs is None or outputs is None:
        return {}
    names = {id(module): name for name, module in base.named_modules()}
    return {f"{names[id(inputs)]}.weight": f"{names[id(outputs)]}.weight"}


class GRPOTrainer(trl.GRPOTrainer):
    """TRL's GRPOTrainer whose loss is klgrpo's ``grpo_objective`` and whose beta is a klgrpo controller.

    ``self.beta`` keeps TRL's meaning (non-zero: TRL computes the reference log-probs); the beta in the loss is
    ``self.kl_controller.value``, updated once per optimizer step and saved as JSON in every checkpoint.
    """

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, *rest, **kwargs):
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = GRPOConfig(f"{str(name).rstrip('/').split('/')[-1]}-GRPO")
        if not isinstance(args, GRPOConfig):
            raise ConfigError("klgrpo.trl.GRPOTrainer needs args from klgrpo.trl.GRPOConfig, not "
                              f"{type(args).__module__}.{type(args).__name__}")
        if isinstance(model, str):  # a klgrpo checkpoint is read only if its weights are the ones saved
            check_checkpoint(model, "model")
        super().__init__(model, reward_funcs, args, *rest, **kwargs)
        if getattr(self, "use_vllm", False) and args.vllm_mode == "colocate":
            reload_colocated_weights_on_cpu(self.vllm_generation)
        self.klgrpo_config = klgrpo_config(args)
        self.kl_controller = build_kl_controller(args)
        self.entropy_controller = build_entropy_controller(self.klgrpo_config.loss)
        self._kl_window: torch.Tensor | None = None  # [raw KL sum, tokens, sequences] of this optimizer step
        self._entropy_window: torch.Tensor | None = None  # [entropy sum, tokens] of this optimizer step
        self._last_reward: float | None = None

    # ---- rewards feed the dynamic controller -------------------------------------------------------------
    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        if self.model.training and self._metrics["train"]["reward"]:
            self._last_reward = self._metrics["train"]["reward"][-1]  # mean over all processes' completions
        return out

    # ---- the loss --------------------------------------------------------------------------------------------
    def _compute_loss(self, model, inputs):
        mode = "train" if self.model.training else "eval"
        logps, entropies, aux_loss = self._policy_logps(model, inputs)
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        advantages = inputs["advantages"]
        advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
        old_logps = inputs.get("old_per_token_logps")
        old_logps = logps.detach() if old_logps is None else old_logps
        ref_logps = inputs.get("ref_per_token_logps") if self.beta != 0.0 else None
        beta = self.kl_controller.value
        if self.use_vllm and self.vllm_importance_sampling_correction:
            # TRL's vLLM importance ratio c >= 0 multiplies the policy term only; folded into the advantages:
            # -min(r A c, clip(r) A c) = c * -min(r A, clip(r) A), so the KL term stays unweighted, as in TRL
            advantages = advantages * inputs["importance_sampling_ratio"]
        entropy_coef = self.entropy_controller.applied
        micro_batch = ObjectiveInputs(logps, old_logps, ref_logps, advantages, mask, entropy_BT=entropies,
                                      sampling_logp_BT=inputs.get("sampling_per_token_logps"))
        out = mapped_objective(self.klgrpo_config, beta, micro_batch, self._normalizer(inputs, mask, mode),
                               entropy_coef=entropy_coef, entropy_cut=self._entropy_cut(entropies, mask))
        loss = out.loss
        if self.aux_loss_enabled:
            accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
            loss = loss + self.router_aux_loss_coef * aux_loss / accumulation
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss).mean().item())
        self._log_step_metrics(mode, out.sums, logps, old_logps, advantages, entropies, mask, beta)
        if mode == "train" and out.sums.raw_kl is not None:
            self._update_controller(out.sums.raw_kl, mask)
        if mode == "train" and self.klgrpo_config.loss.entropy_controller != "fixed":
            self._update_entropy_controller(out.sums.acted_entropy, out.sums.acted_tokens)
        if mode == "train" and self._entropy_bonus_enabled and self.accelerator.sync_gradients:
            self._metrics[mode]["entropy_coef"].append(self.entropy_controller.value)  # TRL's name and value
        return loss

    def _policy_logps(self, model, inputs):
        """Per-token log-probs, entropies and MoE aux loss of the completion, computed as TRL computes them."""
        prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
        return self._get_per_token_logps_and_entropies(
            model,
            torch.cat([prompt_ids, completion_ids], dim=1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1),
            completion_ids.size(1),
            compute_entropy=True,
            compute_aux_loss=self.aux_loss_enabled,
            **{key: inputs.get(key) for key in (
                "pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
                "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")},
        )

    def _entropy_cut(self, entropies, mask):
        """The top-entropy mask's threshold over every process's loss-mask tokens, as TRL pools them (None with
        one process or the mask off: the objective takes this micro-batch's tokens)."""
        if self.top_entropy_quantile >= 1.0 or self.accelerator.num_processes == 1:
            return None
        pad = -1e9  # entropies are >= 0: the sentinel never collides with a value
        local = entropies.detach()[mask.bool()].float()
        pooled = self.accelerator.gather(self.accelerator.pad_across_processes(local, dim=0, pad_index=pad))
        pooled = pooled[pooled != pad]
        return entropy_threshold(pooled, torch.ones_like(pooled), self.top_entropy_quantile)

    def _normalizer(self, inputs, mask, mode: str) -> Normalizer:
        """The global counts that make klgrpo's aggregation equal TRL's normalisation of this loss_type."""
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
        if self.loss_type in ("dapo", "cispo", "vespo"):  # the window's tokens on all processes, per process
            tokens = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                tokens = tokens * accumulation / self.args.steps_per_generation
        else:  # bnpo: this micro-batch's tokens, scaled for accumulation like TRL
            tokens = mask.sum().clamp(min=1.0) * accumulation
        return Normalizer(num_sequences=float(mask.shape[0] * accumulation), num_tokens=tokens,
                          max_len=float(self.max_completion_length))

    # ---- metrics and the controller ---------------------------------------------------------------------------
    def _global_mean(self, total: torch.Tensor, count: torch.Tensor) -> float:
        both = self.accelerator.reduce(torch.stack([total.float(), count.float()]), reduction="sum")
        return (both[0] / both[1].clamp(min=1.0)).item()

    def _log_step_metrics(self, mode, sums, logps, old_logps, advantages, entropies, mask, beta) -> None:
        metrics = self._metrics[mode]
        tokens = mask.sum()
        metrics["adaptive_kl/current_beta"].append(beta)
        if sums.raw_kl is not None:
            raw = self._global_mean(sums.raw_kl, tokens)
            metrics["adaptive_kl/raw_kl"].append(raw)
            metrics["adaptive_kl/adapted_kl"].append(self._global_mean(sums.adapted_kl, tokens))
            metrics["kl"].append(raw)  # TRL's name: the mean per-token estimator value
        metrics["entropy"].append(self._global_mean((entropies * mask).sum(), tokens))
        ratio = torch.exp(logps.detach() - old_logps)
        low = (ratio < 1 - self.epsilon_low) & (advantages < 0)
        high = (ratio > 1 + self.epsilon_high) & (advantages > 0)
        for name, clipped in (("low_mean", low), ("high_mean", high), ("region_mean", low | high)):
            metrics[f"clip_ratio/{name}"].append(self._global_mean((clipped.float() * mask).sum(), tokens))

    def _update_controller(self, raw_kl_sum: torch.Tensor, mask: torch.Tensor) -> None:
        """Add this micro-batch to the step's window; at the optimizer step feed the global mean KL back."""
        stats = torch.stack([raw_kl_sum.detach().float(), mask.sum().float(),
                             torch.tensor(float(mask.shape[0]), device=mask.device)])
        self._kl_window = stats if self._kl_window is None else self._kl_window + stats
        if self.accelerator.sync_gradients:
            total = self.accelerator.reduce(self._kl_window, reduction="sum")
            observed = (total[0] / total[1].clamp(min=1.0)).item()
            self.kl_controller.update(observed, n_steps=int(total[2].item()), reward=self._last_reward)
            self._kl_window = None

    def _update_entropy_controller(self, entropy_sum: torch.Tensor, tokens: torch.Tensor) -> None:
        """As TRL: add this micro-batch's entropy over the tokens the bonus acts on; at the optimizer step feed the
        window's global mean to the entropy controller (TRL's own attributes follow it, for its checkpoints)."""
        stats = torch.stack([entropy_sum.detach().float(), tokens.detach().float()])
        self._entropy_window = stats if self._entropy_window is None else self._entropy_window + stats
        if self.accelerator.sync_gradients:
            total = self.accelerator.reduce(self._entropy_window, reduction="sum")
            self.entropy_controller.observe((total[0] / total[1].clamp(min=1.0)).item())
            self.entropy_coef, self._last_world_entropy = (self.entropy_controller.value,
                                                           self.entropy_controller.last_entropy)
            self._entropy_window = None

    # ---- checkpoints: the controller's state as JSON ---------------------------------------------------------
    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if self.args.should_save:
            folder = os.path.join(self._get_output_dir(trial=trial), f"checkpoint-{self.state.global_step}")
            state = {"controller": self.args.resolved_kl_controller, "state": self.kl_controller.state_dict(),
                     "entropy_controller": self.klgrpo_config.loss.entropy_controller,
                     "entropy_state": self.entropy_controller.state_dict()}
            with open(os.path.join(folder, CONTROLLER_FILE), "w") as f:
                json.dump(state, f)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:
            self.restore_kl_controller(checkpoint)

    def restore_kl_controller(self, checkpoint: str) -> None:
        """Load the controller state saved in ``checkpoint`` (a checkpoint-N folder), if it holds one."""
        path = os.path.join(checkpoint, CONTROLLER_FILE)
        if not os.path.exists(path):
            return
        with open(path) as f:
            saved = json.load(f)
        if saved.get("controller") != self.args.resolved_kl_controller:
            raise ConfigError(f"{path} holds the state of kl_controller={saved.get('controller')!r} but this run "
                              f"uses {self.args.resolved_kl_controller!r}; resume with the same kl settings")
        self.kl_controller.load_state_dict(saved["state"])
        if saved.get("entropy_controller") == self.klgrpo_config.loss.entropy_controller:
            self.entropy_controller.load_state_dict(saved["entropy_state"])
            self.entropy_coef = self.entropy_controller.value
            self._last_world_entropy = self.entropy_controller.last_entropy
        elif "entropy_controller" in saved:
            raise ConfigError(f"{path} holds the state of entropy controller {saved['entropy_controller']!r} but "
                              f"this run uses {self.klgrpo_config.loss.entropy_controller!r}; resume with the same "
                              f"use_adaptive_entropy")


__all__ = ["ADAPTIVE_KL_FIELDS", "GRPOConfig", "GRPOTrainer", "KL_ADAPTATION_METHODS", "LOSS_TYPES", "SUPPORTED_TRL"]
