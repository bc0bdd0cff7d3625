"""The objective's KL term (klgrpo/math/objective.py): values and gradients by hand, the clamp guard, and
verify-kl failing when a bug is planted in it (verify-kl runs this very function)."""

from __future__ import annotations

import math

import pytest
import torch

import klgrpo.math.objective as objective
from klgrpo.math.aggregation import Normalizer
from klgrpo.math.kl import ESTIMATORS
from klgrpo.math.objective import (
    KLTerm,
    ObjectiveInputs,
    ObjectiveTerms,
    PolicyTerm,
    grpo_objective,
    kl_penalty_terms,
    reward_kl,
)
from klgrpo.math.policy_loss import IS_CORRECTIONS
from klgrpo.verify import categorical, sequence_toy

F64 = torch.float64

# One token: pi = 0.5, ref = 0.25, pi_old = 0.4 -> l = log 2, r = 1/2, w = 0.5 / 0.4 = 1.25.
LOG2 = math.log(2.0)
K_VALUES = {
    "k1": LOG2,                 # l
    "k2": 0.5 * LOG2 ** 2,      # l^2 / 2 = 0.2402265
    "k3": LOG2 - 0.5,           # r - 1 - log r = 1/2 + log 2 - 1 = 0.1931472
}
# d k / d logp (= d k / d l): k1: 1; k2: l; k3: 1 - r = 1/2
K_GRADS = {"k1": 1.0, "k2": LOG2, "k3": 0.5}


def _one_token():
    logp = torch.tensor([[math.log(0.5)]], dtype=F64, requires_grad=True)
    return logp, torch.tensor([[math.log(0.25)]], dtype=F64), torch.tensor([[math.log(0.4)]], dtype=F64)


@pytest.mark.parametrize("estimator", sorted(K_VALUES))
@pytest.mark.parametrize("is_correction", IS_CORRECTIONS)
def test_kl_penalty_terms_by_hand(estimator, is_correction):
    logp, ref, old = _one_token()
    kl = KLTerm(coef=1.0, estimator=estimator, is_correction=is_correction)
    out = kl_penalty_terms(logp, old, ref, torch.ones(1, 1), kl)
    k, dk = K_VALUES[estimator], K_GRADS[estimator]
    w = 1.0 if is_correction == "none" else 1.25
    # d(w k)/d logp = w k + w k' when w is in the graph (d w / d logp = w), else w k'
    expected_grad = 1.25 * (k + dk) if is_correction == "in_graph" else w * dk
    assert float(out.raw_BT.detach()) == pytest.approx(k, rel=1e-14)
    assert float(out.loss_term_BT.detach()) == pytest.approx(w * k, rel=1e-14)
    (grad,) = torch.autograd.grad(out.loss_term_BT.sum(), logp)
    assert float(grad) == pytest.approx(expected_grad, rel=1e-14)


def test_in_graph_k3_gradient_is_w_times_l():
    # k3 + k3' = (e^{-l} + l - 1) + (1 - e^{-l}) = l, so the in-graph term's gradient is w l = 1.25 log 2
    logp, ref, old = _one_token()
    out = kl_penalty_terms(logp, old, ref, torch.ones(1, 1), KLTerm(coef=1.0, estimator="k3", is_correction="in_graph"))
    out.loss_term_BT.sum().backward()
    assert float(logp.grad) == pytest.approx(1.25 * LOG2, rel=1e-14)  # 0.8664340


