"""Controllers for the KL coefficient beta: tiny state machines with ``state_dict`` for checkpoints.

Every controller exposes ``value`` (the beta to use now), ``observe(KLObservation)`` called once after each
optimizer step (``update(observed_kl, n_steps, reward=None)`` is the same with the numbers spelled out),
``state_dict()`` / ``load_state_dict()``, and ``kl_measure``: the KL quantity it consumes, either
"token_mean" (mean per-token KL over the batch's completion tokens, what verl/OpenRLHF feed back) or
"sequence_sum" (mean over sequences of the summed per-token k1, what Ziegler et al. 2019 fed back). The
trainer hands over both in a ``KLObservation``; the controller picks the one it declared.

    fixed     beta constant
    adaptive  Ziegler et al. 2019: e = clip(KL / target - 1, -0.2, 0.2); beta <- beta (1 + e n_steps / horizon)
    step      KL > 1.5 target -> beta * 1.5; KL < 0.5 target -> beta * 0.75 (factors and bands configurable)
    dual      dual ascent on a KL budget eps: log beta <- log beta + lr (KL - eps) / eps
    dynamic   beta <- beta * decay while mean reward > threshold; beta = beta_min after schedule_steps updates

The entropy bonus's coefficient has controllers of the same shape (``ENTROPY_CONTROLLERS``: fixed, adaptive),
observed with the step's mean per-token entropy.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any

from klgrpo.math.registry import Registry

KL_MEASURES = ("token_mean", "sequence_sum")


@dataclass(frozen=True)
class KLObservation:
    """What one optimizer step tells a controller.

    token_mean    mean per-token KL value of the configured estimator over the loss-mask tokens, before
                  shaping (the ``adaptive_kl/raw_kl`` metric; 0 when no reference exists)
    sequence_sum  mean over the completions of sum_t l_t, the summed k1 (the ``kl/sequence_sum`` metric)
    n_sequences   completions in the update (Ziegler's n_steps)
    reward        mean reward of the batch (the ``train/reward`` metric), or None
    entropy       mean per-token entropy over the tokens the policy term acts on, for the entropy controller
                  (None when the loss does not read the entropy)
    """

    token_mean: float
    sequence_sum: float
    n_sequences: int
    reward: float | None = None
    entropy: float | None = None

    def kl(self, measure: str) -> float:
        """The observed KL in ``measure`` units (one of KL_MEASURES)."""
        if measure not in KL_MEASURES:
            raise ValueError(f"kl_measure must be one of {KL_MEASURES}, got {measure!r}")
        return self.token_mean if measure == "token_mean" else self.sequence_sum


#: ``kl.controller`` name -> controller class, constructed as ``cls(init_coef, **params)``.
CONTROLLERS: Registry[type["KLController"]] = Registry("KL controller")


class KLController:
    """Base: holds beta and the number of updates; subclasses implement ``_next``."""

    def __init__(self, init_coef: float, kl_measure: str = "token_mean"):
        if kl_measure not in KL_MEASURES:
            raise ValueError(f"kl_measure must be one of {KL_MEASURES}, got {kl_measure!r}")
        self.value = float(init_coef)
        self.kl_measure = kl_measure
        self.num_updates = 0

    def update(self, observed_kl: float, n_steps: int = 1, reward: float | None = None) -> float:
        """Feed back the observed KL (in ``kl_measure`` units) after an update of ``n_steps`` samples."""
        self.value = float(self._next(float(observed_kl), int(n_steps), reward))
        self.num_updates += 1
        return self.value

    def observe(self, observation: KLObservation) -> float:
        """Feed back one step's observation; the controller reads the KL in its own ``kl_measure``."""
        return self.update(observation.kl(self.kl_measure), observation.n_sequences, observation.reward)

    def _next(self, observed_kl: float, n_steps: int, reward: float | None) -> float:
        return self.value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value, "num_updates": self.num_updates, "kl_measure": self.kl_measure}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])
        self.num_updates = int(state["num_updates"])
        self.kl_measure = state.get("kl_measure", self.kl_measure)


@CONTROLLERS.register("fixed")
class FixedKLController(KLController):
    """beta never changes."""


@CONTROLLERS.register("adaptive")
class AdaptiveKLController(KLController):
    """Ziegler et al. (2019), proportional and multiplicative.

    e = clip(KL / target - 1, -0.2, 0.2);  beta <- beta * (1 + e * n_steps / horizon),
    with n_steps the number of samples in the update and horizon ~ 10000 in the paper.
    """

    def __init__(self, init_coef: float, target: float, horizon: float, kl_measure: str = "token_mean",
                 error_clip: float = 0.2):
        super().__init__(init_coef, kl_measure)
        if target <= 0 or horizon <= 0:
            raise ValueError("AdaptiveKLController needs target > 0 and horizon > 0")
        self.target = float(target)
        self.horizon = float(horizon)
        self.error_clip = float(error_clip)

    def _next(self, observed_kl, n_steps, reward):
        error = min(max(observed_kl / self.target - 1.0, -self.error_clip), self.error_clip)
        return self.value * (1.0 + error * n_steps / self.horizon)


