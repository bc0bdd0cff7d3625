"""Stale samples: which KL the KL term's expected gradient follows when the batch was drawn by the policy K
optimizer updates back, mu = pi_(theta - K), and the trainer scores it at the current weights (pi_old = pi: the
first update of a batch, the proximal policy the current one).

The stale policies are a trajectory the problems' own policy could have come along: K exact policy-gradient steps
back on a fixed reward (one outcome's reward per token for the categorical problem, the number of a's on the
sequence toy), each step moving the logits by STEP in the largest coordinate, so mu is the policy of K updates
before the current one. Every expectation is an exact sum over the outcomes weighted by mu's probabilities, and
the trainer's own objective (``grpo_objective`` through verify/penalty.py) takes mu's log-probs as the sampler's:

    rollout.sampler_correction    the KL term's importance weight       declared
    none                          pi / pi_old (1 at the first update)   neither: the samples are mu's
    token_mask, no bounds         pi / mu per token                     token level: the setting's own target;
                                                                        sequences: neither (prefixes stay mu's)
    sequence_mask, no bounds      pi / mu per sequence                  the setting's own target

for K = 1, 2 and 4, every setting whose gradient follows the reverse KL with fresh samples. A planted trainer that
weights the KL term by pi / pi_old only (the sampler correction on the policy term alone, as TRL, verl and AReaL
weight it) must fail the corrected rows.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

from klgrpo.math import objective as objective_module
from klgrpo.math.kl import ESTIMATORS, PLACEMENTS
from klgrpo.math.sampler_correction import SamplerCorrection
from klgrpo.verify import categorical, sequence_toy
from klgrpo.verify.first_epoch import declared_first_epoch
from klgrpo.verify.penalty import GRADIENT_RTOL, GradientCheck, gradient_check
from klgrpo.verify.sampler_mismatch import categorical_gradient, sequence_gradient

STALENESS = (1, 2, 4)
IS_CORRECTIONS = ("in_graph", "detached")  # kl.is_correction at a first update (none: w = 1, the same)
#: Each update moves the logits by this much in the largest coordinate (a KL of about 0.005 per update).
STEP = 0.15
#: label -> (the correction, whether its weight is exact at the token level, at the sequence level)
CORRECTIONS = {
    "none": (SamplerCorrection("none"), False, False),
    "token_mask (no bounds)": (SamplerCorrection("token_mask", None, None), True, False),
    "sequence_mask (no bounds)": (SamplerCorrection("sequence_mask", None, None), True, True),
}
BUG_KL_AT_PI_OLD = "KL weighted by pi / pi_old, not pi / mu"


@dataclass
class StalenessCheck(GradientCheck):
    staleness: int = 0
    correction: str = ""
    kl_stale: float = 0.0  # KL(mu || pi) of the stale policy, per token (token) or per sequence (sequence)
    bug: str = ""


@dataclass
class StalenessBug:
    bug: str
    failed: int
    rows: int

    @property
    def passed(self) -> bool:  # caught when some row fails
        return self.failed > 0


def _update_direction(log_prob_of, theta: Tensor, reward: Tensor) -> Tensor:
    """The policy-gradient step of E_pi[reward] at theta, scaled to STEP in its largest coordinate."""
    theta = theta.clone().requires_grad_(True)
    expected = (log_prob_of(theta).exp() * reward).sum()
    (g,) = torch.autograd.grad(expected, theta)
    return STEP * g / g.abs().max()


def stale_categorical(cat: categorical.CategoricalProblem, k: int) -> categorical.CategoricalProblem:
    reward = torch.linspace(-1.0, 1.0, cat.logits.numel(), dtype=torch.float64)
    step = _update_direction(lambda t: torch.log_softmax(t, -1), cat.logits, reward)
    return dataclasses.replace(cat, mu_logits=cat.logits - k * step)


def stale_toy(toy: sequence_toy.ToyProblem, k: int) -> sequence_toy.ToyProblem:
    t = sequence_toy.TOY
    step = _update_direction(t.seq_logp, toy.theta, t.num_a_B)
    return dataclasses.replace(toy, mu_theta=toy.theta - k * step)


def _stale_kl(level: str, problem) -> float:
    if level == "token":
        mu, pi = torch.log_softmax(problem.mu_logits, -1), torch.log_softmax(problem.logits, -1)
    else:
        t = sequence_toy.TOY
        mu, pi = t.seq_logp(problem.mu_theta), t.seq_logp(problem.theta)
    return float((mu.exp() * (mu - pi)).sum())


def staleness_rows(cat: categorical.CategoricalProblem, toy: sequence_toy.ToyProblem, rtol: float = GRADIENT_RTOL,
                   bug: str = "") -> list[StalenessCheck]:
    rows = []
    for k in STALENESS:
        levels = (("token", categorical_gradient, stale_categorical(cat, k), categorical.kl_values_and_gradients(cat)),
                  ("sequence", sequence_gradient, stale_toy(toy, k), sequence_toy.kl_values_and_gradients(toy)))
        for level, gradient, problem, kl in levels:
            kl_stale = _stale_kl(level, problem)
            for estimator in ESTIMATORS:
                for placement in PLACEMENTS:
                    for is_correction in IS_CORRECTIONS:
                        own = declared_first_epoch(estimator, placement, is_correction, level)
                        if own != "reverse":
                            continue  # the setting does not follow the reverse KL even with fresh samples
                        for label, (correction, token_exact, sequence_exact) in CORRECTIONS.items():
                            exact = token_exact if level == "token" else sequence_exact
                            g = gradient(problem, estimator, placement, is_correction, correction)
                            rows.append(gradient_check(
                                g, kl, own if exact else "neither", rtol, check=StalenessCheck, staleness=k,
                                correction=label, kl_stale=kl_stale, bug=bug, estimator=estimator,
                                placement=placement, sampling=f"first_epoch_{is_correction}", level=level))
    return rows


@contextmanager
def planted(bug: str):
    """The trainer with the KL term left at pi / pi_old: the sampler correction's factor on the policy term only."""
    saved = objective_module.kl_factor
    if bug == BUG_KL_AT_PI_OLD:
        objective_module.kl_factor = lambda rule, factors, keep: None
    try:
        yield
    finally:
        objective_module.kl_factor = saved


