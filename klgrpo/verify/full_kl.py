"""Exact checks of ``kl.estimator: full``, the exact KL over the vocabulary at each sampled prefix.

The per-position KL comes from the trainer's own chunked function (math.full_kl.token_logprobs_and_full_kl,
with its custom backward) on the problems' logits, and enters the trainer's ``grpo_objective`` through
:func:`klgrpo.verify.penalty.penalty_objective`, loss placement only (the only one it supports):

    token level (categorical, K outcomes: the "full" KL at the one prefix is KL(pi||ref) itself)
        value      E_q[KL] = KL(pi||ref) for q = pi and q = mu (the value does not depend on the draw)
        per draw   grad L(y) = grad KL(pi||ref) for every outcome y: zero variance over the vocabulary
        expected   grad: reverse, scale 1, for every sampling (math.full_kl.FULL_KL_GRADIENTS)
    sequence level (the toy: 45 parameters, 31 sequences)
        value      E_pi[sum_t KL_t(prefix_t)] = KL(pi||ref) of the sequences (chain rule), exactly
        expected   grad: neither. grad E_pi[sum_t KL_t] = E_pi[sum_t grad KL_t] + E_pi[sum_t KL_t grad log
                   pi(prefix_t)]; a loss term gives only the first part (the prefixes' score term is missing)
"""

from __future__ import annotations

import torch
from torch import Tensor

from klgrpo.math.full_kl import FULL_KL, FULL_KL_GRADIENTS, token_logprobs_and_full_kl
from klgrpo.math.kl import SAMPLINGS
from klgrpo.verify import categorical, sequence_toy
from klgrpo.verify.penalty import GRADIENT_RTOL, GradientCheck, flat_grad, gradient_check, penalty_objective

#: Values and per-draw gradients are float64 sums of a handful of terms: equal to this absolute error.
FULL_KL_ATOL = 1e-12


def _identity(hidden: Tensor) -> Tensor:
    """The problems' reference logits are given directly: the "output layer" is the identity."""
    return hidden


def _categorical_terms(problem: categorical.CategoricalProblem, theta: Tensor) -> tuple[Tensor, Tensor]:
    """(logp [K, 1], KL [K, 1]): row y is the one-token sequence y; every row sees the same prefix."""
    k = theta.shape[-1]
    logp, kl, _, _ = token_logprobs_and_full_kl(theta.expand(k, 1, k), torch.arange(k).unsqueeze(-1),
                                                problem.ref_logits.expand(k, 1, k), _identity)
    return logp, kl


def _toy_terms(theta: Tensor, ref_theta: Tensor) -> tuple[Tensor, Tensor]:
    """(logp [S, T], KL [S, T]) of every toy sequence; padding positions hold values the mask drops."""
    toy = sequence_toy.TOY
    logp, kl, _, _ = token_logprobs_and_full_kl(theta[toy.prefix_BT], toy.tokens_BT, ref_theta[toy.prefix_BT],
                                                _identity)
    return logp, kl


def token_objective(problem: categorical.CategoricalProblem, theta: Tensor, sampling: str,
                    weights_B: Tensor | None = None) -> Tensor:
    b = categorical.batch(problem, theta)
    logp, kl = _categorical_terms(problem, theta)
    if weights_B is None:
        weights_B = b["pi_B"] if sampling == "on_policy" else b["mu_B"]
    return penalty_objective(logp, b["ref_logp_BT"], b["mask_BT"], weights_B, FULL_KL, "loss", sampling,
                             mu_logp_BT=b["mu_logp_BT"], full_kl_BT=kl)


def sequence_objective(problem: sequence_toy.ToyProblem, theta: Tensor, sampling: str) -> Tensor:
    toy = sequence_toy.TOY
    logp, kl = _toy_terms(theta, problem.ref_theta)
    weights = toy.seq_logp(theta if sampling == "on_policy" else problem.mu_theta).exp()
    return penalty_objective(logp, toy.logp_BT(problem.ref_theta), toy.mask_BT, weights, FULL_KL, "loss", sampling,
                             mu_logp_BT=toy.logp_BT(problem.mu_theta), full_kl_BT=kl)


def value_rows(cat: categorical.CategoricalProblem, toy: sequence_toy.ToyProblem) -> list[dict]:
    """E[value] vs the exact KL at both levels; the token row also checks every draw's gradient."""
    theta = cat.theta()
    b = categorical.batch(cat, theta.detach())
    kl_B = _categorical_terms(cat, theta.detach())[1].squeeze(-1)
    exact = categorical.kl_values_and_gradients(cat)
    expected = float((b["pi_B"] * kl_B).sum())
    under_mu = float((b["mu_B"] * kl_B).sum())
    worst = 0.0
    for y in range(theta.shape[-1]):
        one_draw = torch.nn.functional.one_hot(torch.tensor(y), theta.shape[-1]).to(theta.dtype)
        draw_theta = cat.theta()
        g = flat_grad(token_objective(cat, draw_theta, "on_policy", weights_B=one_draw), draw_theta)
        worst = max(worst, float((g - exact["grad_reverse"]).abs().max()))
    diff = max(abs(expected - exact["reverse"]), abs(under_mu - exact["reverse"]))
    token = {"estimator": FULL_KL, "level": "token", "expected_value": expected, "kl": exact["reverse"],
             "abs_diff": diff, "declared_unbiased": True, "declared_nonnegative": True,
             "per_sample_grad_max_err": worst,
             "passed": bool(diff < FULL_KL_ATOL and worst < FULL_KL_ATOL and (kl_B >= 0).all())}

    seq = sequence_toy.TOY
    logp, kl_BT = _toy_terms(toy.theta, toy.ref_theta)
    seq_expected = float((seq.seq_logp(toy.theta).exp() * (kl_BT * seq.mask_BT).sum(-1)).sum())
    seq_kl = float(sequence_toy.sequence_kls(toy.theta, toy.ref_theta)[0])
    seq_diff = abs(seq_expected - seq_kl)
    sequence = {"estimator": FULL_KL, "level": "sequence", "expected_value": seq_expected, "kl": seq_kl,
                "abs_diff": seq_diff, "declared_unbiased": True, "declared_nonnegative": True,
                "passed": bool(seq_diff < FULL_KL_ATOL and (kl_BT >= 0).all())}
    return [token, sequence]


def gradient_rows(cat: categorical.CategoricalProblem, toy: sequence_toy.ToyProblem,
                  rtol: float = GRADIENT_RTOL) -> list[GradientCheck]:
    """The expected gradient of the loss term for every sampling, token and sequence level, vs its declaration."""
    rows = []
    levels = (("token", categorical.kl_values_and_gradients(cat), lambda s: (cat.theta(), token_objective, cat)),
              ("sequence", sequence_toy.kl_values_and_gradients(toy), lambda s: (toy.params(), sequence_objective,
                                                                                  toy)))
    for level, kl, setup in levels:
        for sampling in SAMPLINGS:
            theta, objective, problem = setup(sampling)
            rows.append(gradient_check(flat_grad(objective(problem, theta, sampling), theta), kl,
                                       FULL_KL_GRADIENTS[(level, sampling)], rtol,
                                       estimator=FULL_KL, placement="loss", sampling=sampling, level=level))
    return rows