#: kl.horizon auto: beta can move by AUTO_HORIZON_FACTOR within AUTO_HORIZON_FRACTION of the run's steps ...
AUTO_HORIZON_FACTOR, AUTO_HORIZON_FRACTION = 10.0, 0.25
#: ... and by at most x(1 +- AUTO_HORIZON_MAX_STEP) in one update (horizon >= 0.2 n / AUTO_HORIZON_MAX_STEP).
AUTO_HORIZON_MAX_STEP = 0.5


def auto_horizon(steps: int, batch: int, error_clip: float = 0.2) -> float:
    """The adaptive controller's horizon for a run of ``steps`` updates of ``batch`` sequences (kl.horizon auto).

    With the error saturated at +-error_clip, one update multiplies beta by 1 +- error_clip n / H, so k updates
    move it by (1 + error_clip n / H)^k. Asking for a factor F = 10 (the tutorial's range of beta, 0.01..0.1, is one
    order of magnitude) within k = steps / 4 updates (the controller settles in the first quarter, the other three
    run near the target) gives

        (1 + 0.2 n / H)^(steps/4) = 10   =>   H = 0.2 n / (10^(4 / steps) - 1).

    Short runs would ask for more than any one update should do (steps = 20: x1.58 per update), so H is held at
    H >= 0.2 n / 0.5 (at most x1.5 up, x0.5 down per update; the factor stays positive, which needs H > 0.2 n).
    Examples (n = 32): 20 steps -> 12.8 (the floor), 100 steps -> 66.3, 1000 steps -> 691.7.
    """
    if steps <= 0 or batch <= 0:
        raise ValueError("auto_horizon needs steps > 0 and batch > 0")
    per_update = AUTO_HORIZON_FACTOR ** (1.0 / (AUTO_HORIZON_FRACTION * steps)) - 1.0
    return error_clip * batch / min(per_update, AUTO_HORIZON_MAX_STEP)


def horizon_to_reach(beta_start: float, beta_end: float, updates: int, final_kl: float, target: float,
                     batch: int, error_clip: float = 0.2) -> float | None:
    """The horizon with which the adaptive controller would have brought the KL to ``target`` in the same number
    of updates, on a first-order model (a line for the summary, not a change).

    Model: the KL scales as 1 / beta, so reaching the target needs beta_end x final_kl / target; the run moved
    beta by G = beta_end / beta_start, so beta had to move by G' = G x final_kl / target. With the error saturated
    (|e| = error_clip at every update, the fastest the controller goes) beta moves by (1 + error_clip n / H)^updates
    (down: 1 - ...), so H = error_clip n / |G'^(1 / updates) - 1|. None when nothing could be said (no update,
    beta 0, or no move needed)."""
    if updates <= 0 or beta_start <= 0 or beta_end <= 0 or final_kl <= 0 or target <= 0:
        return None
    needed = beta_end / beta_start * final_kl / target
    rate = abs(needed ** (1.0 / updates) - 1.0)
    return error_clip * batch / rate if rate > 0 else None


@CONTROLLERS.register("step")
class StepKLController(KLController):
    """A band rule: KL > high * target -> beta * up; KL < low * target -> beta * down."""

    def __init__(self, init_coef: float, target: float, up: float = 1.5, down: float = 0.75,
                 high: float = 1.5, low: float = 0.5, kl_measure: str = "token_mean"):
        super().__init__(init_coef, kl_measure)
        if target <= 0:
            raise ValueError("StepKLController needs target > 0")
        self.target, self.up, self.down, self.high, self.low = map(float, (target, up, down, high, low))

    def _next(self, observed_kl, n_steps, reward):
        if observed_kl > self.high * self.target:
            return self.value * self.up
        if observed_kl < self.low * self.target:
            return self.value * self.down
        return self.value


#: The smallest beta the dual controller keeps: it steps on log beta, so beta must stay > 0, and a configured
#: beta_min of 0 (kl.beta_min's default, meant for the dynamic controller) is raised to this.
DUAL_BETA_FLOOR = 1e-12


@CONTROLLERS.register("dual")
class DualAscentKLController(KLController):
    """Dual ascent on a KL budget eps: log beta <- log beta + lr * (KL - eps) / eps, beta in [beta_min, beta_max].

    At the regularised optimum pi*_beta = ref exp(R / beta) / Z the KL decreases in beta, so the budget has
    one beta* and the ascent settles there. beta_min below DUAL_BETA_FLOOR is raised to it.
    """

    def __init__(self, init_coef: float, target: float, lr: float = 0.1, beta_min: float = 1e-6,
                 beta_max: float = 1e3, kl_measure: str = "token_mean"):
        super().__init__(init_coef, kl_measure)
        if init_coef <= 0 or target <= 0:
            raise ValueError("DualAscentKLController needs init_coef > 0 and target > 0")
        self.target, self.lr, self.beta_max = map(float, (target, lr, beta_max))
        self.beta_min = max(float(beta_min), DUAL_BETA_FLOOR)
        self.value = min(max(self.value, self.beta_min), self.beta_max)  # start inside the bounds it keeps

    def _next(self, observed_kl, n_steps, reward):
        log_beta = math.log(self.value) + self.lr * (observed_kl - self.target) / self.target
        return min(max(math.exp(log_beta), self.beta_min), self.beta_max)


