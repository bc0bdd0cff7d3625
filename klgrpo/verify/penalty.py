"""The KL penalty as the TRAINER builds it, and the classification of its expected gradient.

:func:`penalty_objective` calls the trainer's own loss, :func:`klgrpo.math.objective.grpo_objective`, with
task advantages 0 and beta 1, so the only thing left in the loss is the KL penalty (in the loss, in the reward,
or both), built by the objective's single KL implementation (``kl_penalty_terms`` for the loss term,
``reward_kl`` for the reward value). The categorical check (one token, T = 1), the sequence toy, the Monte
Carlo check and the optimum search all go through it: a bug planted in the objective's KL term fails them.

Exact expected gradient (docs/kl_math.md, "Exact tests"): with ``weights_B = q(y).detach()`` over every outcome y
(q = pi on-policy, q = mu = pi_old off-policy), passed as the objective's ``ObjectiveInputs.row_weights_B``, autograd of
``sum_y q(y) L(y)`` is E_q[grad L(y)] exactly.

Samplings: what grpo_objective receives as ``old_logp_BT`` (the rollout policy) and ``kl.is_correction``:

    sampling              old_logp     is_correction   loss placement          reward placement
    on_policy             sg(logp)     none            k(l), no weight         PPO ratio pi/sg(pi)
    off_policy_in_graph   mu           in_graph        w k(l), w = pi/mu       PPO ratio pi/mu
    off_policy_detached   mu           detached        sg(w) k(l)              PPO ratio pi/mu
    off_policy_none       mu           none            k(l), no weight         PPO ratio pi/mu

The reward-placed value is k at the ROLLOUT policy's log-probs, k(l_mu) (objective.reward_kl), exactly as in
training: every PPO epoch sees the KL of the sampled sequence as a fixed reward. Its expected gradient is
E_pi[k(l_mu) s]: the on-policy one at pi = mu (the first epoch), neither KL's off-policy (for k1, the exact
gradient minus grad KL(pi||mu)).

``reward_mode`` "sequence_score" puts beta * sum_t k(l_mu)_t into the sequence's score instead
(advantages.kl_penalized_scores, as the trainer does before group_advantages); the oracle skips the group
normalisation (a large group's mean is a baseline with zero expected gradient; its std would rescale beta).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from klgrpo.math.advantages import kl_penalized_scores
from klgrpo.math.aggregation import Normalizer
from klgrpo.math.kl import DEFAULT_LOG_RATIO_CLAMP, ESTIMATORS, PLACEMENTS, SAMPLINGS
from klgrpo.math.objective import KLTerm, ObjectiveInputs, ObjectiveTerms, PolicyTerm, grpo_objective, reward_kl
from klgrpo.math.sampler_correction import SamplerCorrection

#: eps_low = eps_high for the surrogate: the clip never binds, so the PPO loss is the plain ratio-weighted
#: policy gradient whose expectation the oracle computes.
WIDE_CLIP = 1e9

#: Relative tolerance of the gradient classification, as a fraction of ||grad KL(pi||ref)||. The oracle is
#: float64 end to end; the errors seen are ~1e-15, the distances between different targets are O(1).
GRADIENT_RTOL = 1e-9

_IS_CORRECTION = {
    "on_policy": "none",
    "off_policy_in_graph": "in_graph",
    "off_policy_detached": "detached",
    "off_policy_none": "none",
}


def penalty_objective(logp_BT: Tensor, ref_logp_BT: Tensor, mask_BT: Tensor, weights_B: Tensor, estimator: str,
                      placement: str, sampling: str = "on_policy", mu_logp_BT: Tensor | None = None,
                      aggregation: str = "seq_mean_token_sum", clamp: float | None = DEFAULT_LOG_RATIO_CLAMP, *,
                      reward_mode: str = "reward_to_go", delta: float | None = None,
                      dual_clip: float | None = None, eps: float = WIDE_CLIP, full_kl_BT: Tensor | None = None,
                      shaping: str = "none", clip_threshold: float = 1.0, shaping_target: float = 0.1,
                      sampler_logp_BT: Tensor | None = None,
                      sampler_correction: SamplerCorrection = SamplerCorrection()) -> Tensor:
    """sum_b weights_b * (penalty surrogate of sequence b), computed by the trainer's ``grpo_objective``.

    ``logp_BT`` carries the gradient; ``weights_B`` (detached) are the sampling probabilities of the rows for
    the exact expectation, or 1/N for N drawn samples. The aggregation counts are those of one expected
    sequence: G = 1, sum_i n_i = E_q[n] (so ``token_mean`` is the large-batch limit), L_max = T.
    ``full_kl_BT``: the exact per-position KL (math.full_kl) that estimator "full" puts in the loss.
    ``shaping``, ``clip_threshold``, ``shaping_target``: the KL term's shaping (math/kl_shaping.py), as KLTerm.
    ``sampler_logp_BT``, ``sampler_correction``: a sampler that is not the rollout policy, and its correction
    (math/sampler_correction.py; ``weights_B`` are then the sampler's probabilities).
    """
    if placement not in PLACEMENTS:
        raise KeyError(f"unknown placement {placement!r}; choose one of: {', '.join(PLACEMENTS)}")
    if sampling not in _IS_CORRECTION:
        raise KeyError(f"unknown sampling {sampling!r}; choose one of: {', '.join(_IS_CORRECTION)}")
    if sampling != "on_policy" and mu_logp_BT is None:
        raise ValueError(f"sampling {sampling!r} needs mu_logp_BT (the rollout policy's log-probs)")
    weights_B = weights_B.detach()
    norm = Normalizer(num_sequences=1.0, num_tokens=(weights_B * mask_BT.to(weights_B.dtype).sum(-1)).sum(),
                      max_len=float(mask_BT.shape[-1]))
    old_logp_BT = logp_BT.detach() if sampling == "on_policy" else mu_logp_BT
    kl = KLTerm(coef=1.0, estimator=estimator, placement=placement, is_correction=_IS_CORRECTION[sampling],
                clamp=clamp, reward_mode=reward_mode, shaping=shaping, clip_threshold=clip_threshold,
                shaping_target=shaping_target)
    advantages_B = torch.zeros_like(weights_B)  # task advantages 0: only the penalty is left
    if kl.in_reward and reward_mode == "sequence_score":
        advantages_B = kl_penalized_scores(advantages_B, reward_kl(old_logp_BT, ref_logp_BT, kl), mask_BT, kl.coef)
    inputs = ObjectiveInputs(logp_BT, old_logp_BT, ref_logp_BT, advantages_B, mask_BT, full_kl_BT=full_kl_BT,
                             sampler_logp_BT=sampler_logp_BT, row_weights_B=weights_B)
    terms = ObjectiveTerms(kl=kl, aggregation=aggregation, sampler_correction=sampler_correction,
                           policy=PolicyTerm(eps_low=eps, eps_high=eps, delta=delta, dual_clip=dual_clip))
    out = grpo_objective(inputs, terms, norm, metrics=False)
    return out.loss


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


def gradient_check(g: Tensor, kl: dict, declared: str | None, rtol: float = GRADIENT_RTOL,
                   check: type[GradientCheck] = GradientCheck, **where) -> GradientCheck:
    """``g`` classified against the exact "grad_reverse" and "grad_forward" in ``kl`` and compared with
    ``declared``; None: no declaration, shown as "n/a" for information (passes). ``where`` names the row
    (estimator, placement, sampling, level, and the fields ``check`` adds)."""
    found = classify_gradient(g, kl["grad_reverse"], kl["grad_forward"], rtol)
    passed = declared is None or found["gradient_target"] == declared
    return check(**where, declared=declared or "n/a", passed=passed, **found)


def declared_gradient_rows(level: str, expected_gradient: Callable[[str, str, str], Tensor], kl: dict,
                           rtol: float = GRADIENT_RTOL) -> list[GradientCheck]:
    """Every registered estimator x placement x sampling at ``level``, classified against its declaration.

    ``expected_gradient(estimator, placement, sampling)`` is the problem's exact expected penalty gradient;
    ``kl`` holds the exact "grad_reverse" and "grad_forward" of the same problem."""
    return [gradient_check(expected_gradient(name, placement, sampling), kl,
                           ESTIMATORS[name].gradient_target(placement, sampling, level), rtol,
                           estimator=name, placement=placement, sampling=sampling, level=level)
            for name in ESTIMATORS for placement in PLACEMENTS for sampling in SAMPLINGS]
