"""Which KL a configuration's KL penalty optimises, computed by the exact oracles (``klgrpo explain``).

A configuration's penalty is one or more :class:`KLTerm` (klgrpo has one; verl can put one KL in the loss and
another in the reward). For each level and sampling, every part's exact expected gradient comes from the same
oracles as ``klgrpo verify-kl`` (categorical: one token; sequence_toy: whole sequences under the configured
aggregation), through the trainer's own ``grpo_objective`` (penalty.penalty_objective), and the weighted sum
sum_i coef_i g_i is classified:

    reverse / forward   g = c * grad KL(pi||ref) / grad KL(ref||pi) for some c > 0 (to GRADIENT_RTOL);
                        ``scale`` is c / sum_i coef_i (1 for a plain per-token sum; the aggregation's
                        normaliser, e.g. 1 / E[n] for token_mean, only rescales beta)
    zero                g = 0 (no coefficient, or an estimator whose expected gradient vanishes)
    neither             anything else (a length weighting, a shaping, a stale rollout policy)

Samplings: ``first_epoch`` is the first update on a fresh batch (pi_old = pi in value; the importance weight
still acts through the graph), ``off_policy`` a later update (pi_old = mu != pi, the oracles' rollout policy).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from klgrpo.math.full_kl import FULL_KL
from klgrpo.math.objective import KLTerm
from klgrpo.verify import categorical, full_kl, sequence_toy
from klgrpo.verify.first_epoch import mu_at_pi
from klgrpo.verify.penalty import GRADIENT_RTOL, classify_gradient, flat_grad

SAMPLINGS = ("first_epoch", "off_policy")
LEVELS = ("token", "sequence")


@dataclass
class GradientVerdict:
    level: str
    sampling: str
    target: str            # reverse | forward | zero | neither
    scale: float           # g = scale * sum(coef) * grad KL for reverse / forward; 0 otherwise
    cosine_reverse: float
    cosine_forward: float


def _problems(sampling: str):
    cat, toy = categorical.make_categorical(), sequence_toy.make_toy()
    return mu_at_pi(cat, toy) if sampling == "first_epoch" else (cat, toy)


def _part_gradient(part: KLTerm, level: str, problem, aggregation: str) -> Tensor:
    if part.estimator == FULL_KL:  # the exact per-prefix KL (loss only; the sequence sums it per sequence)
        theta = problem.theta() if level == "token" else problem.params()
        objective = (full_kl.token_objective if level == "token" else full_kl.sequence_objective)(
            problem, theta, f"off_policy_{part.is_correction}")
        return flat_grad(objective, theta)
    options = {"reward_mode": part.reward_mode, "shaping": part.shaping, "clip_threshold": part.clip_threshold,
               "shaping_target": part.shaping_target, "clamp": part.clamp}
    sampling = f"off_policy_{part.is_correction}"  # the rollout policy mu: pi itself on the first epoch
    if level == "token":
        return categorical.expected_gradient(problem, part.estimator, part.placement, sampling, **options)
    return sequence_toy.expected_gradient(problem, part.estimator, part.placement, sampling, aggregation,
                                          **options)


def _classify_up_to_scale(g: Tensor, kl: dict, total_coef: float) -> tuple[str, float, dict]:
    """classify_gradient after dividing g by the positive multiple of a KL gradient it may be."""
    rev, fwd = kl["grad_reverse"], kl["grad_forward"]
    if g.norm() <= GRADIENT_RTOL * rev.norm() * max(total_coef, 1e-300):
        return "zero", 0.0, classify_gradient(torch.zeros_like(g), rev, fwd)
    for name, target in (("reverse", rev), ("forward", fwd)):
        c = float(torch.dot(g, target) / torch.dot(target, target))
        if c > 0:
            found = classify_gradient(g / c, rev, fwd)
            if found["gradient_target"] == name:
                return name, c / total_coef, found
    return "neither", 0.0, classify_gradient(g / total_coef, rev, fwd)


def gradient_verdict(parts: list[KLTerm], level: str, sampling: str, aggregation: str) -> GradientVerdict:
    """The exact expected gradient of sum_i coef_i * part_i at ``level`` under ``sampling``, classified."""
    if level not in LEVELS or sampling not in SAMPLINGS:
        raise KeyError(f"level must be one of {LEVELS} and sampling one of {SAMPLINGS}")
    live = [p for p in parts if p.coef > 0]
    total = sum(p.coef for p in live)
    cat, toy = _problems(sampling)
    problem = cat if level == "token" else toy
    kl = (categorical if level == "token" else sequence_toy).kl_values_and_gradients(problem)
    if not live:
        return GradientVerdict(level, sampling, "zero", 0.0, 0.0, 0.0)
    g = sum(p.coef * _part_gradient(p, level, problem, aggregation) for p in live)
    target, scale, found = _classify_up_to_scale(g, kl, total)
    return GradientVerdict(level, sampling, target, scale, found["cosine_reverse"], found["cosine_forward"])


def value_verdict(estimator: str) -> dict:
    """What the logged per-token value of ``estimator`` estimates, by enumeration (the verify-kl value rows)."""
    if estimator == FULL_KL:
        rows = full_kl.value_rows(categorical.make_categorical(), sequence_toy.make_toy())
        exact = all(row["passed"] for row in rows)
        return {"estimator": estimator, "estimates": "KL(pi||ref)", "unbiased": exact, "token": {},
                "sequence_sum": {}}
    token = categorical.value_check(categorical.make_categorical(), estimator)
    sequence = sequence_toy.value_check(sequence_toy.make_toy(), estimator)
    unbiased = token["abs_diff"] < categorical.VALUE_ATOL and sequence["abs_diff"] < sequence_toy.SEQ_VALUE_ATOL
    return {
        "estimator": estimator,
        "estimates": "KL(pi||ref)",
        "unbiased": bool(unbiased),
        "token": {"expected": token["expected_value"], "kl": token["kl"]},
        "sequence_sum": {"expected": sequence["expected_value"], "kl": sequence["kl"]},
    }
