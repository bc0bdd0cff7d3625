"""Block tiling of klgrpo/math/logprobs.py (several rows per block, pieces of rows, the byte cap) and the
one-pass token_logprobs_and_entropy, against the naive float64 log-softmax."""

from __future__ import annotations

import pytest
import torch

import klgrpo.math.logprobs as lp
from klgrpo.math.logprobs import _blocks, token_entropy, token_logprobs, token_logprobs_and_entropy

B, T, V = 3, 7, 13


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(B, T, V, generator=g, dtype=torch.float64)
    targets = torch.randint(0, V, (B, T), generator=g)
    return logits, targets


def _naive(logits, targets, temperature):
    logp_all = torch.log_softmax(logits / temperature, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


@pytest.mark.parametrize("chunk,max_bytes", [(1, 2 ** 30), (3, 2 ** 30), (7, 2 ** 30), (14, 2 ** 30), (15, 2 ** 30),
                                             (1000, 2 ** 30), (1000, 3 * V * 8), (1000, 1)])
def test_blocks_tile_every_position_once(chunk, max_bytes):
    seen = torch.zeros(B, T, dtype=torch.long)
    for rows, cols in _blocks(torch.Size([B, T, V]), chunk, V * 8, max_bytes):
        block = seen[rows, cols]
        assert block.numel() <= max(1, min(chunk, max_bytes // (V * 8)))
        seen[rows, cols] += 1
    assert torch.equal(seen, torch.ones_like(seen))


@pytest.mark.parametrize("chunk,max_bytes", [(2, 2 ** 30), (7, 2 ** 30), (15, 2 ** 30), (1000, 2 ** 30),
                                             (1000, 3 * V * 8)])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_one_pass_logprobs_and_entropy_match_naive(chunk, max_bytes, temperature, monkeypatch):
    monkeypatch.setattr(lp, "MIN_BLOCK_BYTES", 1)
    monkeypatch.setattr(lp, "MAX_BLOCK_BYTES", max_bytes)
    logits, targets = _data()
    upstream = torch.randn(B, T, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    x = logits.clone().requires_grad_(True)
    logp, entropy = token_logprobs_and_entropy(x, targets, temperature, chunk_tokens=chunk)
    assert entropy.requires_grad and entropy.dtype == torch.float64  # the bonus differentiates it
    (grad,) = torch.autograd.grad((logp * upstream).sum(), x, retain_graph=True)
    (grad_entropy,) = torch.autograd.grad((entropy * upstream.flip(0)).sum(), x, retain_graph=True)
    (grad_both,) = torch.autograd.grad((logp * upstream).sum() - 0.3 * entropy.sum(), x)

    x_ref = logits.clone().requires_grad_(True)
    logp_ref, entropy_ref = _naive(x_ref, targets, temperature)
    (grad_ref,) = torch.autograd.grad((logp_ref * upstream).sum(), x_ref, retain_graph=True)
    (grad_entropy_ref,) = torch.autograd.grad((entropy_ref * upstream.flip(0)).sum(), x_ref, retain_graph=True)
    (grad_both_ref,) = torch.autograd.grad((logp_ref * upstream).sum() - 0.3 * entropy_ref.sum(), x_ref)
    torch.testing.assert_close(logp, logp_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad, grad_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(entropy, entropy_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad_entropy, grad_entropy_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad_both, grad_both_ref, rtol=0, atol=1e-12)
    assert float(grad_entropy.abs().max()) > 1e-2
    # the same numbers as the two separate functions
    torch.testing.assert_close(logp, token_logprobs(logits, targets, temperature, chunk), rtol=0, atol=0)
    torch.testing.assert_close(entropy.float(), token_entropy(logits, temperature, chunk), rtol=0, atol=2e-6)


def test_one_pass_bf16_like_the_model_output():
    logits, targets = _data(2)
    x = logits.to(torch.bfloat16).requires_grad_(True)
    logp, entropy = token_logprobs_and_entropy(x[:, 1:], targets[:, 1:], 0.9)  # a strided slice, as the trainer
    ref, ref_entropy = _naive(x.detach().double()[:, 1:], targets[:, 1:], 0.9)
    assert logp.dtype == torch.float32
    torch.testing.assert_close(logp.double(), ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy.double(), ref_entropy, rtol=0, atol=1e-5)
    logp.sum().backward()
    assert x.grad.dtype == torch.bfloat16 and torch.equal(x.grad[:, 0], torch.zeros_like(x.grad[:, 0]))


def test_block_budget_is_a_fraction_of_the_logits():
    big = torch.empty(8, 32, 151936, dtype=torch.bfloat16, device="meta")  # 78 MB: a quarter, below the 64 MiB cap
    assert lp._block_budget(big) == big.numel() * 2 // 4
    assert lp._block_budget(torch.empty(2, 3, 4)) == lp.MIN_BLOCK_BYTES
    assert lp._block_budget(torch.empty(64, 288, 151936, dtype=torch.bfloat16, device="meta")) == lp.MAX_BLOCK_BYTES
