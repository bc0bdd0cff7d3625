"""Loss aggregation (klgrpo/math/aggregation.py): hand-computed ragged batch and micro-batch invariance."""

from __future__ import annotations

import pytest
import torch

from klgrpo.math.aggregation import AGGREGATIONS, Normalizer, aggregate, masked_mean, masked_sum

F64 = torch.float64

# Lengths 1, 3, 2; the padded entries are 9 so any leak shows.
VALUES = [[2.0, 9.0, 9.0],
          [1.0, 2.0, 6.0],
          [4.0, 8.0, 9.0]]
MASK = [[1, 0, 0],
        [1, 1, 1],
        [1, 1, 0]]
# Row sums 2, 9, 12 (total 23), row means 2, 3, 6, G = 3, sum n_i = 6, L_max = 3.
CASES = {
    # loss = 23 / 6; d loss / d x_it = 1/6 on every real token
    "token_mean": (23 / 6, [[1 / 6, 0, 0], [1 / 6] * 3, [1 / 6, 1 / 6, 0]]),
    # (2 + 3 + 6) / 3 = 11/3; gradient 1 / (G n_i): 1/3, 1/9, 1/6
    "seq_mean_token_mean": (11 / 3, [[1 / 3, 0, 0], [1 / 9] * 3, [1 / 6, 1 / 6, 0]]),
    # 23 / 3; gradient 1/3
    "seq_mean_token_sum": (23 / 3, [[1 / 3, 0, 0], [1 / 3] * 3, [1 / 3, 1 / 3, 0]]),
    # 23 / (3 * 3) = 23/9; gradient 1/9
    "constant": (23 / 9, [[1 / 9, 0, 0], [1 / 9] * 3, [1 / 9, 1 / 9, 0]]),
}


def test_every_mode_has_a_case():
    assert set(CASES) == set(AGGREGATIONS)


@pytest.mark.parametrize("mode", AGGREGATIONS.names())
def test_hand_computed_ragged_batch(mode):
    loss_expected, grad_expected = CASES[mode]
    x = torch.tensor(VALUES, dtype=F64, requires_grad=True)
    loss = aggregate(x, torch.tensor(MASK), mode)
    assert loss.dim() == 0
    assert float(loss.detach()) == pytest.approx(loss_expected, rel=1e-14)
    loss.backward()
    torch.testing.assert_close(x.grad, torch.tensor(grad_expected, dtype=F64), rtol=1e-14, atol=0)


def test_constant_uses_the_given_max_len():
    # Dr. GRPO divides by a fixed L_max, e.g. the generation limit 4: 23 / (3 * 4) = 23/12
    x = torch.tensor(VALUES, dtype=F64)
    mask = torch.tensor(MASK)
    assert float(aggregate(x, mask, "constant", Normalizer.of(mask, max_len=4))) == pytest.approx(23 / 12, rel=1e-14)


def test_unknown_mode_lists_the_valid_names():
    with pytest.raises(KeyError, match="constant, seq_mean_token_mean, seq_mean_token_sum, token_mean"):
        aggregate(torch.zeros(1, 1), torch.ones(1, 1), "sum")


def test_masked_helpers():
    x = torch.tensor(VALUES, dtype=F64)
    m = torch.tensor(MASK)
    assert float(masked_sum(x, m)) == 23.0
    assert masked_sum(x, m, dim=-1).tolist() == [2.0, 9.0, 12.0]
    assert float(masked_mean(x, m)) == pytest.approx(23 / 6, rel=1e-15)
    assert masked_mean(x, m, dim=-1).tolist() == [2.0, 3.0, 6.0]
    # an empty row has mean 0, not nan
    assert masked_mean(x, torch.zeros_like(m), dim=-1).tolist() == [0.0, 0.0, 0.0]


def _split_and_aggregate(x_BT, mask_BT, mode, bounds):
    """Sum of micro-batch losses, each micro-batch trimmed to its own longest row, with the global counts."""
    norm = Normalizer.of(mask_BT)
    total = torch.zeros((), dtype=x_BT.dtype)
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        m = mask_BT[lo:hi]
        width = max(int(m.sum(-1).max()), 1) if m.numel() else 1
        total = total + aggregate(x_BT[lo:hi, :width], m[:, :width], mode, norm)
    return total


# B = 6, T = 5: lengths 5, 1, 0, 3, 2, 4 (row 2 is empty); right padding as the trainer lays it out.
RAGGED_LENGTHS = [5, 1, 0, 3, 2, 4]


def _ragged_mask():
    return torch.arange(5)[None, :] < torch.tensor(RAGGED_LENGTHS)[:, None]


@pytest.mark.parametrize("mode", AGGREGATIONS.names())
@pytest.mark.parametrize("bounds", [[0, 6], [0, 1, 2, 3, 4, 5, 6], [0, 2, 3, 6], [0, 4, 6]])
def test_micro_batch_invariance_of_loss_and_gradient(mode, bounds):
    g = torch.Generator().manual_seed(7)
    mask = _ragged_mask()
    x_full = torch.randn(6, 5, dtype=F64, generator=g, requires_grad=True)
    full = aggregate(x_full, mask, mode)
    (grad_full,) = torch.autograd.grad(full, x_full)

    x_micro = x_full.detach().clone().requires_grad_(True)
    accumulated = _split_and_aggregate(x_micro, mask, mode, bounds)
    (grad_micro,) = torch.autograd.grad(accumulated, x_micro)

    torch.testing.assert_close(accumulated, full.detach(), rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(grad_micro, grad_full, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("mode", ["token_mean", "constant"])
def test_micro_batches_with_local_counts_are_not_invariant(mode):
    # The check above can fail: averaging micro-batch losses that use their OWN counts is a different number.
    # Split [0, 1) | [1, 6), 15 tokens: token_mean local = (sum row 0 / 5 + sum rest / 10) / 2, not sum / 15;
    # constant local = (sum row 0 / (1 * 5) + sum rest / (5 * 4)) / 2, not sum / (6 * 5).
    g = torch.Generator().manual_seed(7)
    mask = _ragged_mask()
    x = torch.randn(6, 5, dtype=F64, generator=g)
    full = aggregate(x, mask, mode)
    local = (aggregate(x[:1, :5], mask[:1, :5], mode) + aggregate(x[1:, :4], mask[1:, :4], mode)) / 2
    assert abs(float(local - full)) > 1e-3