def test_grpo_objective_loss_is_pg_plus_beta_kl_by_hand():
    # A = 0.5, eps 0.2: rho = 1.25 > 1.2 is clipped: pg = -1.2 * 0.5 with zero gradient;
    # KL k3 detached: beta * w * k3 = 0.04 * 1.25 * (log 2 - 0.5), gradient beta * w * (1 - r) = 0.04 * 1.25 * 0.5
    logp, ref, old = _one_token()
    kl = KLTerm(coef=0.04, estimator="k3", is_correction="detached")
    out = grpo_objective(ObjectiveInputs(logp, old, ref, torch.tensor([0.5], dtype=F64), torch.ones(1, 1)),
                         ObjectiveTerms(kl=kl, aggregation="token_mean"), Normalizer.of(torch.ones(1, 1)))
    assert float(out.loss.detach()) == pytest.approx(-0.6 + 0.04 * 1.25 * (LOG2 - 0.5), rel=1e-14)
    out.loss.backward()
    assert float(logp.grad) == pytest.approx(0.04 * 1.25 * 0.5, rel=1e-14)


def test_reward_kl_reads_the_rollout_policy():
    # KL in the reward: A_t = A - beta * k1(l_old) with l_old = log 0.4 - log 0.25, not the current policy's l
    logp, ref, old = _one_token()
    kl = KLTerm(coef=0.1, estimator="k1", placement="reward")
    assert float(reward_kl(old, ref, kl)) == pytest.approx(math.log(0.4 / 0.25), rel=1e-14)
    out = grpo_objective(ObjectiveInputs(logp, old, ref, torch.tensor([0.0], dtype=F64), torch.ones(1, 1)),
                         ObjectiveTerms(kl=kl, aggregation="token_mean", policy=PolicyTerm(eps_low=1e9, eps_high=1e9)),
                         Normalizer.of(torch.ones(1, 1)))
    # loss = -rho * A_t = 1.25 * 0.1 * log 1.6
    assert float(out.loss.detach()) == pytest.approx(1.25 * 0.1 * math.log(1.6), rel=1e-14)


def test_sequence_score_mode_leaves_the_advantages_alone():
    logp, ref, old = _one_token()
    kl = KLTerm(coef=0.1, estimator="k1", placement="reward", reward_mode="sequence_score")
    out = grpo_objective(ObjectiveInputs(logp, old, ref, torch.tensor([0.0], dtype=F64), torch.ones(1, 1)),
                         ObjectiveTerms(kl=kl, aggregation="token_mean"), Normalizer.of(torch.ones(1, 1)))
    assert float(out.loss.detach()) == 0.0  # the caller put the KL into the score (advantages.kl_penalized_scores)
    # the metric still reports the penalty the score carries: beta * k1(l_old) = 0.1 * log 1.6
    assert float(out.sums.reward_kl_penalty) == pytest.approx(0.1 * math.log(1.6), rel=1e-14)
    with pytest.raises(KeyError, match="reward_to_go, sequence_score"):
        _ = KLTerm(placement="reward", reward_mode="sum").reward_to_go


# ----------------------------------------------------------------------------------------------- clamp guard
CLAMP = 20.0
BEYOND = (20.5, 25.0, 30.0, 100.0)


def _kl_grad(estimator, is_correction, l, dtype, shaping="none"):
    """d(KL loss term)/d logp for one token with log-ratio l (rho = pi/pi_old = e^-0.25), through grpo_objective."""
    logp = torch.tensor([[-3.0]], dtype=dtype, requires_grad=True)
    ref = torch.tensor([[-3.0 - l]], dtype=dtype)
    old = torch.tensor([[-2.75]], dtype=dtype)
    kl = KLTerm(coef=1.0, estimator=estimator, is_correction=is_correction, clamp=CLAMP, shaping=shaping,
                clip_threshold=10.0)
    out = grpo_objective(ObjectiveInputs(logp, old, ref, torch.zeros(1, dtype=dtype), torch.ones(1, 1)),
                         ObjectiveTerms(kl=kl, aggregation="token_mean"), Normalizer.of(torch.ones(1, 1)))
    (g,) = torch.autograd.grad(out.loss, logp)
    return float(g), out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "k1_st", "k3_st"])
