"""A sampler that is not the policy: which KL the KL term's expected gradient follows when the tokens come from a
sampler mu (vLLM's kernels, bfloat16, prefix caching) while the trainer's pi_old is the policy itself.

The rows are the trainer's first update of a batch (pi_old == pi, kl.is_correction applied, as in
verify/first_epoch.py), for settings whose expected gradient follows the reverse KL when the sampler IS the
policy. The sampler is the problems' mu, deliberately perturbed away from pi (logits + N(0, 0.3^2)); every
expectation is an exact sum over the outcomes weighted by the SAMPLER's probabilities:

    correction                      weight v on the per-token loss (policy and KL terms)   declared
    none                            1                                                       neither
    token_mask, no bounds           pi_old(y_t) / mu(y_t)                                   token level: the setting's
                                                                                            own target; sequence
                                                                                            level: neither (the
                                                                                            prefixes stay mu's)
    sequence_mask, no bounds        prod_t pi_old(y_t) / mu(y_t)                            the setting's own target
    sequence_truncate, max 1.0      min(prod_t pi_old / mu, 1)                              neither (a bound that
                                                                                            binds biases)

E_mu[v(y) g(y)] = E_pi_old[g(y)] for any g when v is the sequence's ratio: that is the exact weight; at one
position the token's ratio is the sequence's. See docs/kl_guide.md, "A sampler that is not the policy".

``rollout.old_logprobs sampler`` takes mu's log-probs as pi_old instead (no trainer forward): the policy ratio and
the KL's weight become pi / mu, and the samples ARE the rollout policy's, so each setting must follow what it
declares for off-policy samples (kl.is_correction in_graph, detached, none), checked for every estimator x
placement x correction at both levels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from klgrpo.math.kl import ESTIMATORS, PLACEMENTS
from klgrpo.math.sampler_correction import SamplerCorrection
from klgrpo.verify import categorical, sequence_toy
from klgrpo.verify.first_epoch import declared_first_epoch
from klgrpo.verify.penalty import GRADIENT_RTOL, GradientCheck, flat_grad, gradient_check, penalty_objective

#: (estimator, placement, kl.is_correction): settings whose gradient follows the reverse KL with an exact sampler
#: at one level at least (k3_st / k3 in the loss per token; k1 in the reward and k3 in both per sequence too).
CASES = (("k3_st", "loss", "detached"), ("k3", "loss", "in_graph"), ("k1", "reward", "detached"),
         ("k3", "both", "detached"))
#: label -> (the correction, whether its weight is exact at the token level, at the sequence level)
CORRECTIONS = {
    "none": (SamplerCorrection("none"), False, False),
    "token_mask (no bounds)": (SamplerCorrection("token_mask", None, None), True, False),
    "sequence_mask (no bounds)": (SamplerCorrection("sequence_mask", None, None), True, True),
    "sequence_truncate max 1": (SamplerCorrection("sequence_truncate", None, 1.0), False, False),
}


@dataclass
class SamplerMismatchCheck(GradientCheck):
    correction: str = ""


def declared(estimator: str, placement: str, is_correction: str, level: str, label: str) -> str | None:
    """The target a row is checked against: the setting's own first-update target where the weight is exact,
    else "neither"; None (information only) where the setting itself has no declaration."""
    own = declared_first_epoch(estimator, placement, is_correction, level)
    if own is None:
        return None
    _, token_exact, sequence_exact = CORRECTIONS[label]
    exact = token_exact if level == "token" else sequence_exact
    return own if exact else "neither"


def categorical_gradient(problem: categorical.CategoricalProblem, estimator: str, placement: str,
                         is_correction: str, correction: SamplerCorrection) -> Tensor:
    """E_mu[grad L(y)] at one position: the outcomes weighted by the sampler's probabilities, pi_old = pi."""
    theta = problem.theta()
    b = categorical.batch(problem, theta)
    objective = penalty_objective(b["logp_BT"], b["ref_logp_BT"], b["mask_BT"], b["mu_B"], estimator, placement,
                                  f"off_policy_{is_correction}", mu_logp_BT=b["logp_BT"].detach(),
                                  sampler_logp_BT=b["mu_logp_BT"], sampler_correction=correction)
    return flat_grad(objective, theta)


