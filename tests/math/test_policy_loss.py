"""PPO-clipped surrogate, importance weight and KL loss term (klgrpo/math/policy_loss.py), by hand."""

from __future__ import annotations

import math

import pytest
import torch

from klgrpo.math.policy_loss import IS_CORRECTIONS, clipped_surrogate, importance_weight, kl_loss_term

F64 = torch.float64
RATIOS = [0.5, 0.75, 1.0, 1.25, 1.5]
EPS_LOW, EPS_HIGH = 0.2, 0.28  # clip-higher: ratio range [0.8, 1.28]


def _logp(ratios, rows=1):
    """log-probs with old_logp = 0, so rho = exp(logp) = the given ratios; leaf tensor with grad."""
    return torch.log(torch.tensor([ratios] * rows, dtype=F64)).requires_grad_(True)


def test_clipped_surrogate_sequence_advantages():
    logp = _logp(RATIOS, rows=2)
    old = torch.zeros(2, 5, dtype=F64)
    out = clipped_surrogate(logp, old, torch.tensor([1.0, -2.0], dtype=F64), EPS_LOW, EPS_HIGH)
    torch.testing.assert_close(out.ratio_BT, torch.tensor([RATIOS] * 2, dtype=F64), rtol=1e-14, atol=0)
    # A = +1: clip(rho) = [0.8, 0.8, 1, 1.25, 1.28]; min(rho, clip) = [0.5, 0.75, 1, 1.25, 1.28]
    #         (1.25 is inside [0.8, 1.28]: clip-higher keeps it; symmetric 0.2 would clip it)
    # A = -2: -2 rho = [-1, -1.5, -2, -2.5, -3]; -2 clip = [-1.6, -1.6, -2, -2.5, -2.56];
    #         min = [-1.6, -1.6, -2, -2.5, -3]
    expected_loss = [[-0.5, -0.75, -1.0, -1.25, -1.28],
                     [1.6, 1.6, 2.0, 2.5, 3.0]]
    torch.testing.assert_close(out.loss_BT, torch.tensor(expected_loss, dtype=F64), rtol=1e-14, atol=1e-15)
    assert out.clipped_high_BT.tolist() == [[False, False, False, False, True], [False] * 5]
    assert out.clipped_low_BT.tolist() == [[False] * 5, [True, True, False, False, False]]
    # d loss / d logp = -A rho where the unclipped branch is the min, else 0:
    #   A = +1: [-0.5, -0.75, -1, -1.25, 0]; A = -2: [0, 0, 2, 2.5, 3]
    out.loss_BT.sum().backward()
    expected_grad = [[-0.5, -0.75, -1.0, -1.25, 0.0],
                     [0.0, 0.0, 2.0, 2.5, 3.0]]
    torch.testing.assert_close(logp.grad, torch.tensor(expected_grad, dtype=F64), rtol=1e-14, atol=0)


def test_clipped_surrogate_token_advantages():
    logp = _logp(RATIOS)
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0, 0.0]], dtype=F64)
    out = clipped_surrogate(logp, torch.zeros(1, 5, dtype=F64), adv, EPS_LOW, EPS_HIGH)
    # t0 rho .5 A +1: min(.5, .8) = .5 -> -0.5, grad -0.5
    # t1 rho .75 A -1: min(-.75, -.8) = -.8 -> 0.8, low clip, grad 0
    # t2 rho 1 A +1: -1, grad -1
    # t3 rho 1.25 A -1: min(-1.25, -1.25) -> 1.25, inside the range, grad +1.25
    # t4 A = 0: loss 0, no clip flag, grad 0
    torch.testing.assert_close(out.loss_BT, torch.tensor([[-0.5, 0.8, -1.0, 1.25, 0.0]], dtype=F64),
                               rtol=1e-14, atol=1e-15)
    assert out.clipped_low_BT.tolist() == [[False, True, False, False, False]]
    assert out.clipped_high_BT.tolist() == [[False] * 5]
    out.loss_BT.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.5, 0.0, -1.0, 1.25, 0.0]], dtype=F64),
                               rtol=1e-14, atol=0)


def test_symmetric_default_clips_1_25():
    # default eps 0.2/0.2: rho 1.25 with A = +1 is clipped to 1.2 (loss -1.2, no gradient, high flag)
    logp = _logp([1.25])
    out = clipped_surrogate(logp, torch.zeros(1, 1, dtype=F64), torch.tensor([1.0], dtype=F64))
    assert float(out.loss_BT.detach()) == pytest.approx(-1.2, rel=1e-14)
    assert out.clipped_high_BT.item()
    out.loss_BT.sum().backward()
    assert float(logp.grad) == 0.0


