"""KL estimators against exact answers (docs/kl_math.md), parametrised over the ESTIMATORS registry.

A newly registered estimator is picked up by every test here: its value property, its per-sample gradient
formula (the ``score_factor`` its registration declares, derived by hand) and its declared token-level
gradient table for every placement x sampling.
"""

from __future__ import annotations

import math

import pytest
import torch

from klgrpo.math.kl import (
    DEFAULT_LOG_RATIO_CLAMP,
    ESTIMATORS,
    GRADIENT_TARGETS,
    PLACEMENTS,
    SAMPLINGS,
    clamp_fraction,
    exact_kl,
    kl_estimate,
)
from klgrpo.verify import categorical
from klgrpo.verify.penalty import GRADIENT_RTOL, classify_gradient
from klgrpo.verify.report import torch_threads

NAMES = ESTIMATORS.names()
STRAIGHT_THROUGH = [n for n in NAMES if categorical.is_straight_through(n)]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="module", params=[0, 1], ids=["seed0", "seed1"])
def problem(request):
    return categorical.make_categorical(seed=request.param)


@pytest.fixture(scope="module")
def kl_grads(problem):
    return categorical.kl_values_and_gradients(problem)


# ---------------------------------------------------------------- values


def test_formulas_at_hand_computed_points():
    # l = log pi - log ref = 0.5: k1 = 0.5; k2 = 0.25 / 2 = 0.125; k3 = e^-0.5 + 0.5 - 1 = 0.1065306597126334.
    # l = -0.5: k3 = e^0.5 - 0.5 - 1 = 0.1487212707001282 (k3 >= 0 on both sides, k1 < 0 here).
    logp = torch.tensor([-1.0, -2.0], dtype=torch.float64)
    ref_logp = torch.tensor([-1.5, -1.5], dtype=torch.float64)
    torch.testing.assert_close(kl_estimate(logp, ref_logp, "k1"), torch.tensor([0.5, -0.5], dtype=torch.float64))
    torch.testing.assert_close(kl_estimate(logp, ref_logp, "k2"), torch.tensor([0.125, 0.125], dtype=torch.float64))
    torch.testing.assert_close(kl_estimate(logp, ref_logp, "k3"),
                               torch.tensor([0.1065306597126334, 0.1487212707001282], dtype=torch.float64),
                               rtol=1e-14, atol=0)


@pytest.mark.parametrize("name", NAMES)
def test_value_property_by_enumeration(problem, name):
    """E_pi[k] = sum_y pi(y) k(y) equals KL(pi||ref) to 1e-12 iff the value is declared unbiased."""
    est = ESTIMATORS[name]
    pi = torch.softmax(problem.logits, -1)
    logp, ref_logp = torch.log_softmax(problem.logits, -1), torch.log_softmax(problem.ref_logits, -1)
    kl = float((pi * (logp - ref_logp)).sum())
    expected = float((pi * kl_estimate(logp, ref_logp, name)).sum())
    if est.value_unbiased:
        assert abs(expected - kl) < 1e-12
    else:
        assert abs(expected - kl) > 1e-3 * kl, f"{name} is declared biased but E[k] = KL"
    if est.nonnegative:
        assert bool((kl_estimate(logp, ref_logp, name) >= 0).all())
    assert categorical.value_check(problem, name)["passed"]


def test_k2_bias_has_either_sign():
    # docs/kl_math.md: k2 is biased, with a bias of either sign. Two outcomes:
    # pi = (0.5, 0.5), ref = (0.9, 0.1): l = (ln(5/9), ln 5) = (-0.5878, 1.6094);
    #   E[l^2/2] = 0.5 (0.1727 + 1.2951) = 0.7339 > KL = 0.5 (-0.5878 + 1.6094) = 0.5108 (over-estimates).
    # pi = (0.95, 0.05), ref = (0.9, 0.1): l = (ln(19/18), ln 0.5) = (0.05407, -0.6931);
    #   E[l^2/2] = 0.95 * 0.001462 + 0.05 * 0.2402 = 0.01340 < KL = 0.05137 - 0.03466 = 0.01671 (under).
    cases = (([0.5, 0.5], [0.9, 0.1], 0.7339, 0.5108), ([0.95, 0.05], [0.9, 0.1], 0.01340, 0.01671))
    for pi, ref, hand_k2, hand_kl in cases:
        logp = torch.log(torch.tensor(pi, dtype=torch.float64))
        ref_logp = torch.log(torch.tensor(ref, dtype=torch.float64))
        kl = float((logp.exp() * (logp - ref_logp)).sum())
        e_k2 = float((logp.exp() * kl_estimate(logp, ref_logp, "k2")).sum())
        assert kl == pytest.approx(hand_kl, abs=1e-4) and e_k2 == pytest.approx(hand_k2, abs=1e-4)


# ---------------------------------------------------------------- per-sample gradients


@pytest.mark.parametrize("name", NAMES)
def test_per_sample_gradient_formula(problem, name):
    """grad k1 = s, grad k2 = l s, grad k3 = (1 - r) s, straight-through = grad k2 (s = e_y - pi for logits)."""
    assert categorical.per_sample_gradient_error(problem, name) < 1e-12


