"""Property tests (hypothesis) for facts that hold for every input, not just the hand-picked ones."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from klgrpo.math.advantages import ADVANTAGE_SCALES, group_advantages
from klgrpo.math.aggregation import AGGREGATIONS, Normalizer, aggregate
from klgrpo.math.kl import exact_kl, kl_estimate

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True)

log_probs = st.lists(st.floats(-60.0, 0.0, allow_nan=False), min_size=1, max_size=16)


@SETTINGS
@given(data=st.data(), estimator=st.sampled_from(["k2", "k3"]), dtype=st.sampled_from([torch.float32, torch.float64]))
def test_k2_k3_are_nonnegative(data, estimator, dtype):
    # k2 = l^2/2 >= 0; k3 = e^{-l} + l - 1 >= 0 since e^x >= 1 + x (the default clamp keeps it finite)
    logp = data.draw(log_probs)
    ref = data.draw(st.lists(st.floats(-60.0, 0.0, allow_nan=False), min_size=len(logp), max_size=len(logp)))
    k = kl_estimate(torch.tensor(logp, dtype=dtype), torch.tensor(ref, dtype=dtype), estimator)
    assert torch.isfinite(k).all()
    assert (k >= 0).all()


@SETTINGS
@given(data=st.data(), v=st.integers(2, 8), dtype=st.sampled_from([torch.float32, torch.float64]))
def test_exact_kl_is_nonnegative(data, v, dtype):
    row = st.lists(st.floats(-50.0, 50.0, allow_nan=False), min_size=v, max_size=v)
    logits = torch.tensor([data.draw(row), data.draw(row)], dtype=dtype)
    ref = torch.tensor([data.draw(row), data.draw(row)], dtype=dtype)
    kl = exact_kl(logits, ref)
    assert kl.shape == (2,)
    assert torch.isfinite(kl).all()
    assert (kl >= -1e-6).all()
    # and KL(p || p) = 0 up to rounding
    assert exact_kl(logits, logits).abs().max() <= 1e-6


# Rewards on a 1/4 grid in [-10, 10]: any non-constant group then has std >= 0.25 / sqrt(8) / 2, so the
# division cannot amplify the rounding of the mean beyond the tolerance.
rewards_grid = st.integers(-40, 40).map(lambda k: k / 4)


@SETTINGS
@given(group_size=st.integers(1, 6), num_groups=st.integers(1, 4), data=st.data(),
       scale=st.sampled_from(ADVANTAGE_SCALES), ddof=st.sampled_from([0, 1]))
def test_advantages_sum_to_zero_within_each_group(group_size, num_groups, data, scale, ddof):
    rewards = data.draw(st.lists(rewards_grid, min_size=group_size * num_groups,
                                 max_size=group_size * num_groups))
    adv = group_advantages(torch.tensor(rewards, dtype=torch.float64), group_size, scale=scale, ddof=ddof)
    sums = adv.reshape(num_groups, group_size).sum(dim=1)
    assert sums.abs().max() <= 1e-9
    # and an all-equal group is exactly 0
    for g in range(num_groups):
        chunk = rewards[g * group_size:(g + 1) * group_size]
        if len(set(chunk)) == 1:
            assert (adv[g * group_size:(g + 1) * group_size] == 0).all()


@SETTINGS
@given(data=st.data(), mode=st.sampled_from(AGGREGATIONS.names()), b=st.integers(1, 6), t=st.integers(1, 6),
       seed=st.integers(0, 2 ** 16))
def test_aggregation_micro_batch_invariance(data, mode, b, t, seed):
    mask = torch.tensor(data.draw(st.lists(st.lists(st.booleans(), min_size=t, max_size=t),
                                           min_size=b, max_size=b)))
    cuts = sorted(set(data.draw(st.lists(st.integers(1, b - 1), max_size=3)) if b > 1 else []))
    bounds = [0, *cuts, b]
    x = torch.randn(b, t, dtype=torch.float64, generator=torch.Generator().manual_seed(seed), requires_grad=True)

    full = aggregate(x, mask, mode)
    (grad_full,) = torch.autograd.grad(full, x)

    norm = Normalizer.of(mask)
    micro = sum(aggregate(x[lo:hi], mask[lo:hi], mode, norm) for lo, hi in zip(bounds[:-1], bounds[1:]))
    (grad_micro,) = torch.autograd.grad(micro, x)
    torch.testing.assert_close(micro, full, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad_micro, grad_full, rtol=1e-12, atol=1e-14)