@CONTROLLERS.register("dynamic")
class DynamicScheduleKLController(KLController):
    """A reward-driven schedule: decay beta while the mean reward beats a threshold, then a floor.

    After each update: if reward > reward_threshold, beta <- max(beta * decay, beta_min); once
    ``schedule_steps`` updates have happened (when > 0), beta = beta_min.
    """

    def __init__(self, init_coef: float, reward_threshold: float, decay: float = 0.9, beta_min: float = 0.0,
                 schedule_steps: int = 0, kl_measure: str = "token_mean"):
        super().__init__(init_coef, kl_measure)
        self.reward_threshold, self.decay, self.beta_min = map(float, (reward_threshold, decay, beta_min))
        self.schedule_steps = int(schedule_steps)

    def _next(self, observed_kl, n_steps, reward):
        if self.schedule_steps > 0 and self.num_updates + 1 >= self.schedule_steps:
            return self.beta_min
        if reward is not None and reward > self.reward_threshold:
            return max(self.value * self.decay, self.beta_min)
        return self.value


def build_controller(name: str, init_coef: float, **params: Any) -> KLController:
    """Construct the controller registered as ``name`` with its own parameters."""
    return CONTROLLERS[name](init_coef, **params)


def init_keywords(cls: type) -> dict[str, inspect.Parameter]:
    """A controller class's constructor keywords after ``init_coef``, in order: its settings, read from its
    signature wherever they are needed (the config hands them over by name), never copied into a table."""
    return dict(list(inspect.signature(cls.__init__).parameters.items())[2:])  # after self and init_coef


#: ``loss.entropy_controller`` name -> entropy-bonus controller class, constructed as ``cls(init_coef, **params)``
#: with its keywords named as the ``loss.*`` fields that set them.
ENTROPY_CONTROLLERS: Registry[type["EntropyController"]] = Registry("entropy controller")


class EntropyController:
    """The entropy bonus's coefficient, on the KL controllers' pattern: ``value`` (the coefficient it holds),
    ``applied`` (what multiplies the bonus at this step), ``observe(entropy)`` once after each optimizer step
    with the step's mean per-token entropy over the tokens the policy term acts on, ``state_dict()`` /
    ``load_state_dict()`` for checkpoints."""

    def __init__(self, init_coef: float):
        self.value = float(init_coef)
        self.num_updates = 0
        self.last_entropy = math.inf  # before any step: above every target

    @property
    def applied(self) -> float:
        return self.value

    def observe(self, entropy: float) -> float:
        self.value = float(self._next(float(entropy)))
        self.last_entropy = float(entropy)
        self.num_updates += 1
        return self.value

    def _next(self, entropy: float) -> float:
        return self.value

    def state_dict(self) -> dict[str, Any]:
        # JSON has no infinity: None stands for "no step observed yet"
        last = self.last_entropy if math.isfinite(self.last_entropy) else None
        return {"value": self.value, "num_updates": self.num_updates, "last_entropy": last}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])
        self.num_updates = int(state["num_updates"])
        last = state.get("last_entropy")
        self.last_entropy = math.inf if last is None else float(last)


@ENTROPY_CONTROLLERS.register("fixed")
class FixedEntropyController(EntropyController):
    """The coefficient never changes (TRL's entropy_coef without use_adaptive_entropy)."""


@ENTROPY_CONTROLLERS.register("adaptive")
class AdaptiveEntropyController(EntropyController):
    """Skywork-OR1's rule, as TRL 1.16 runs it (use_adaptive_entropy): after each step with mean entropy H,
    c <- min(c + delta, c_max) when H <= target, else max(c - delta, c_min); the bonus applies c only while
    the last observed H is at or below the target (0 before the first step)."""

    def __init__(self, init_coef: float, entropy_target: float, entropy_coef_delta: float,
                 entropy_coef_min: float, entropy_coef_max: float):
        super().__init__(init_coef)
        if entropy_coef_delta < 0 or entropy_coef_min > entropy_coef_max:
            raise ValueError("AdaptiveEntropyController needs entropy_coef_delta >= 0 and "
                             "entropy_coef_min <= entropy_coef_max")
        self.target, self.delta = float(entropy_target), float(entropy_coef_delta)
        self.coef_min, self.coef_max = float(entropy_coef_min), float(entropy_coef_max)

    @property
    def applied(self) -> float:
        return self.value if self.last_entropy <= self.target else 0.0

    def _next(self, entropy: float) -> float:
        if entropy <= self.target:
            return min(self.value + self.delta, self.coef_max)
        return max(self.value - self.delta, self.coef_min)