@pytest.mark.parametrize("name", STRAIGHT_THROUGH)
def test_straight_through_value_of_base_gradient_of_k2(name):
    base = name[: -len("_st")]
    gen = torch.Generator().manual_seed(3)
    ref_logp = torch.randn(4, 7, generator=gen, dtype=torch.float64)
    logp = (ref_logp + torch.randn(4, 7, generator=gen, dtype=torch.float64)).requires_grad_(True)
    value = kl_estimate(logp, ref_logp, name)
    torch.testing.assert_close(value, kl_estimate(logp, ref_logp, base), rtol=0, atol=0)
    (g,) = torch.autograd.grad(value.sum(), logp)
    (g2,) = torch.autograd.grad(kl_estimate(logp, ref_logp, "k2").sum(), logp)
    torch.testing.assert_close(g, g2, rtol=0, atol=1e-15)
    torch.testing.assert_close(g, (logp - ref_logp).detach(), rtol=0, atol=1e-15)  # d(l^2/2)/dl = l


# ---------------------------------------------------------------- declared gradient tables


def test_declared_tables_are_complete():
    for name in NAMES:
        table = ESTIMATORS[name].gradients
        for level in ("token", "sequence"):
            for placement in PLACEMENTS:
                for sampling in SAMPLINGS:
                    assert table[(level, placement, sampling)] in GRADIENT_TARGETS


@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("name", NAMES)
def test_declared_token_gradient_target(problem, kl_grads, name, placement, sampling):
    g = categorical.expected_gradient(problem, name, placement, sampling)
    found = classify_gradient(g, kl_grads["grad_reverse"], kl_grads["grad_forward"])
    declared = ESTIMATORS[name].gradient_target(placement, sampling, "token")
    assert found["gradient_target"] == declared, (
        f"{name}/{placement}/{sampling}: declared {declared}, exact gradient is {found['gradient_target']} "
        f"(|g - rev| = {found['rel_err_reverse']:.2e}, |g - fwd| = {found['rel_err_forward']:.2e}, "
        f"|g| = {found['norm_ratio']:.2e} of |rev|)")


def test_kl_math_token_facts(problem, kl_grads):
    """Rows of docs/kl_math.md asserted directly (not through the declarations)."""
    rev, fwd = kl_grads["grad_reverse"], kl_grads["grad_forward"]

    def target(name, placement, sampling="on_policy"):
        return classify_gradient(categorical.expected_gradient(problem, name, placement, sampling), rev, fwd)

    assert target("k1", "loss")["gradient_target"] == "zero"
    assert target("k2", "loss")["gradient_target"] == "reverse"
    assert target("k3", "loss")["gradient_target"] == "forward"                     # GRPO/TRL default
    assert target("k3_st", "loss")["gradient_target"] == "reverse"
    assert target("k1", "reward")["gradient_target"] == "reverse"
    assert target("k3", "both")["gradient_target"] == "reverse"
    assert target("k3", "loss", "off_policy_in_graph")["gradient_target"] == "reverse"   # w in the graph
    assert target("k1", "loss", "off_policy_in_graph")["gradient_target"] == "reverse"
    assert target("k2", "loss", "off_policy_detached")["gradient_target"] == "reverse"
    assert target("k3", "loss", "off_policy_detached")["gradient_target"] == "forward"   # the detach bug
    assert target("k3", "loss", "off_policy_none")["gradient_target"] == "neither"
    # k3 in the reward: E_pi[k3 s] = E_pi[(l + r - 1) s] = grad KL(pi||ref) - grad KL(ref||pi).
    g = categorical.expected_gradient(problem, "k3", "reward", "on_policy")
    assert float((g - (rev - fwd)).norm()) <= GRADIENT_RTOL * float(rev.norm())


@pytest.mark.parametrize("sampling", ["off_policy_in_graph", "off_policy_detached"])
@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("name", NAMES)
def test_token_declarations_hold_on_the_first_ppo_epoch(problem, kl_grads, name, placement, sampling):
    """mu = pi (first epoch: w = 1 in value, but an in-graph w still adds E_pi[k s] to the gradient): the loss
    rows equal the off-policy declarations (they hold for every mu), the reward rows the on-policy ones (the reward
    KL is read at pi_old = pi); the registry's first_epoch_<correction> entries say so."""
    same = categorical.CategoricalProblem(problem.logits, problem.ref_logits, mu_logits=problem.logits.clone())
    g = categorical.expected_gradient(same, name, placement, sampling)
    found = classify_gradient(g, kl_grads["grad_reverse"], kl_grads["grad_forward"])["gradient_target"]
    first_epoch = sampling.replace("off_policy", "first_epoch")
    assert found == ESTIMATORS[name].gradient_target(placement, first_epoch, "token")
    if placement == "loss":
        assert found == ESTIMATORS[name].gradient_target(placement, sampling, "token")


# ---------------------------------------------------------------- numerics