def sequence_gradient(problem: sequence_toy.ToyProblem, estimator: str, placement: str, is_correction: str,
                      correction: SamplerCorrection) -> Tensor:
    """E_mu[grad L(seq)] over the toy's 31 sequences, weighted by the sampler's sequence probabilities."""
    toy = sequence_toy.TOY
    theta = problem.params()
    logp_BT, sampler_BT = toy.logp_BT(theta), toy.logp_BT(problem.mu_theta)
    objective = penalty_objective(logp_BT, toy.logp_BT(problem.ref_theta), toy.mask_BT, sampler_BT.sum(-1).exp(),
                                  estimator, placement, f"off_policy_{is_correction}", mu_logp_BT=logp_BT.detach(),
                                  sampler_logp_BT=sampler_BT, sampler_correction=correction)
    return flat_grad(objective, theta)


#: The label of the rows where mu's log-probs are pi_old (rollout.old_logprobs sampler).
OLD_FROM_SAMPLER = "old_logprobs sampler (pi/mu)"
IS_CORRECTIONS = ("in_graph", "detached", "none")


def old_from_sampler_gradient(level: str, problem, estimator: str, placement: str, is_correction: str) -> Tensor:
    """E_mu[grad L] with pi_old = mu, the trainer's batch under rollout.old_logprobs sampler."""
    if level == "token":
        theta = problem.theta()
        b = categorical.batch(problem, theta)
        logp_BT, mu_BT, weights, mask, ref = b["logp_BT"], b["mu_logp_BT"], b["mu_B"], b["mask_BT"], b["ref_logp_BT"]
    else:
        toy = sequence_toy.TOY
        theta = problem.params()
        logp_BT, mu_BT, mask = toy.logp_BT(theta), toy.logp_BT(problem.mu_theta), toy.mask_BT
        weights, ref = mu_BT.sum(-1).exp(), toy.logp_BT(problem.ref_theta)
    objective = penalty_objective(logp_BT, ref, mask, weights, estimator, placement, f"off_policy_{is_correction}",
                                  mu_logp_BT=mu_BT, sampler_logp_BT=mu_BT)
    return flat_grad(objective, theta)


def old_from_sampler_rows(cat: categorical.CategoricalProblem, toy: sequence_toy.ToyProblem,
                          rtol: float = GRADIENT_RTOL) -> list[SamplerMismatchCheck]:
    rows = []
    for level, problem, kl in (("token", cat, categorical.kl_values_and_gradients(cat)),
                               ("sequence", toy, sequence_toy.kl_values_and_gradients(toy))):
        for estimator in ESTIMATORS:
            for placement in PLACEMENTS:
                for is_correction in IS_CORRECTIONS:
                    sampling = f"off_policy_{is_correction}"
                    g = old_from_sampler_gradient(level, problem, estimator, placement, is_correction)
                    rows.append(gradient_check(g, kl, ESTIMATORS[estimator].gradient_target(placement, sampling,
                                                                                            level),
                                               rtol, check=SamplerMismatchCheck, correction=OLD_FROM_SAMPLER,
                                               estimator=estimator, placement=placement, sampling=sampling,
                                               level=level))
    return rows


def sampler_mismatch_rows(cat: categorical.CategoricalProblem, toy: sequence_toy.ToyProblem,
                          rtol: float = GRADIENT_RTOL) -> list[SamplerMismatchCheck]:
    levels = (("token", categorical_gradient, cat, categorical.kl_values_and_gradients(cat)),
              ("sequence", sequence_gradient, toy, sequence_toy.kl_values_and_gradients(toy)))
    rows = []
    for estimator, placement, is_correction in CASES:
        for level, gradient, problem, kl in levels:
            if declared_first_epoch(estimator, placement, is_correction, level) != "reverse":
                continue  # the setting does not follow the reverse KL even with an exact sampler at this level
            for label, (correction, _, _) in CORRECTIONS.items():
                g = gradient(problem, estimator, placement, is_correction, correction)
                rows.append(gradient_check(g, kl, declared(estimator, placement, is_correction, level, label), rtol,
                                           check=SamplerMismatchCheck, correction=label, estimator=estimator,
                                           placement=placement, sampling=f"first_epoch_{is_correction}",
                                           level=level))
    return rows + old_from_sampler_rows(cat, toy, rtol)


def sequence_ratios_bind(toy: sequence_toy.ToyProblem, clip_max: float) -> bool:
    """Whether some toy sequence's ratio pi / mu exceeds ``clip_max`` (the binding row is not vacuous)."""
    t = sequence_toy.TOY
    ratio = torch.exp(t.seq_logp(toy.theta) - t.seq_logp(toy.mu_theta))
    return bool((ratio > clip_max).any())
