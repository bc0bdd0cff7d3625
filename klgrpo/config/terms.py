"""The run's config as the math's typed arguments: the KL term, the policy term, the controller and its
parameters, and the step's whole plan (``StepPlan``: everything a GRPOStep reads from the config).

The trainer, the TRL bridge (klgrpo.trl) and ``klgrpo explain`` build what klgrpo/math/ takes here, so a setting
reaches the objective and the controller through one mapping.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace
from typing import Any

from klgrpo.backends.samplers import SamplingParams
from klgrpo.config.schema import GRPOConfig, KLConfig, LossConfig, RolloutConfig
from klgrpo.config.validation import divergence_masks, policy_settings
from klgrpo.math.kl_control import (
    CONTROLLERS,
    ENTROPY_CONTROLLERS,
    EntropyController,
    KLController,
    auto_horizon,
    build_controller,
    init_keywords,
)
from klgrpo.math.objective import EntropyTerm, KLTerm, PolicyTerm
from klgrpo.math.policy_loss import POLICY_LOSSES
from klgrpo.math.sampler_correction import SamplerCorrection

#: A controller's constructor keyword -> the KLConfig field that sets it, where the two names differ.
CONTROLLER_FIELDS = {"lr": "dual_lr"}


def kl_term(kl: KLConfig, beta: float) -> KLTerm:
    """How the KL enters this step's objective; ``beta`` is the controller's current value."""
    return KLTerm(coef=beta, estimator=kl.estimator, placement=kl.placement, is_correction=kl.is_correction,
                  shaping=kl.shaping, clip_threshold=kl.clip_threshold, shaping_target=kl.shaping_target,
                  clamp=kl.log_ratio_clamp or None, reward_mode=kl.reward_mode,
                  masked_tokens=kl.masked_tokens)


def policy_term(loss: LossConfig) -> PolicyTerm:
    """The surrogate, its clip and its own settings (the dataclass it registered, filled from the config:
    ``validation.policy_settings``); the config's 0 ("off") for delta and dual_clip becomes None."""
    declared = POLICY_LOSSES.params(loss.policy_loss)
    return PolicyTerm(name=loss.policy_loss, eps_low=loss.eps_low, eps_high=loss.eps_high,
                      delta=loss.delta or None, dual_clip=loss.dual_clip or None,
                      off_policy_mask=loss.off_policy_mask_threshold or None,
                      params=declared(**policy_settings(loss)) if declared is not None else None)


def sampler_correction(rollout: RolloutConfig) -> SamplerCorrection:
    """The sampler-mismatch correction; a bound of 0 is "none" on that side (a ratio is never below 0)."""
    return SamplerCorrection(mode=rollout.sampler_correction, clip_min=rollout.sampler_correction_min or None,
                             clip_max=rollout.sampler_correction_max or None, masks=divergence_masks(rollout))


def entropy_term(loss: LossConfig, coef: float) -> EntropyTerm:
    """How the entropy enters this step's objective; ``coef`` is the entropy controller's applied value."""
    return EntropyTerm(coef=coef, top_quantile=loss.top_entropy_quantile)


def entropy_in_use(loss: LossConfig) -> bool:
    """Whether the loss reads the policy's entropy (a bonus, its adaptive controller, or the top-entropy mask)."""
    return loss.entropy_coef != 0.0 or loss.entropy_controller != "fixed" or loss.top_entropy_quantile < 1.0


def build_entropy_controller(loss: LossConfig) -> EntropyController:
    """The controller ``loss.entropy_controller`` starting at ``loss.entropy_coef``; its keywords are loss.* fields
    of the same name."""
    cls = ENTROPY_CONTROLLERS[loss.entropy_controller]
    return cls(loss.entropy_coef, **_keywords(cls, loss, {}, "loss.entropy_controller", "LossConfig"))


def controller_params(kl: KLConfig, steps: int = 0, batch: int = 0) -> dict[str, Any]:
    """The keyword arguments of ``kl.controller``'s constructor, read from the KLConfig fields of the same name
    (CONTROLLER_FIELDS where they differ); a keyword with a default and no field keeps its default. kl.horizon
    auto is sized from the run's ``steps`` and ``batch`` (sequences per update; see ``run_horizon``)."""
    params = _keywords(CONTROLLERS[kl.controller], kl, CONTROLLER_FIELDS, f"controller {kl.controller!r}", "KLConfig")
    if params.get("horizon") == "auto":
        if steps <= 0 or batch <= 0:
            raise ValueError("kl.horizon auto is sized from the run: pass its train.steps and batch")
        params["horizon"] = auto_horizon(steps, batch)
    return params


def run_horizon(cfg: GRPOConfig) -> float:
    """kl.horizon as the run uses it: the number, or auto sized from train.steps and the batch."""
    batch = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    return auto_horizon(cfg.train.steps, batch) if cfg.kl.horizon == "auto" else float(cfg.kl.horizon)


def run_controller_params(cfg: GRPOConfig) -> dict[str, Any]:
    """``controller_params`` of the run's kl.controller, with kl.horizon auto sized from the run."""
    return controller_params(cfg.kl, cfg.train.steps, cfg.rollout.prompts_per_step * cfg.rollout.group_size)


