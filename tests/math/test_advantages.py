"""Group-relative advantages and the KL-in-reward penalty (klgrpo/math/advantages.py), by hand."""

from __future__ import annotations

import math

import pytest
import torch

from klgrpo.math.advantages import DEFAULT_STD_EPS, apply_kl_penalty, group_advantages, reward_to_go

F64 = torch.float64

# Three groups of G = 4 completions:
#   A = [1, 0, 0, 1]  mean 0.5, centred [ .5, -.5, -.5, .5], sum of squares 1  -> std0 = sqrt(1/4) = 0.5,
#                                                                                  std1 = sqrt(1/3)
#   B = [2, 2, 2, 2]  constant                                                   -> advantages exactly 0
#   C = [0, 0, 0, 4]  mean 1,   centred [-1, -1, -1, 3],  sum of squares 12       -> std0 = sqrt(3), std1 = 2
# The whole batch: sum 14, mean 7/6, sum of squares 34, squared deviations 34 - 12 (7/6)^2 = 53/3
#   -> batch std0 = sqrt(53/36), batch std1 = sqrt(53/33)
REWARDS = [1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0, 0.0, 0.0, 0.0, 4.0]
CENTRED = [0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0, -1.0, -1.0, -1.0, 3.0]


def _expected(scale: str, ddof: int, eps: float) -> list[float]:
    if scale == "none":
        return CENTRED
    if scale == "group":
        stds = {0: [0.5, 0.0, math.sqrt(3.0)], 1: [math.sqrt(1 / 3), 0.0, 2.0]}[ddof]
        # the constant group B is 0 whatever its std (0 / (0 + eps), and 0 by definition when eps = 0)
        return [0.0 if c == 0.0 else c / (stds[i // 4] + eps) for i, c in enumerate(CENTRED)]
    std = {0: math.sqrt(53 / 36), 1: math.sqrt(53 / 33)}[ddof]
    return [c / (std + eps) for c in CENTRED]


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("ddof", [0, 1])
@pytest.mark.parametrize("eps", [DEFAULT_STD_EPS, 0.0])
def test_group_advantages_by_hand(scale, ddof, eps):
    adv = group_advantages(torch.tensor(REWARDS, dtype=F64), 4, scale=scale, ddof=ddof, eps=eps)
    torch.testing.assert_close(adv, torch.tensor(_expected(scale, ddof, eps), dtype=F64), rtol=1e-12, atol=1e-15)


def test_named_values():
    # a few of the numbers above written out: group, ddof 1, eps 0: A: 0.5/sqrt(1/3) = 0.8660254;
    # C: 3/2 = 1.5 and -1/2; batch, ddof 0: 3 / sqrt(53/36) = 18 / sqrt(53) = 2.4724902
    adv = group_advantages(torch.tensor(REWARDS, dtype=F64), 4, scale="group", ddof=1, eps=0.0)
    assert float(adv[0]) == pytest.approx(0.8660254, abs=1e-7)
    assert float(adv[11]) == 1.5 and float(adv[8]) == -0.5
    adv = group_advantages(torch.tensor(REWARDS, dtype=F64), 4, scale="batch", ddof=0, eps=0.0)
    assert float(adv[11]) == pytest.approx(2.4724902, abs=1e-7)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("value", [0.1, 0.3, 1 / 3, 2.0])
def test_zero_variance_group_gives_exactly_zero(scale, dtype, value):
    # Group 0 is constant (7 x 0.1 has a float32 mean that is not 0.1 itself); group 1 varies.
    rewards = torch.tensor([value] * 7 + [0, 1, 2, 3, 4, 5, 6], dtype=dtype)
    for eps in (DEFAULT_STD_EPS, 0.0):
        adv = group_advantages(rewards, 7, scale=scale, eps=eps)
        assert torch.equal(adv[:7], torch.zeros(7, dtype=dtype))
        assert not torch.isnan(adv).any()
        assert (adv[7:] != 0).sum() == 6  # the middle reward 3 of group 1 is its mean


def test_all_constant_batch_and_group_of_one():
    assert torch.equal(group_advantages(torch.full((6,), 0.7), 3, "batch", eps=0.0), torch.zeros(6))
    # G = 1 with ddof = 1 has no std; the single completion is its own mean -> 0
    assert torch.equal(group_advantages(torch.tensor([1.0, -2.0]), 1, "group", ddof=1), torch.zeros(2))


def test_invalid_inputs_give_clear_errors():
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(torch.zeros(2, 4), 4)
    with pytest.raises(ValueError, match="divisible by group_size=4"):
        group_advantages(torch.zeros(6), 4)
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(torch.zeros(6), 0)
    with pytest.raises(KeyError, match="group, batch, none"):
        group_advantages(torch.zeros(4), 4, scale="std")


# Ragged batch, lengths 4, 2, 1; padded positions hold 100 so any leak shows.
MASK = torch.tensor([[1, 1, 1, 1],
                     [1, 1, 0, 0],
                     [1, 0, 0, 0]])


def test_reward_to_go_on_a_ragged_mask():
    values = torch.tensor([[1.0, 2.0, 3.0, 4.0],
                           [5.0, 6.0, 100.0, 100.0],
                           [7.0, 100.0, 100.0, 100.0]], dtype=F64)
    # row 0: [1+2+3+4, 2+3+4, 3+4, 4] = [10, 9, 7, 4]; row 1: [11, 6, 0, 0]; row 2: [7, 0, 0, 0]
    expected = torch.tensor([[10.0, 9.0, 7.0, 4.0],
                             [11.0, 6.0, 0.0, 0.0],
                             [7.0, 0.0, 0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(reward_to_go(values, MASK), expected, rtol=0, atol=0)


def test_apply_kl_penalty_on_a_ragged_mask():
    adv = torch.tensor([1.0, -0.5, 2.0], dtype=F64)
    kl = torch.tensor([[0.1, -0.2, 0.3, 0.4],
                       [0.5, 0.25, 100.0, 100.0],
                       [-1.0, 100.0, 100.0, 100.0]], dtype=F64, requires_grad=True)
    out = apply_kl_penalty(adv, kl, MASK, coef=0.1)
    # reward-to-go of kl: row 0 [0.6, 0.5, 0.7, 0.4]; row 1 [0.75, 0.25]; row 2 [-1.0]
    # A_it = A_i - 0.1 * rtg: row 0: 1 - [0.06, 0.05, 0.07, 0.04] = [0.94, 0.95, 0.93, 0.96]
    #                         row 1: -0.5 - [0.075, 0.025] = [-0.575, -0.525]; row 2: 2 + 0.1 = 2.1
    expected = torch.tensor([[0.94, 0.95, 0.93, 0.96],
                             [-0.575, -0.525, 0.0, 0.0],
                             [2.1, 0.0, 0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-15)
    # the penalty is a detached reward: no gradient path back to the KL
    assert not out.requires_grad


def test_kl_penalty_enters_after_normalisation():
    # Group rewards [0, 4]: centred [-2, 2], ddof-0 std 2 -> A = [-1, 1] (eps 0). The KL term must not be
    # divided by that std: A_it - A_i = -coef * rtg exactly.
    adv = group_advantages(torch.tensor([0.0, 4.0], dtype=F64), 2, "group", ddof=0, eps=0.0)
    assert adv.tolist() == [-1.0, 1.0]
    kl = torch.tensor([[0.5, 0.5, 0.5], [1.0, 0.0, 2.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    out = apply_kl_penalty(adv, kl, mask, coef=0.5)
    # row 0: rtg [1.0, 0.5] -> -1 - [0.5, 0.25]; row 1: rtg [3, 2, 2] -> 1 - [1.5, 1, 1]
    expected = torch.tensor([[-1.5, -1.25, 0.0], [-0.5, 0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-15)
