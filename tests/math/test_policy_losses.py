"""The policy-loss registry (klgrpo/math/policy_loss.py): GSPO and CISPO on a 2 x 3 example, values and
gradients derived by hand; the registry is the config's one source of names."""

from __future__ import annotations

import math

import pytest
import torch

from klgrpo.config.schema import GRPOConfig, all_field_paths
from klgrpo.errors import ConfigError
from klgrpo.math.aggregation import Normalizer, aggregate
from klgrpo.math.policy_loss import POLICY_LOSSES, clipped_surrogate
from klgrpo.math.policy_params import SapoParams, VespoParams

F64 = torch.float64
LN = math.log


def _leaf(ratios):
    """log-probs with old_logp = 0, so the token ratios are the given numbers; a leaf with grad."""
    return torch.log(torch.tensor(ratios, dtype=F64)).requires_grad_(True)


# GSPO example. Row 0: two tokens (the third is padding, ratio 7 must not count), ratios 2 and 0.5:
#   s_0 = exp((ln 2 + ln 0.5) / 2) = 1.        Row 1: ratios 2.2, 0.5, 1.21 (product 1.331 = 1.1^3): s_1 = 1.1.
GSPO_RATIOS = [[2.0, 0.5, 7.0], [2.2, 0.5, 1.21]]
GSPO_MASK = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
GSPO_ADV = torch.tensor([-2.0, 1.0], dtype=F64)


@pytest.mark.parametrize("eps_high, row1_loss, row1_grad, row1_high", [
    # s_1 = 1.1 inside [0.8, 1.2]: loss -A s = -1.1 per token; sequence form d(-A s_1)/d logp_t = -A s_1 / n_1
    (0.2, -1.1, -1.1 / 3, False),
    # eps_high 0.05: s_1 = 1.1 > 1.05 with A > 0: the clipped branch -1.05 is the max, gradient 0
    (0.05, -1.05, 0.0, True),
])
def test_gspo_values_and_gradient_by_hand(eps_high, row1_loss, row1_grad, row1_high):
    logp = _leaf(GSPO_RATIOS)
    out = POLICY_LOSSES["gspo"](logp, torch.zeros(2, 3, dtype=F64), GSPO_ADV, GSPO_MASK, 0.2, eps_high)
    # row 0: s_0 = 1, A = -2: -min(-2, -2) = 2 on every token (padding's value is masked by the aggregation)
    torch.testing.assert_close(out.loss_BT[0, :2], torch.tensor([2.0, 2.0], dtype=F64), rtol=1e-14, atol=0)
    torch.testing.assert_close(out.loss_BT[1], torch.full((3,), row1_loss, dtype=F64), rtol=1e-14, atol=0)
    # ratio_BT stays the per-token ratio (the KL term's importance weight reads it)
    torch.testing.assert_close(out.ratio_BT, torch.tensor(GSPO_RATIOS, dtype=F64), rtol=1e-14, atol=0)
    assert out.clipped_high_BT[1].tolist() == [row1_high] * 3
    assert not out.clipped_low_BT.any()
    # seq_mean_token_mean = GSPO's (1/G) sum_i loss_i; d/d logp_t = (1/G) d(-A_i s_i)/d logp_t = -A s / (n G)
    loss = aggregate(out.loss_BT, GSPO_MASK, "seq_mean_token_mean", Normalizer.of(GSPO_MASK))
    assert float(loss.detach()) == pytest.approx((2.0 + row1_loss) / 2, rel=1e-14)
    loss.backward()
    expected = torch.tensor([[2.0 * 1.0 / 2 / 2, 2.0 / 2 / 2, 0.0], [row1_grad / 2] * 3], dtype=F64)
    torch.testing.assert_close(logp.grad, expected, rtol=1e-13, atol=1e-15)