def test_surrogate_does_not_differentiate_old_logp():
    logp = _logp([1.0, 1.1])
    old = torch.zeros(1, 2, dtype=F64, requires_grad=True)
    out = clipped_surrogate(logp, old, torch.tensor([1.0], dtype=F64))
    out.loss_BT.sum().backward()
    assert old.grad is None


@pytest.mark.parametrize("is_correction", IS_CORRECTIONS)
def test_importance_weight(is_correction):
    # logp - old = log 2 and log 0.5 -> w = [2, 0.5]
    logp = torch.tensor([[math.log(2.0), math.log(0.5)]], dtype=F64, requires_grad=True)
    old = torch.zeros(1, 2, dtype=F64, requires_grad=True)
    w = importance_weight(logp, old, is_correction)
    if is_correction == "none":
        assert torch.equal(w, torch.ones(1, 2, dtype=w.dtype)) and not w.requires_grad
        return
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5]], dtype=F64), rtol=1e-15, atol=0)
    if is_correction == "detached":
        assert not w.requires_grad
        return
    # in_graph: d w / d logp = w; the rollout policy's log-prob is a constant
    w.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[2.0, 0.5]], dtype=F64), rtol=1e-15, atol=0)
    assert old.grad is None


def test_importance_weight_unknown_name():
    with pytest.raises(KeyError, match="in_graph, detached, none"):
        importance_weight(torch.zeros(1, 1), torch.zeros(1, 1), "stop_grad")


# One token: pi = 0.5, ref = 0.25, pi_old = 0.4 -> l = log 2, r = 1/2, w = 0.5 / 0.4 = 1.25.
LOG2 = math.log(2.0)
K_VALUES = {
    "k1": LOG2,                 # l
    "k2": 0.5 * LOG2 ** 2,      # l^2 / 2 = 0.2402265
    "k3": LOG2 - 0.5,           # r - 1 - log r = 1/2 + log 2 - 1 = 0.1931472
}
# d k / d logp (= d k / d l): k1: 1; k2: l; k3: 1 - r = 1/2
K_GRADS = {"k1": 1.0, "k2": LOG2, "k3": 0.5}


@pytest.mark.parametrize("estimator", sorted(K_VALUES))
@pytest.mark.parametrize("is_correction", IS_CORRECTIONS + ("on_policy",))
def test_kl_loss_term(estimator, is_correction):
    logp = torch.tensor([[math.log(0.5)]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[math.log(0.25)]], dtype=F64)
    old = torch.tensor([[math.log(0.4)]], dtype=F64)
    k, dk = K_VALUES[estimator], K_GRADS[estimator]
    if is_correction == "on_policy":
        term, kl = kl_loss_term(logp, ref, estimator)
        w, expected_grad = 1.0, dk
    else:
        term, kl = kl_loss_term(logp, ref, estimator, old_logp_BT=old, is_correction=is_correction)
        w = 1.0 if is_correction == "none" else 1.25
        # d(w k)/d logp = w k + w k' when w is in the graph (d w / d logp = w), else w k'
        expected_grad = 1.25 * (k + dk) if is_correction == "in_graph" else w * dk
    assert float(kl.detach()) == pytest.approx(k, rel=1e-14)
    assert float(term.detach()) == pytest.approx(w * k, rel=1e-14)
    (grad,) = torch.autograd.grad(term.sum(), logp)
    assert float(grad) == pytest.approx(expected_grad, rel=1e-14)


def test_in_graph_k3_gradient_is_w_times_l():
    # k3 + k3' = (e^{-l} + l - 1) + (1 - e^{-l}) = l, so the in-graph term's gradient is w l = 1.25 log 2
    logp = torch.tensor([[math.log(0.5)]], dtype=F64, requires_grad=True)
    term, _ = kl_loss_term(logp, torch.tensor([[math.log(0.25)]], dtype=F64), "k3",
                           old_logp_BT=torch.tensor([[math.log(0.4)]], dtype=F64), is_correction="in_graph")
    term.sum().backward()
    assert float(logp.grad) == pytest.approx(1.25 * LOG2, rel=1e-14)  # 0.8664340
