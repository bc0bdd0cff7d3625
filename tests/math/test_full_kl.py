"""The chunked exact full-vocabulary KL against a naive float64 autograd reference (full log_softmax)."""

from __future__ import annotations

import pytest
import torch

from klgrpo.math.full_kl import token_logprobs_and_full_kl
from klgrpo.math.kl import exact_kl


def _problem(seed: int, b=3, t=5, v=11, h=4, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    logits = (2 * torch.randn(b, t, v, generator=gen, dtype=torch.float64)).to(dtype)
    hidden = torch.randn(b, t, h, generator=gen, dtype=torch.float64).to(dtype)
    head = torch.nn.Linear(h, v, bias=True).to(torch.float64)
    with torch.no_grad():
        head.weight.copy_(torch.randn(v, h, generator=gen, dtype=torch.float64))
        head.bias.copy_(torch.randn(v, generator=gen, dtype=torch.float64))
    head = head.to(dtype).requires_grad_(False)
    targets = torch.randint(0, v, (b, t), generator=gen)
    return logits, hidden, head, targets


def _naive(logits, hidden, head, targets, temperature):
    """float64, everything materialised: log_softmax, the KL sum and autograd's own backward."""
    a = torch.log_softmax(logits.double() / temperature, -1)
    r = torch.log_softmax(head(hidden).double() / temperature, -1)
    kl = (a.exp() * (a - r)).sum(-1)
    logp = a.gather(-1, targets[..., None]).squeeze(-1)
    return logp, kl, r.gather(-1, targets[..., None]).squeeze(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
@pytest.mark.parametrize("chunk", [1, 3, 8192])
def test_value_and_gradient_match_naive_float64(temperature, chunk):
    logits, hidden, head, targets = _problem(seed=int(temperature * 10) + chunk)
    mask = torch.rand(targets.shape, generator=torch.Generator().manual_seed(1)) > 0.3
    gen = torch.Generator().manual_seed(2)
    c_logp, c_kl = torch.randn(targets.shape, generator=gen, dtype=torch.float64), torch.rand(targets.shape,
                                                                                            generator=gen,
                                                                                            dtype=torch.float64)

    x = logits.clone().requires_grad_(True)
    logp, kl, entropy, ref_logp = token_logprobs_and_full_kl(x, targets, hidden, head, temperature, chunk)
    ((c_logp * logp + c_kl * kl) * mask).sum().backward()

    y = logits.clone().requires_grad_(True)
    n_logp, n_kl, n_ref = _naive(y, hidden, head, targets, temperature)
    ((c_logp * n_logp + c_kl * n_kl) * mask).sum().backward()

    torch.testing.assert_close(logp, n_logp, rtol=0, atol=1e-12)
    torch.testing.assert_close(kl, n_kl, rtol=0, atol=1e-12)
    torch.testing.assert_close(ref_logp, n_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(kl, exact_kl(logits / temperature, head(hidden) / temperature), rtol=0, atol=1e-12)
    torch.testing.assert_close(x.grad, y.grad, rtol=0, atol=1e-12)
    a = torch.log_softmax(logits / temperature, -1)
    torch.testing.assert_close(entropy, -(a.exp() * a).sum(-1).float(), rtol=0, atol=1e-5)
    assert x.grad[~mask].abs().max() == 0  # masked positions get nothing


def test_gradient_of_the_kl_alone_is_the_exact_reverse_kl_gradient():
    """d KL_t / d x_t = p ((a - r) - KL) / T: the hand formula, checked separately from autograd."""
    logits, hidden, head, targets = _problem(seed=5, b=1, t=2, v=7)
    x = logits.clone().requires_grad_(True)
    _, kl, _, _ = token_logprobs_and_full_kl(x, targets, hidden, head, temperature=0.5)
    kl.sum().backward()
    a = torch.log_softmax(logits / 0.5, -1)
    r = torch.log_softmax(head(hidden) / 0.5, -1)
    want = a.exp() * ((a - r) - kl.detach()[..., None]) / 0.5
    torch.testing.assert_close(x.grad, want, rtol=0, atol=1e-12)


def test_bfloat16_logits_accumulate_in_float32():
    logits, hidden, head, targets = _problem(seed=7, v=64, dtype=torch.bfloat16)
    x = logits.clone().requires_grad_(True)
    logp, kl, _, _ = token_logprobs_and_full_kl(x, targets, hidden, head)
    assert logp.dtype == kl.dtype == torch.float32
    n_logp, n_kl, _ = _naive(logits, hidden, head, targets, 1.0)
    torch.testing.assert_close(kl.double(), n_kl, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logp.double(), n_logp, rtol=1e-5, atol=1e-5)
    kl.sum().backward()
    assert x.grad.dtype == torch.bfloat16 and torch.isfinite(x.grad.float()).all()


def test_kl_is_zero_with_zero_gradient_when_the_reference_equals_the_policy():
    _, hidden, head, targets = _problem(seed=3)
    logits = head(hidden).detach().clone().requires_grad_(True)
    _, kl, _, _ = token_logprobs_and_full_kl(logits, targets, hidden, head)
    kl.sum().backward()
    assert kl.abs().max() < 1e-14 and logits.grad.abs().max() < 1e-14
