"""Exact checks on one categorical draw (docs/kl_math.md, "Exact tests"): the "token" level of the tables.

K = 6 outcomes with random float64 logits for pi (the parameters theta), pi_ref and mu (the rollout policy
of the off-policy rows). Every expectation is a sum over the K outcomes, so nothing is sampled:

    E_pi[k(y)]                    vs exact KL(pi || ref) = sum_y pi(y) (log pi(y) - log ref(y))
    grad k(y) per outcome         vs f(l_y) s_y, s_y = grad log pi(y) = e_y - pi   (f: the registered score_factor)
    E_q[grad L(y)]                = autograd of sum_y q(y).detach() L(y), L built by penalty_objective
    grad KL(pi||ref), grad KL(ref||pi)   autograd of the exact sums (pi not detached)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from klgrpo.math.kl import DEFAULT_LOG_RATIO_CLAMP, ESTIMATORS, exact_kl, kl_estimate
from klgrpo.verify.penalty import GRADIENT_RTOL, GradientCheck, declared_gradient_rows, flat_grad, penalty_objective

#: A biased estimator must miss KL by more than this fraction of KL ("clearly different").
BIAS_MIN_REL = 1e-3
#: An unbiased estimator must match KL to this absolute error (docs/kl_math.md: 1e-12).
VALUE_ATOL = 1e-12


def is_straight_through(name: str) -> bool:
    return name.endswith("_st") and name[: -len("_st")] in ESTIMATORS


def score_factor(name: str) -> Callable[[Tensor], Tensor]:
    """f with grad k(y) = f(l_y) s_y, as the estimator's registration declares it (written by hand)."""
    return ESTIMATORS[name].score_factor


@dataclass(frozen=True)
class CategoricalProblem:
    """Logits [K] (float64) of pi, pi_ref and mu."""

    logits: Tensor
    ref_logits: Tensor
    mu_logits: Tensor

    def theta(self) -> Tensor:
        return self.logits.clone().requires_grad_(True)


def make_categorical(seed: int = 0, num_outcomes: int = 6, scale: float = 1.0,
                     mu_shift: float = 0.3) -> CategoricalProblem:
    """pi and ref: independent N(0, scale^2) logits; mu = pi's logits + N(0, mu_shift^2) noise (a rollout
    policy near pi, as PPO keeps it, so importance weights stay moderate for the Monte Carlo check)."""
    logits, ref_logits, mu_logits = random_pi_ref_mu(num_outcomes, seed, scale, mu_shift)
    return CategoricalProblem(logits=logits, ref_logits=ref_logits, mu_logits=mu_logits)


def random_pi_ref_mu(shape, seed: int, scale: float, mu_shift: float) -> tuple[Tensor, Tensor, Tensor]:
    """Logits of pi and ref: independent N(0, scale^2) draws of ``shape``; mu's: pi's + N(0, mu_shift^2) noise
    (float64, from one stream seeded with ``seed``, in that order)."""
    gen = torch.Generator().manual_seed(seed)
    draw = lambda: torch.randn(shape, generator=gen, dtype=torch.float64)  # noqa: E731
    pi, ref = scale * draw(), scale * draw()
    return pi, ref, pi + mu_shift * draw()


def batch(problem: CategoricalProblem, theta: Tensor) -> dict[str, Tensor]:
    """Every outcome as a one-token "sequence": logp_BT [K, 1] (in the graph), ref/mu log-probs, mask, pi, mu."""
    logp = torch.log_softmax(theta, -1)
    ref_logp = torch.log_softmax(problem.ref_logits, -1)
    mu_logp = torch.log_softmax(problem.mu_logits, -1)
    return {
        "logp_BT": logp.unsqueeze(-1),
        "ref_logp_BT": ref_logp.unsqueeze(-1),
        "mu_logp_BT": mu_logp.unsqueeze(-1),
        "mask_BT": torch.ones(theta.shape[-1], 1, dtype=torch.bool),
        "pi_B": logp.exp(),
        "mu_B": mu_logp.exp(),
        "ref_B": ref_logp.exp(),
    }


