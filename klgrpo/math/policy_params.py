"""The settings of the built-in policy losses that have their own (SAPO's temperatures, VESPO's Gamma weight),
each a frozen dataclass that ``POLICY_LOSSES.register(name, params=...)`` declares with its loss
(klgrpo/math/policy_loss.py). No torch here: the config declares its ``loss.sapo_*`` and ``loss.vespo_*`` fields
from these without loading the math."""

from __future__ import annotations

from dataclasses import dataclass

from klgrpo.math.registry import param

#: The largest vespo power or decay a config may set (VespoParams).
VESPO_MAX = 100.0


@dataclass(frozen=True)
class SapoParams:
    """SAPO's soft gate: tau = temperature_pos where A > 0, else temperature_neg."""

    temperature_pos: float = param(1.0, "policy_loss sapo: the gate's temperature where A > 0", low=0, above=True)
    temperature_neg: float = param(1.05, "policy_loss sapo: the gate's temperature where A <= 0", low=0, above=True)


@dataclass(frozen=True)
class VespoParams:
    """VESPO's Gamma weight phi(w) = exp(lambda + k log w - lambda w), (k, lambda) by the advantage's sign."""

    # A Gamma shape's power and decay are >= 0 (VESPO uses single digits); the upper bound keeps the weight a
    # finite float32 number for sequence ratios within 2.4x of 1 (100 * log 2.4 = 87.5 < log of float32's max,
    # 88.7), and 1e300 from overflowing the float32 tensor it is cast to.
    k_pos: float = param(2.0, "policy_loss vespo: the Gamma weight's power k where A >= 0", low=0, high=VESPO_MAX)
    lambda_pos: float = param(3.0, "policy_loss vespo: the Gamma weight's decay lambda where A >= 0", low=0,
                              high=VESPO_MAX)
    k_neg: float = param(3.0, "policy_loss vespo: the Gamma weight's power k where A < 0", low=0, high=VESPO_MAX)
    lambda_neg: float = param(2.0, "policy_loss vespo: the Gamma weight's decay lambda where A < 0", low=0,
                              high=VESPO_MAX)