def all_staleness_rows(cat: categorical.CategoricalProblem,
                       toy: sequence_toy.ToyProblem) -> tuple[list[StalenessCheck], list[StalenessBug]]:
    rows = staleness_rows(cat, toy)
    with planted(BUG_KL_AT_PI_OLD):
        bug_rows = [r for r in staleness_rows(cat, toy, bug=BUG_KL_AT_PI_OLD) if r.correction != "none"]
    return rows, [StalenessBug(BUG_KL_AT_PI_OLD, sum(not r.passed for r in bug_rows), len(bug_rows))]


def format_staleness(rows: list[StalenessCheck], bugs: list[StalenessBug]) -> str:
    title = ("Stale samples (mu = the policy K updates back, the trainer at the current weights): which KL the KL "
             "term's expected gradient follows, per rollout.sampler_correction, for every setting that follows the "
             "reverse KL with fresh samples")
    head = (f"{'K':>2} {'level':<8} {'KL(mu||pi)':>10} {'correction':<26} {'rows':>5} "
            f"{'found (reverse/forward/neither)':<32} ok")
    lines = []
    for key in dict.fromkeys((r.staleness, r.level, r.correction) for r in rows):
        mine = [r for r in rows if (r.staleness, r.level, r.correction) == key]
        found = "/".join(str(sum(r.gradient_target == t for r in mine)) for t in ("reverse", "forward", "neither"))
        lines.append(f"{key[0]:>2} {key[1]:<8} {mine[0].kl_stale:10.4f} {key[2]:<26} {len(mine):>5} {found:<32} "
                     f"{'ok' if all(r.passed for r in mine) else 'FAIL'}")
    bug_lines = [f"planted: {b.bug}: {b.failed}/{b.rows} corrected rows fail  "
                 f"{'ok' if b.passed else 'FAIL (not caught)'}" for b in bugs]
    return "\n".join([title, head, "-" * len(head), *lines, "", *bug_lines])
