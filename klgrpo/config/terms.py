"""The run's config as the math's typed arguments: the KL term, the policy term, the controller and its
parameters.

The trainer, the TRL bridge (klgrpo.trl) and ``klgrpo explain`` build what klgrpo/math/ takes here, so a setting
reaches the objective and the controller through one mapping.
"""

from __future__ import annotations

import inspect
from typing import Any

from klgrpo.math.kl_control import (CONTROLLERS, ENTROPY_CONTROLLERS, EntropyController, KLController, auto_horizon,
                                    build_controller, init_keywords)
from klgrpo.math.objective import EntropyTerm, KLTerm, PolicyTerm
from klgrpo.config.schema import GRPOConfig, KLConfig, LossConfig

#: A controller's constructor keyword -> the KLConfig field that sets it, where the two names differ.
CONTROLLER_FIELDS = {"lr": "dual_lr"}


def kl_term(kl: KLConfig, beta: float) -> KLTerm:
    """How the KL enters this step's objective; ``beta`` is the controller's current value."""
    return KLTerm(coef=beta, estimator=kl.estimator, placement=kl.placement, is_correction=kl.is_correction,
                  shaping=kl.shaping, clip_threshold=kl.clip_threshold, shaping_target=kl.shaping_target,
                  clamp=kl.log_ratio_clamp or None, reward_mode=kl.reward_mode)


def policy_term(loss: LossConfig) -> PolicyTerm:
    """The surrogate and its clip; the config's 0 ("off") for delta and dual_clip becomes None."""
    return PolicyTerm(name=loss.policy_loss, eps_low=loss.eps_low, eps_high=loss.eps_high,
                      delta=loss.delta or None, dual_clip=loss.dual_clip or None,
                      off_policy_mask=loss.off_policy_mask_threshold or None,
                      sapo_temperature_pos=loss.sapo_temperature_pos, sapo_temperature_neg=loss.sapo_temperature_neg,
                      vespo_k_pos=loss.vespo_k_pos, vespo_lambda_pos=loss.vespo_lambda_pos,
                      vespo_k_neg=loss.vespo_k_neg, vespo_lambda_neg=loss.vespo_lambda_neg)


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