def test_gspo_token_mean_gradient_by_hand():
    """token_mean over 5 tokens: value (2 + 2 - 3 * 1.1) / 5 = 0.14; d/d logp_t = -A_i s_i / 5 on every token
    (the sequence form: n_i copies of -A_i s_i, each with gradient -A_i s_i / n_i)."""
    logp = _leaf(GSPO_RATIOS)
    out = POLICY_LOSSES["gspo"](logp, torch.zeros(2, 3, dtype=F64), GSPO_ADV, GSPO_MASK, 0.2, 0.2)
    loss = aggregate(out.loss_BT, GSPO_MASK, "token_mean", Normalizer.of(GSPO_MASK))
    assert float(loss.detach()) == pytest.approx(0.14, rel=1e-13)
    loss.backward()
    expected = torch.tensor([[0.4, 0.4, 0.0], [-1.1 / 5] * 3], dtype=F64)
    torch.testing.assert_close(logp.grad, expected, rtol=1e-13, atol=1e-15)


def test_gspo_equals_ppo_clip_on_one_token_sequences():
    """With one token per sequence the sequence ratio is the token ratio: GSPO = PPO clip, values and grads."""
    ratios = [[0.5], [0.9], [1.3]]
    adv = torch.tensor([-1.0, 2.0, 1.0], dtype=F64)
    a, b = _leaf(ratios), _leaf(ratios)
    mask = torch.ones(3, 1, dtype=torch.bool)
    gspo = POLICY_LOSSES["gspo"](a, torch.zeros(3, 1, dtype=F64), adv, mask, 0.2, 0.2)
    ppo = clipped_surrogate(b, torch.zeros(3, 1, dtype=F64), adv, 0.2, 0.2)
    torch.testing.assert_close(gspo.loss_BT, ppo.loss_BT, rtol=1e-14, atol=0)
    gspo.loss_BT.sum().backward()
    ppo.loss_BT.sum().backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-14, atol=0)


# CISPO example: ratios row 0 [0.5, 1.0, 1.5] with A = +1, row 1 [0.7, 1.1, 2.0] with A = -1, clip [0.8, 1.2].
CISPO_RATIOS = [[0.5, 1.0, 1.5], [0.7, 1.1, 2.0]]
CISPO_ADV = torch.tensor([1.0, -1.0], dtype=F64)


def test_cispo_values_and_gradient_by_hand():
    logp = _leaf(CISPO_RATIOS)
    mask = torch.ones(2, 3, dtype=torch.bool)
    out = POLICY_LOSSES["cispo"](logp, torch.zeros(2, 3, dtype=F64), CISPO_ADV, mask, 0.2, 0.2)
    # weights sg(clip(r)): row 0 [0.8, 1.0, 1.2], row 1 [0.8, 1.1, 1.2]; loss = -w A log pi (log pi = ln r here)
    expected = [[-0.8 * LN(0.5), 0.0, -1.2 * LN(1.5)],
                [0.8 * LN(0.7), 1.1 * LN(1.1), 1.2 * LN(2.0)]]
    torch.testing.assert_close(out.loss_BT, torch.tensor(expected, dtype=F64), rtol=1e-14, atol=1e-16)
    # d loss_t / d log pi_t = -w A: clipped tokens keep their gradient (PPO's would be 0 at r = 1.5, A > 0 and
    # at r = 0.7, A < 0)
    out.loss_BT.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.8, -1.0, -1.2], [0.8, 1.1, 1.2]], dtype=F64),
                               rtol=1e-14, atol=0)
    assert out.clipped_low_BT.tolist() == [[True, False, False], [True, False, False]]
    assert out.clipped_high_BT.tolist() == [[False, False, True], [False, False, True]]
    ppo = clipped_surrogate(_leaf(CISPO_RATIOS), torch.zeros(2, 3, dtype=F64), CISPO_ADV, 0.2, 0.2)
    assert ppo.loss_BT.grad_fn is not None  # the contrast: PPO's gradient at those two tokens is 0
    (g,) = torch.autograd.grad(ppo.loss_BT.sum(), ppo.ratio_BT)
    assert g[0, 2] == 0 and g[1, 0] == 0


