"""The KL settings of a run's config (``kl.*``) as the math room's typed values: the controller's constructor
arguments and the KL term. klgrpo's trainer and the TRL bridge (klgrpo.trl) both build their controller here,
so a controller parameter is added in one place."""

from __future__ import annotations

from typing import Any

from klgrpo.math.kl_control import KLController, build_controller
from klgrpo.math.objective import KLTerm
from klgrpo.train.config import KLConfig


def controller_params(kl: KLConfig) -> dict[str, Any]:
    """The constructor arguments of ``kl.controller`` read from the ``kl.*`` fields (the controllers apply their
    own floors, e.g. the dual controller's DUAL_BETA_FLOOR)."""
    by_name = {
        "fixed": {},
        "adaptive": {"target": kl.target, "horizon": kl.horizon},
        "step": {"target": kl.target},
        "dual": {"target": kl.target, "lr": kl.dual_lr, "beta_min": kl.beta_min, "beta_max": kl.beta_max},
        "dynamic": {"reward_threshold": kl.reward_threshold, "decay": kl.decay, "beta_min": kl.beta_min,
                    "schedule_steps": kl.schedule_steps},
    }
    return {**by_name[kl.controller], "kl_measure": kl.kl_measure}


def build_kl_controller(kl: KLConfig) -> KLController:
    """The controller ``kl.controller`` starting at beta = ``kl.coef``."""
    return build_controller(kl.controller, kl.coef, **controller_params(kl))


def kl_term(kl: KLConfig, coef: float) -> KLTerm:
    """How the KL enters the objective at this step's beta ``coef``."""
    return KLTerm(coef=coef, estimator=kl.estimator, placement=kl.placement, is_correction=kl.is_correction,
                  shaping=kl.shaping, clip_threshold=kl.clip_threshold, shaping_target=kl.shaping_target,
                  clamp=kl.log_ratio_clamp or None, reward_mode=kl.reward_mode)
