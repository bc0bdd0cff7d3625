"""The KL penalty as the library builds it, and the classification of its expected gradient.

One function, :func:`penalty_objective`, assembles the penalty from the library's own pieces
(``kl_loss_term``/``importance_weight`` for the loss placement, ``kl_estimate`` -> ``apply_kl_penalty`` ->
``clipped_surrogate`` for the reward placement, ``aggregate`` for the reduction). The categorical check
(one token, T = 1), the sequence toy, the Monte Carlo check and the optimum search all call it, so they
cannot disagree about what "k3 in the loss with w detached" means.

Exact expected gradient (docs/kl_math.md, "Exact tests"): with ``weights_B = q(y).detach()`` over every outcome y
(q = pi on-policy, q = mu = pi_old off-policy), autograd of ``sum_y q(y) L(y)`` is E_q[grad L(y)] exactly.

Samplings (what ``old_logp`` the library receives):

    sampling              loss placement: KL term            reward placement: PPO ratio
    on_policy             no weight (old_logp=None)          pi / sg(pi) (= 1, gradient = score)
    off_policy_in_graph   w = pi/mu in the graph             pi / mu
    off_policy_detached   sg(w) = sg(pi/mu)                  pi / mu  (the PPO ratio is always in the graph)
    off_policy_none       no weight                          pi / sg(pi): stale samples used as if on-policy

The reward-placed value is the estimator evaluated at the current policy (``kl_estimate(logp, ref_logp)``,
detached by ``apply_kl_penalty``). A trainer that freezes it at the rollout policy mu for later PPO epochs
gets E_pi[k(l_mu) s] instead; for k1 that is the exact gradient minus grad KL(pi||mu), which vanishes at
pi = mu (the first epoch, where both coincide) and grows with the distance between pi and mu.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Callable

import torch
from torch import Tensor

from klgrpo.math.advantages import apply_kl_penalty
from klgrpo.math.aggregation import Normalizer, aggregate
from klgrpo.math.kl import DEFAULT_LOG_RATIO_CLAMP, ESTIMATORS, PLACEMENTS, SAMPLINGS, kl_estimate
from klgrpo.math.policy_loss import clipped_surrogate, kl_loss_term

#: eps_low = eps_high for the reward-placement surrogate: the clip never binds, so the PPO loss is the plain
#: ratio-weighted policy gradient whose expectation the oracle computes.
WIDE_CLIP = 1e9

#: Relative tolerance of the gradient classification, as a fraction of ||grad KL(pi||ref)||. The oracle is
#: float64 end to end; the errors seen are ~1e-15, the distances between different targets are O(1).
GRADIENT_RTOL = 1e-9

_IS_CORRECTION = {
    "off_policy_in_graph": "in_graph",
    "off_policy_detached": "detached",
    "off_policy_none": "none",
}


def penalty_objective(
    logp_BT: Tensor,
    ref_logp_BT: Tensor,
    mask_BT: Tensor,
    weights_B: Tensor,
    estimator: str,
    placement: str,
    sampling: str = "on_policy",
    mu_logp_BT: Tensor | None = None,
    aggregation: str = "seq_mean_token_sum",
    clamp: float | None = DEFAULT_LOG_RATIO_CLAMP,
) -> Tensor:
    """sum_b weights_b * (penalty surrogate of sequence b), built with the library's functions.

    ``logp_BT`` carries the gradient; ``weights_B`` (detached here) are the sampling probabilities of the
    rows for the exact expectation, or 1/N for N drawn samples. The aggregation counts are those of one
    expected sequence: G = 1, sum_i n_i = E_q[n] (so ``token_mean`` is the large-batch limit), L_max = T.
    """
    if placement not in ("loss", "reward", "both"):
        raise KeyError(f"unknown placement {placement!r}; choose one of: loss, reward, both")
    if sampling != "on_policy" and sampling not in _IS_CORRECTION:
        raise KeyError(f"unknown sampling {sampling!r}; choose one of: on_policy, {', '.join(_IS_CORRECTION)}")
    if sampling != "on_policy" and mu_logp_BT is None:
        raise ValueError(f"sampling {sampling!r} needs mu_logp_BT (the rollout policy's log-probs)")
    weights_B = weights_B.detach()
    w_B1 = weights_B.unsqueeze(-1)
    norm = Normalizer(
        num_sequences=1.0,
        num_tokens=(weights_B * mask_BT.to(weights_B.dtype).sum(-1)).sum(),
        max_len=float(mask_BT.shape[-1]),
    )
    total = torch.zeros((), dtype=logp_BT.dtype)
    if placement in ("loss", "both"):
        if sampling == "on_policy":
            term_BT, _ = kl_loss_term(logp_BT, ref_logp_BT, estimator, clamp=clamp)
        else:
            term_BT, _ = kl_loss_term(logp_BT, ref_logp_BT, estimator, old_logp_BT=mu_logp_BT,
                                      is_correction=_IS_CORRECTION[sampling], clamp=clamp)
        total = total + aggregate(term_BT * w_B1, mask_BT, aggregation, norm)
    if placement in ("reward", "both"):
        kl_BT = kl_estimate(logp_BT, ref_logp_BT, estimator, clamp=clamp)
        # Task advantages 0: only the penalty. A_it = -coef * sum_{t' >= t} k_it' (k detached inside).
        advantages_BT = apply_kl_penalty(torch.zeros_like(weights_B), kl_BT, mask_BT, coef=1.0)
        old_BT = mu_logp_BT if sampling in ("off_policy_in_graph", "off_policy_detached") else logp_BT.detach()
        surrogate_BT = clipped_surrogate(logp_BT, old_BT, advantages_BT, eps_low=WIDE_CLIP,
                                         eps_high=WIDE_CLIP).loss_BT
        total = total + aggregate(surrogate_BT * w_B1, mask_BT, aggregation, norm)
    return total


@dataclass
class GradientCheck:
    """One expected gradient classified against grad KL(pi||ref) and grad KL(ref||pi)."""

    estimator: str
    placement: str
    sampling: str
    level: str
    gradient_target: str
    declared: str
    passed: bool
    cosine_reverse: float
    cosine_forward: float
    rel_err_reverse: float   # ||g - grad_rev|| / ||grad_rev||
    rel_err_forward: float   # ||g - grad_fwd|| / ||grad_rev||
    norm_ratio: float        # ||g|| / ||grad_rev||
    rtol: float

    def as_dict(self) -> dict:
        return asdict(self)


def _cosine(a: Tensor, b: Tensor) -> float:
    na, nb = a.norm().item(), b.norm().item()
    if na == 0.0 or nb == 0.0:
        return 0.0
    return float(torch.dot(a, b).item() / (na * nb))


def classify_gradient(g: Tensor, grad_reverse: Tensor, grad_forward: Tensor, rtol: float = GRADIENT_RTOL) -> dict:
    """"reverse" / "forward" / "zero" if g is that within ``rtol * ||grad_reverse||``, else "neither"."""
    g, rev, fwd = g.reshape(-1), grad_reverse.reshape(-1), grad_forward.reshape(-1)
    scale = rev.norm().item()
    if not scale > 0:
        raise ValueError("grad KL(pi||ref) is zero: pick a policy different from the reference")
    err_rev = (g - rev).norm().item() / scale
    err_fwd = (g - fwd).norm().item() / scale
    size = g.norm().item() / scale
    if err_rev <= rtol:
        target = "reverse"
    elif err_fwd <= rtol:
        target = "forward"
    elif size <= rtol:
        target = "zero"
    else:
        target = "neither"
    # The cosine of a gradient that is zero up to rounding is the cosine of rounding noise: report 0.
    return {
        "gradient_target": target,
        "cosine_reverse": 0.0 if target == "zero" else _cosine(g, rev),
        "cosine_forward": 0.0 if target == "zero" else _cosine(g, fwd),
        "rel_err_reverse": err_rev,
        "rel_err_forward": err_fwd,
        "norm_ratio": size,
        "rtol": rtol,
    }


def flat_grad(objective: Tensor, params: Tensor, retain_graph: bool = False) -> Tensor:
    (g,) = torch.autograd.grad(objective, params, retain_graph=retain_graph)
    return g.reshape(-1)


def bonferroni_z(alpha: float, num_tests: int) -> float:
    """Two-sided normal quantile z with P(|Z| > z) = alpha / num_tests (bisection on erfc; no scipy)."""
    target = alpha / num_tests
    lo, hi = 0.0, 40.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if math.erfc(mid / math.sqrt(2.0)) > target:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def declared_gradient_rows(level: str, expected_gradient: Callable[[str, str, str], Tensor], kl: dict,
                           rtol: float = GRADIENT_RTOL) -> list[GradientCheck]:
    """Every registered estimator x placement x sampling at ``level``, classified against its declaration.

    ``expected_gradient(estimator, placement, sampling)`` is the problem's exact expected penalty gradient;
    ``kl`` holds the exact "grad_reverse" and "grad_forward" of the same problem."""
    rows = []
    for name in ESTIMATORS:
        est = ESTIMATORS[name]
        for placement in PLACEMENTS:
            for sampling in SAMPLINGS:
                found = classify_gradient(expected_gradient(name, placement, sampling), kl["grad_reverse"],
                                          kl["grad_forward"], rtol)
                declared = est.gradient_target(placement, sampling, level)
                rows.append(GradientCheck(estimator=name, placement=placement, sampling=sampling, level=level,
                                          declared=declared, passed=found["gradient_target"] == declared, **found))
    return rows