def test_k3_finite_in_float32_at_extreme_log_ratio():
    ref_logp = torch.zeros(5)
    logp = torch.tensor([0.0, -100.0, 100.0, -5.0, 25.0], requires_grad=True)  # l = 0, -100, 100, -5, 25
    for name in ("k3", "k3_st"):
        value = kl_estimate(logp, ref_logp, name)
        (g,) = torch.autograd.grad(value.sum(), logp)
        assert bool(torch.isfinite(g).all())
        value = value.detach()
        assert value.dtype == torch.float32 and bool(torch.isfinite(value).all())
        # clamped to |l| <= 20: l = -100 -> e^20 - 20 - 1 = 485165174.4; l = 100 -> e^-20 + 19 = 19.000000002.
        assert math.isclose(float(value[1]), math.exp(20.0) - 21.0, rel_tol=1e-6)
        assert math.isclose(float(value[2]), 19.0, rel_tol=1e-6)
    (g,) = torch.autograd.grad(kl_estimate(logp, ref_logp, "k3").sum(), logp)
    assert float(g[1]) == 0.0 and float(g[2]) == 0.0 and float(g[4]) == 0.0  # clamped: no gradient
    # 3 of 5 tokens have |l| > 20; masking out the l = 25 token leaves 2 of 4 (exact counts: the fraction is
    # the float32 rounding of 3/5, and 2/4 is exact).
    assert float(clamp_fraction(logp, ref_logp)) == float(torch.tensor(3.0) / 5.0)
    mask = torch.tensor([True, True, True, True, False])
    assert float(clamp_fraction(logp, ref_logp, mask)) == 0.5
    assert float(clamp_fraction(logp, ref_logp, mask, clamp=30.0)) == 0.5   # only |l| = 100 exceeds 30
    assert float(clamp_fraction(logp, ref_logp, mask, clamp=None)) == 0.0
    assert DEFAULT_LOG_RATIO_CLAMP == 20.0


def _enumerated_kl(logits, ref_logits):
    """sum_v p_v (log p_v - log q_v) with plain Python floats, one row at a time."""
    out = []
    for row, ref_row in zip(logits.tolist(), ref_logits.tolist()):
        m, mr = max(row), max(ref_row)
        zp = sum(math.exp(x - m) for x in row)
        zq = sum(math.exp(x - mr) for x in ref_row)
        kl = 0.0
        for x, y in zip(row, ref_row):
            lp, lq = x - m - math.log(zp), y - mr - math.log(zq)
            kl += math.exp(lp) * (lp - lq)
        out.append(kl)
    return torch.tensor(out, dtype=torch.float64)


def test_exact_kl_matches_enumeration_and_is_nonnegative():
    gen = torch.Generator().manual_seed(7)
    logits = 2.0 * torch.randn(12, 9, generator=gen, dtype=torch.float64)
    ref_logits = 2.0 * torch.randn(12, 9, generator=gen, dtype=torch.float64)
    got = exact_kl(logits, ref_logits)
    assert got.dtype == torch.float64 and got.shape == (12,)
    torch.testing.assert_close(got, _enumerated_kl(logits, ref_logits), rtol=1e-12, atol=1e-14)
    assert bool((got >= 0).all())
    assert float(exact_kl(logits, logits).abs().max()) < 1e-15
    # leading dims are kept: [2, 6, 9] -> [2, 6]
    assert exact_kl(logits.reshape(2, 6, 9), ref_logits.reshape(2, 6, 9)).shape == (2, 6)


def test_exact_kl_extreme_logits_float32():
    # pi = one-hot(0) (up to e^-1e4), ref = one-hot(1): KL = log pi(0) - log ref(0) = 0 - (-2e4) = 2e4.
    logits = torch.tensor([[1e4, -1e4, 0.0], [1e4, -1e4, 0.0]], dtype=torch.float32)
    ref_logits = torch.tensor([[-1e4, 1e4, 0.0], [1e4, -1e4, 0.0]], dtype=torch.float32)
    got = exact_kl(logits, ref_logits)
    assert got.dtype == torch.float32 and bool(torch.isfinite(got).all())
    assert float(got[0]) == pytest.approx(2e4, rel=1e-6)
    assert float(got[1]) == 0.0
    assert bool((exact_kl(-logits, ref_logits) >= 0).all())


def test_exact_kl_accepts_bfloat16():
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(4, 16, generator=gen).to(torch.bfloat16)
    ref_logits = torch.randn(4, 16, generator=gen).to(torch.bfloat16)
    got = exact_kl(logits, ref_logits)
    assert got.dtype == torch.float32
    # the bf16 inputs are exact in float64; only the float32 computation rounds
    torch.testing.assert_close(got.double(), _enumerated_kl(logits.double(), ref_logits.double()),
                               rtol=1e-5, atol=1e-6)


def test_unknown_estimator_lists_valid_names():
    with pytest.raises(KeyError) as err:
        kl_estimate(torch.zeros(2), torch.zeros(2), "k4")
    message = str(err.value)
    assert "k4" in message
    for name in NAMES:
        assert name in message
