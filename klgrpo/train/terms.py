"""The run's config as the math's typed arguments: the KL term, the policy term, the controller and its
parameters.

The trainer, the TRL bridge (klgrpo.trl) and ``klgrpo explain`` build what klgrpo/math/ takes here, so a setting
reaches the objective and the controller through one mapping.
"""

from __future__ import annotations

import inspect
from typing import Any

from klgrpo.math.kl_control import CONTROLLERS, KLController, build_controller
from klgrpo.math.objective import KLTerm, PolicyTerm
from klgrpo.train.config import KLConfig, LossConfig

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
                      delta=loss.delta or None, dual_clip=loss.dual_clip or None)


def controller_params(kl: KLConfig) -> dict[str, Any]:
    """The keyword arguments of ``kl.controller``'s constructor, read from the KLConfig fields of the same name
    (CONTROLLER_FIELDS where they differ); a keyword with a default and no field keeps its default."""
    signature = inspect.signature(CONTROLLERS[kl.controller].__init__)
    params = {}
    for name, param in list(signature.parameters.items())[2:]:  # after self and init_coef
        source = CONTROLLER_FIELDS.get(name, name)
        if hasattr(kl, source):
            params[name] = getattr(kl, source)
        elif param.default is inspect.Parameter.empty:
            raise TypeError(f"controller {kl.controller!r} takes {name!r}, which no kl.* field sets: add the field "
                            "to KLConfig (or map it in CONTROLLER_FIELDS)")
    return params


def build_kl_controller(kl: KLConfig) -> KLController:
    """The controller ``kl.controller`` starting at beta = ``kl.coef`` (it applies its own floors, e.g. the dual
    controller's DUAL_BETA_FLOOR)."""
    return build_controller(kl.controller, kl.coef, **controller_params(kl))