def controller_fields(name: str) -> tuple[str, ...]:
    """The KLConfig fields the controller registered as ``name`` reads: its constructor keywords, renamed by
    CONTROLLER_FIELDS (a keyword that no field sets keeps its default)."""
    return tuple(CONTROLLER_FIELDS.get(keyword, keyword) for keyword in init_keywords(CONTROLLERS[name]))


def _keywords(cls, config, renamed: dict[str, str], what: str, config_name: str) -> dict[str, Any]:
    """``cls``'s constructor keywords after init_coef, read from ``config``'s fields of the same name."""
    params = {}
    for name, param in init_keywords(cls).items():
        source = renamed.get(name, name)
        if hasattr(config, source):
            params[name] = getattr(config, source)
        elif param.default is inspect.Parameter.empty:
            raise TypeError(f"{what} takes {name!r}, which no field sets: add the field to {config_name} (or map "
                            "it by name)")
    return params


def build_kl_controller(kl: KLConfig, steps: int = 0, batch: int = 0) -> KLController:
    """The controller ``kl.controller`` starting at beta = ``kl.coef`` (it applies its own floors, e.g. the dual
    controller's DUAL_BETA_FLOOR); ``steps`` and ``batch`` size kl.horizon auto."""
    return build_controller(kl.controller, kl.coef, **controller_params(kl, steps, batch))


@dataclass(frozen=True)
class StepPlan:
    """Everything a GRPOStep reads from the config, read once per run from the validated config (``step_plan``):
    the step never looks at the config itself."""

    sampling: SamplingParams      # how the rollout samples; the step sets the sampler it was built with
    prompts_per_step: int         # N, all processes together
    data_source: str              # named in the refusal of a prompt too long for the model
    micro_batch_size: int         # 0: the whole batch in one forward/backward
    mask_truncated: bool          # truncated completions out of the loss
    num_iterations: int           # updates per generated batch
    advantage_scale: str          # group_advantages' scale, eps and ddof
    std_eps: float
    std_ddof: int
    aggregation: str
    policy: PolicyTerm
    kl: KLTerm                    # the fixed parts; beta at a step is the controller's (``kl_term``)
    entropy_in_loss: bool         # the loss reads the policy's entropy (bonus, its controller, top-entropy mask)
    entropy_metrics: bool         # train.entropy_metrics
    top_entropy_quantile: float
    max_grad_norm: float          # inf: no clipping
    sync_every: int               # reference sync (0: never) and its mix
    sync_alpha: float
    seed: int                     # train.seed: a resume on another process count reseeds from it
    sampler_correction: SamplerCorrection = SamplerCorrection()  # the sampler-mismatch weight (rollout.*)
    trains_kept_sets: bool = False  # rollout.truncation policy with a filter on: pi_S, pi_old_S and ref_S
    old_from_sampler: bool = False  # rollout.old_logprobs sampler: pi_old is the sampler's log-probs mu
    max_staleness: int = 0        # rollout.max_staleness: batch t drawn from the weights K updates back

    @property
    def with_entropy(self) -> bool:
        """The log-prob pass computes the entropy: for the metrics or for the loss."""
        return self.entropy_metrics or self.entropy_in_loss

    def kl_term(self, beta: float) -> KLTerm:
        return replace(self.kl, coef=beta)

    def entropy_term(self, coef: float) -> EntropyTerm:
        return EntropyTerm(coef=coef, top_quantile=self.top_entropy_quantile)


def step_plan(cfg: GRPOConfig) -> StepPlan:
    """The plan of a run's steps, from its validated config (GRPOConfig.validate: once per run)."""
    r, t, loss = cfg.rollout, cfg.train, cfg.loss
    sampling = SamplingParams(group_size=r.group_size, max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                              top_p=r.top_p, top_k=r.top_k, min_p=r.min_p, system_prompt=cfg.data.system_prompt,
                              as_chat=cfg.data.as_chat, compiled=t.compile)
    return StepPlan(sampling=sampling, prompts_per_step=r.prompts_per_step, data_source=cfg.data.source,
                    micro_batch_size=t.micro_batch_size, mask_truncated=r.mask_truncated,
                    num_iterations=t.num_iterations, advantage_scale=loss.advantage_scale, std_eps=loss.std_eps,
                    std_ddof=loss.std_ddof, aggregation=loss.aggregation, policy=policy_term(loss),
                    kl=kl_term(cfg.kl, cfg.kl.coef), entropy_in_loss=entropy_in_use(loss),
                    entropy_metrics=t.entropy_metrics, top_entropy_quantile=loss.top_entropy_quantile,
                    max_grad_norm=cfg.optim.max_grad_norm if cfg.optim.max_grad_norm > 0 else float("inf"),
                    sync_every=cfg.kl.sync_every, sync_alpha=cfg.kl.sync_alpha, seed=t.seed,
                    sampler_correction=sampler_correction(r),
                    trains_kept_sets=r.truncation == "policy" and sampling.filters.truncates,
                    old_from_sampler=r.old_logprobs == "sampler", max_staleness=r.max_staleness)