@pytest.mark.parametrize("is_correction", IS_CORRECTIONS)
def test_clamped_tokens_get_zero_kl_gradient(dtype, estimator, is_correction):
    """Beyond the clamp the KL term's gradient is finite and zero (documented), so it never opposes the exact
    reverse-KL gradient rho * l (before the guard, k3 + in_graph gave +w (e^20 - 21) = +3.8e8 at l = -25)."""
    rho = math.exp(-0.25)
    for sign in (1.0, -1.0):
        for magnitude in BEYOND:
            l = sign * magnitude
            g, out = _kl_grad(estimator, is_correction, l, dtype)
            exact = rho * l
            assert math.isfinite(g) and math.isfinite(float(out.loss.detach()))
            assert g == 0.0, (l, g)
            assert g * exact >= 0 and abs(g) <= abs(exact)
    # inside the clamp the same term has a gradient: the test above can fail
    g_inside, _ = _kl_grad(estimator, is_correction, -5.0, dtype)
    if not (estimator == "k1" and is_correction != "in_graph"):
        assert g_inside != 0.0


def test_clamp_metric_counts_the_guarded_tokens():
    _, out = _kl_grad("k3", "in_graph", -25.0, torch.float32)
    assert float(out.sums.clamped) == 1.0
    # the logged k3 value is the clamped one: e^20 - 20 - 1
    assert float(out.sums.raw_kl) == pytest.approx(math.exp(20.0) - 21.0, rel=1e-6)


# ------------------------------------------------------------------------------------ verify-kl runs this code
def _failures(rows):
    return [(r.estimator, r.placement, r.sampling) for r in rows if not r.passed]


def test_verify_kl_passes_on_the_objective_as_it_is():
    assert _failures(categorical.gradient_rows(categorical.make_categorical())) == []


def test_verify_kl_fails_when_the_objective_kl_term_is_wrong(monkeypatch):
    """Plant a bug in the objective's KL term (the in-graph weight silently detached): verify-kl's token table,
    which calls grpo_objective, must report it."""
    real = objective.kl_penalty_terms

    def detached_weight(logp_BT, old_logp_BT, ref_logp_BT, mask_BT, kl, ratio_BT=None, full_kl_BT=None):
        if kl.is_correction == "in_graph":
            kl = KLTerm(**{**kl.__dict__, "is_correction": "detached"})
        return real(logp_BT, old_logp_BT, ref_logp_BT, mask_BT, kl, ratio_BT, full_kl_BT)

    monkeypatch.setattr(objective, "kl_penalty_terms", detached_weight)
    failed = _failures(categorical.gradient_rows(categorical.make_categorical()))
    assert ("k3", "loss", "off_policy_in_graph") in failed and ("k1", "loss", "off_policy_in_graph") in failed


def test_verify_kl_fails_when_the_objective_reward_kl_is_wrong(monkeypatch):
    """Plant a factor 2 into the objective's reward KL: the reward rows of verify-kl's table must report it."""
    real = objective.reward_kl
    monkeypatch.setattr(objective, "reward_kl", lambda old, ref, kl: 2.0 * real(old, ref, kl))
    failed = _failures(categorical.gradient_rows(categorical.make_categorical()))
    assert ("k1", "reward", "on_policy") in failed and ("k3", "both", "on_policy") in failed


def test_sequence_level_uses_the_objective(monkeypatch):
    toy = sequence_toy.make_toy()
    kl = sequence_toy.kl_values_and_gradients(toy)
    g = sequence_toy.expected_gradient(toy, "k1", "reward", "on_policy")
    assert (g - kl["grad_reverse"]).norm() <= 1e-9 * kl["grad_reverse"].norm()
    real = objective.reward_kl
    monkeypatch.setattr(objective, "reward_kl", lambda old, ref, k: 2.0 * real(old, ref, k))
    g_bad = sequence_toy.expected_gradient(toy, "k1", "reward", "on_policy")
    assert (g_bad - 2.0 * kl["grad_reverse"]).norm() <= 1e-9 * kl["grad_reverse"].norm()


def test_every_registered_estimator_is_covered():
    assert set(ESTIMATORS.names()) <= {"k1", "k2", "k3", "k1_st", "k3_st", "full"}
