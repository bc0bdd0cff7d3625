"""KL shaping (klgrpo/math/kl_shaping.py) on hand-computed tensors, values and gradients."""

from __future__ import annotations

import math

import pytest
import torch

from klgrpo.math.kl_shaping import SHAPINGS, clip_fraction, shape_kl


def _sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


# Two rows, lengths 3 and 2; the last entry of row 1 is padding.
KL = [[0.5, 2.0, -0.1],
      [3.0, 0.0, 5.0]]
MASK = [[1, 1, 1],
        [1, 1, 0]]

CASES = {
    "none": dict(params={}, expected=KL),
    # min(kl, 1.0) per token
    "clip": dict(params=dict(kl_clip_threshold=1.0),
                 expected=[[0.5, 1.0, -0.1],
                           [1.0, 0.0, 1.0]]),
    # sigmoid(kl - 0.5) * kl per token: sigmoid(0) = 1/2 -> 0.25; sigmoid(1.5) = 0.8175745 -> 1.6351490;
    # sigmoid(-0.6) = 0.3543437 -> -0.0354344; sigmoid(2.5) = 0.9241418 -> 2.7724255; 0; sigmoid(4.5) * 5
    "sigmoid": dict(params=dict(kl_target=0.5),
                    expected=[[0.25, 2.0 * _sig(1.5), -0.1 * _sig(-0.6)],
                              [3.0 * _sig(2.5), 0.0, 5.0 * _sig(4.5)]]),
    # kl / n_i with n = (3, 2): row 0 / 3, row 1 / 2 (padding too; the aggregation masks it)
    "length_normalized": dict(params={},
                              expected=[[0.5 / 3, 2.0 / 3, -0.1 / 3],
                                        [1.5, 0.0, 2.5]]),
}


def test_every_registered_shaping_has_a_case():
    assert set(CASES) == set(SHAPINGS.names())


@pytest.mark.parametrize("name", sorted(SHAPINGS.names()))
def test_shaping_values(name):
    case = CASES[name]
    kl = torch.tensor(KL, dtype=torch.float64)
    out = shape_kl(kl, torch.tensor(MASK), name, **case["params"])
    assert out.shape == kl.shape
    torch.testing.assert_close(out, torch.tensor(case["expected"], dtype=torch.float64), rtol=1e-12, atol=1e-15)
    # the named sigmoid values, as a sanity check of the hand numbers above
    if name == "sigmoid":
        assert float(out[0, 1]) == pytest.approx(1.6351490, abs=1e-7)
        assert float(out[1, 0]) == pytest.approx(2.7724255, abs=1e-7)


def test_unknown_shaping_lists_the_valid_names():
    with pytest.raises(KeyError, match="clip.*length_normalized.*none.*sigmoid"):
        shape_kl(torch.zeros(1, 1), torch.ones(1, 1), "log")


def test_clip_zeroes_the_gradient_above_threshold_and_is_counted():
    kl = torch.tensor(KL, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor(MASK)
    out = shape_kl(kl, mask, "clip", kl_clip_threshold=1.0)
    out.sum().backward()
    # d min(k, 1)/dk = 1 below 1, 0 above (2.0, 3.0 and the padded 5.0)
    torch.testing.assert_close(kl.grad, torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]], dtype=torch.float64),
                               rtol=0, atol=0)
    # masked tokens above 1.0: 2.0 and 3.0 out of 5 masked tokens (the padded 5.0 is not counted) = 0.4
    frac = clip_fraction(kl, mask, 1.0)
    assert float(frac) == pytest.approx(0.4, abs=1e-7)
    assert float(clip_fraction(kl, mask, 10.0)) == 0.0
    # threshold 0.25: 0.5, 2.0, 3.0 fire -> 3/5
    assert float(clip_fraction(kl, mask, 0.25)) == pytest.approx(0.6, abs=1e-7)
    # an empty mask gives 0, not nan
    assert float(clip_fraction(kl, torch.zeros_like(mask), 1.0)) == 0.0


def test_sigmoid_gradient_by_hand():
    # d/dk [s(k - t) k] = s + k s (1 - s), s = sigmoid(k - t); t = 0.5
    kl = torch.tensor(KL, dtype=torch.float64, requires_grad=True)
    shape_kl(kl, torch.tensor(MASK), "sigmoid", kl_target=0.5).sum().backward()
    expected = []
    for row in KL:
        expected.append([_sig(k - 0.5) + k * _sig(k - 0.5) * (1 - _sig(k - 0.5)) for k in row])
    # e.g. k = 0.5: 0.5 + 0.5 * 0.25 = 0.625
    assert expected[0][0] == pytest.approx(0.625, abs=1e-15)
    torch.testing.assert_close(kl.grad, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-15)


def test_length_normalized_divides_by_each_rows_masked_length():
    # ragged mask with a hole and an empty row: lengths 2, 4, 0 (the empty row divides by max(0, 1) = 1)
    kl = torch.tensor([[1.0, 1.0, 1.0, 1.0],
                       [2.0, 4.0, 6.0, 8.0],
                       [3.0, 3.0, 3.0, 3.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 0, 1, 0],
                         [1, 1, 1, 1],
                         [0, 0, 0, 0]], dtype=torch.bool)
    out = shape_kl(kl, mask, "length_normalized")
    torch.testing.assert_close(out, torch.tensor([[0.5, 0.5, 0.5, 0.5],
                                                  [0.5, 1.0, 1.5, 2.0],
                                                  [3.0, 3.0, 3.0, 3.0]], dtype=torch.float64), rtol=0, atol=0)
    # masked row sums: 1/2 + 1/2 = 1 = sequence KL (2) / length (2); row 1: 20 / 4 = 5
    row_sums = (out.detach() * mask).sum(-1)
    assert float(row_sums[0]) == 1.0 and float(row_sums[1]) == 5.0
    out.sum().backward()
    torch.testing.assert_close(kl.grad, torch.tensor([[0.5] * 4, [0.25] * 4, [1.0] * 4], dtype=torch.float64),
                               rtol=0, atol=0)