def kl_values_and_gradients(problem: CategoricalProblem) -> dict[str, Tensor | float]:
    """Exact KL(pi||ref), KL(ref||pi) and their gradients with respect to pi's logits."""
    theta = problem.theta()
    logp = torch.log_softmax(theta, -1)
    ref_logp = torch.log_softmax(problem.ref_logits, -1)
    reverse = (logp.exp() * (logp - ref_logp)).sum()
    forward = (ref_logp.exp() * (ref_logp - logp)).sum()
    return {
        "reverse": reverse.item(),
        "forward": forward.item(),
        "grad_reverse": flat_grad(reverse, theta, retain_graph=True),
        "grad_forward": flat_grad(forward, theta),
    }


def expected_gradient(problem: CategoricalProblem, estimator: str, placement: str, sampling: str,
                      clamp: float | None = DEFAULT_LOG_RATIO_CLAMP, **options) -> Tensor:
    """E_q[grad L(y)] of the penalty surrogate, exactly: autograd of sum_y q(y).detach() L(y).

    ``options`` go to :func:`penalty_objective` (reward_mode, delta, dual_clip, eps)."""
    theta = problem.theta()
    b = batch(problem, theta)
    weights = b["pi_B"] if sampling == "on_policy" else b["mu_B"]
    objective = penalty_objective(b["logp_BT"], b["ref_logp_BT"], b["mask_BT"], weights, estimator, placement,
                                  sampling, mu_logp_BT=b["mu_logp_BT"], clamp=clamp, **options)
    return flat_grad(objective, theta)


def value_check(problem: CategoricalProblem, estimator: str) -> dict:
    """E_pi[k] by enumeration vs KL(pi||ref); the declared value_unbiased and nonnegative properties."""
    est = ESTIMATORS[estimator]
    theta = problem.theta().detach()
    b = batch(problem, theta)
    k_B = kl_estimate(b["logp_BT"], b["ref_logp_BT"], estimator).squeeze(-1)
    expected = float((b["pi_B"] * k_B).sum())
    kl = float((b["pi_B"] * (b["logp_BT"] - b["ref_logp_BT"]).squeeze(-1)).sum())
    library_kl = float(exact_kl(problem.logits, problem.ref_logits))
    diff = abs(expected - kl)
    unbiased_ok = diff < VALUE_ATOL if est.value_unbiased else diff > BIAS_MIN_REL * kl
    nonneg_ok = bool((k_B >= 0).all()) if est.nonnegative else True
    exact_kl_ok = abs(library_kl - kl) < VALUE_ATOL
    return {
        "estimator": estimator, "level": "token", "expected_value": expected, "kl": kl, "abs_diff": diff,
        "declared_unbiased": est.value_unbiased, "declared_nonnegative": est.nonnegative,
        "exact_kl": library_kl, "passed": bool(unbiased_ok and nonneg_ok and exact_kl_ok),
    }


def per_sample_gradient_error(problem: CategoricalProblem, estimator: str) -> float:
    """max over outcomes y and coordinates of |grad k(y) - f(l_y) s_y| (autograd of the library vs the formula)."""
    f = score_factor(estimator)
    theta = problem.theta()
    b = batch(problem, theta)
    k_B = kl_estimate(b["logp_BT"], b["ref_logp_BT"], estimator).squeeze(-1)
    pi = b["pi_B"].detach()
    l_B = (b["logp_BT"] - b["ref_logp_BT"]).squeeze(-1).detach()
    eye = torch.eye(len(pi), dtype=pi.dtype)
    worst = 0.0
    for y in range(len(pi)):
        (g,) = torch.autograd.grad(k_B[y], theta, retain_graph=True)
        want = f(l_B[y]) * (eye[y] - pi)  # s_y = e_y - pi for softmax logits
        worst = max(worst, float((g - want).abs().max()))
    return worst


def gradient_rows(problem: CategoricalProblem, rtol: float = GRADIENT_RTOL) -> list[GradientCheck]:
    """Every registered estimator x placement x sampling at level "token", against its declaration."""
    return declared_gradient_rows("token", lambda *setting: expected_gradient(problem, *setting),
                                  kl_values_and_gradients(problem), rtol)