def test_registry_names_are_the_config_choices():
    choices = next(f for p, f in all_field_paths() if p == "loss.policy_loss").metadata["choices"]
    assert POLICY_LOSSES.names() == list(choices) == ["ppo_clip", "gspo", "cispo", "sapo", "vespo"]
    assert GRPOConfig().loss.policy_loss == "ppo_clip"
    for name in POLICY_LOSSES:
        assert GRPOConfig.from_dict({"loss": {"policy_loss": name}}).loss.policy_loss == name
    with pytest.raises(ConfigError, match="loss.policy_loss .* choose one of: ppo_clip, gspo, cispo"):
        GRPOConfig.from_dict({"loss": {"policy_loss": "grpo"}})


def test_ppo_clip_entry_is_the_clipped_surrogate():
    ratios = [[0.5, 1.0, 1.5], [0.7, 1.1, 2.0]]
    a = POLICY_LOSSES["ppo_clip"](_leaf(ratios), torch.zeros(2, 3, dtype=F64), CISPO_ADV,
                                  torch.ones(2, 3, dtype=torch.bool), 0.2, 0.28)
    b = clipped_surrogate(_leaf(ratios), torch.zeros(2, 3, dtype=F64), CISPO_ADV, 0.2, 0.28)
    torch.testing.assert_close(a.loss_BT, b.loss_BT, rtol=0, atol=0)


def test_sapo_values_and_gradient_by_hand():
    # row 0: rho 1 and A = +1 (tau_pos 1): loss -(4/1) sigmoid(0) = -2, gradient -(4/tau) sigma'(0) tau rho A = -1,
    # PPO's -A at rho = 1. Row 1: rho 2 and A = -1 (tau_neg 2): loss -(4/2) sigmoid(2) (-1) = 2 sigmoid(2),
    # gradient -4 sigma'(2) * 2 * (-1) = 8 s (1 - s), s = sigmoid(2).
    logp = _leaf([[1.0], [2.0]])
    out = POLICY_LOSSES["sapo"](logp, torch.zeros(2, 1, dtype=F64), torch.tensor([1.0, -1.0], dtype=F64),
                                torch.ones(2, 1), params=SapoParams(temperature_pos=1.0, temperature_neg=2.0))
    s = 1 / (1 + math.exp(-2))
    torch.testing.assert_close(out.loss_BT, torch.tensor([[-2.0], [2 * s]], dtype=F64), rtol=0, atol=1e-7)
    (grad,) = torch.autograd.grad(out.loss_BT.sum(), logp)
    torch.testing.assert_close(grad, torch.tensor([[-1.0], [8 * s * (1 - s)]], dtype=F64), rtol=0, atol=1e-7)
    assert not out.clipped_low_BT.any() and not out.clipped_high_BT.any()


def test_vespo_values_and_gradient_by_hand():
    # row 0: token ratios 2 and 1 (padding 9 ignored): w = 2, A = +1, k 2, lambda 3: phi = e^3 * 2^2 * e^-6 = 4 e^-3;
    # loss_t = -phi A log pi_t, gradient -phi per token. Row 1: ratios 1: w = 1, phi(1) = 1 whatever k and lambda,
    # A = -1: gradient +1.
    logp = _leaf([[2.0, 1.0, 9.0], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    out = POLICY_LOSSES["vespo"](logp, torch.zeros(2, 3, dtype=F64), torch.tensor([1.0, -1.0], dtype=F64), mask,
                                 params=VespoParams(k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0))
    phi = 4 * math.exp(-3)
    (grad,) = torch.autograd.grad((out.loss_BT * mask).sum(), logp)
    expected = torch.tensor([[-phi, -phi, 0.0], [1.0, 1.0, 1.0]], dtype=F64)
    torch.testing.assert_close(grad, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(out.loss_BT[0, :2], -phi * torch.log(torch.tensor([2.0, 1.0], dtype=F64)))
