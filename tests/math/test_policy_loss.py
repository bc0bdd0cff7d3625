"""PPO-clipped surrogate (with delta and dual clip) and importance weight (klgrpo/math/policy_loss.py), by hand."""

from __future__ import annotations

import math

import pytest
import torch

from klgrpo.math.policy_loss import IS_CORRECTIONS, clipped_surrogate, importance_weight

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


def test_delta_caps_the_unclipped_branch_only():
    # A = -1, rho = [0.5 .. 1.5], eps 0.2/0.28, delta 1.3: unclipped -min(rho, 1.3)*A... = min over branches:
    # -min(-min(rho, 1.3), -clip(rho)) = max(min(rho, 1.3), clip(rho)) = [0.8, 0.8, 1, 1.25, 1.3]
    logp = _logp(RATIOS)
    out = clipped_surrogate(logp, torch.zeros(1, 5, dtype=F64), torch.tensor([-1.0], dtype=F64), EPS_LOW, EPS_HIGH,
                            delta=1.3)
    torch.testing.assert_close(out.loss_BT, torch.tensor([[0.8, 0.8, 1.0, 1.25, 1.3]], dtype=F64), rtol=1e-14, atol=0)
    torch.testing.assert_close(out.ratio_BT, torch.tensor([RATIOS], dtype=F64), rtol=1e-14, atol=0)  # uncapped
    out.loss_BT.sum().backward()
    # gradient d loss / d logp = rho * (-A) on the active unclipped branch (1.25), 0 where clipped or capped
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.0, 1.0, 1.25, 0.0]], dtype=F64), rtol=1e-14, atol=0)


def test_dual_clip_bounds_negative_advantage_loss():
    # A = -2, rho = [0.5 .. 1.5], dual clip 1.3 -> loss = min(max(2 rho, 2 clip(rho)), 2 * 1.3)
    #   2 rho = [1, 1.5, 2, 2.5, 3]; 2 clip = [1.6, 1.6, 2, 2.5, 2.56]; max = [1.6, 1.6, 2, 2.5, 3]; min(., 2.6)
    logp = _logp(RATIOS)
    out = clipped_surrogate(logp, torch.zeros(1, 5, dtype=F64), torch.tensor([-2.0], dtype=F64), EPS_LOW, EPS_HIGH,
                            dual_clip=1.3)
    torch.testing.assert_close(out.loss_BT, torch.tensor([[1.6, 1.6, 2.0, 2.5, 2.6]], dtype=F64), rtol=1e-14, atol=0)
    # A > 0 is untouched
    pos = clipped_surrogate(logp, torch.zeros(1, 5, dtype=F64), torch.tensor([2.0], dtype=F64), EPS_LOW, EPS_HIGH,
                            dual_clip=1.3)
    ref = clipped_surrogate(logp, torch.zeros(1, 5, dtype=F64), torch.tensor([2.0], dtype=F64), EPS_LOW, EPS_HIGH)
    torch.testing.assert_close(pos.loss_BT, ref.loss_BT, rtol=0, atol=0)
