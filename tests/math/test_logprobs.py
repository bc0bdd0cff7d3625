"""Chunked token log-probs and entropy (klgrpo/math/logprobs.py) against the naive full log-softmax."""

from __future__ import annotations

import pytest
import torch

from klgrpo.math.logprobs import token_entropy, token_logprobs

B, T, V = 2, 5, 11
CHUNKS = [1, 2, 3, 5, 64]  # 1, a divisor-free size, exactly T, larger than T
TEMPERATURES = [1.0, 0.7, 1.3]


def _naive_logp(logits, targets, temperature):
    logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _data(dtype, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    logits = (scale * torch.randn(B, T, V, generator=g, dtype=torch.float64)).to(dtype)
    targets = torch.randint(0, V, (B, T), generator=g)
    return logits, targets


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
def test_values_and_gradient_match_naive(chunk, temperature, dtype, tol):
    logits, targets = _data(dtype)
    upstream = torch.randn(B, T, generator=torch.Generator().manual_seed(1), dtype=dtype)

    x = logits.clone().requires_grad_(True)
    out = token_logprobs(x, targets, temperature=temperature, chunk_tokens=chunk)
    assert out.dtype == dtype and out.shape == (B, T)
    (grad,) = torch.autograd.grad((out * upstream).sum(), x)

    x_ref = logits.clone().requires_grad_(True)
    ref = _naive_logp(x_ref, targets, temperature)
    (grad_ref,) = torch.autograd.grad((ref * upstream).sum(), x_ref)

    torch.testing.assert_close(out, ref, rtol=0, atol=tol)
    torch.testing.assert_close(grad, grad_ref, rtol=0, atol=tol)


def test_hand_computed_value_and_gradient():
    # logits [0, log 2, log 5] -> softmax [1/8, 2/8, 5/8]; target 1: log(1/4); at T = 0.5 the logits double:
    # [0, log 4, log 25] -> softmax [1/30, 4/30, 25/30], log(4/30)
    logits = torch.log(torch.tensor([[[1.0, 2.0, 5.0]]], dtype=torch.float64)).requires_grad_(True)
    target = torch.tensor([[1]])
    assert float(token_logprobs(logits, target).detach()) == pytest.approx(torch.log(torch.tensor(0.25)).item(),
                                                                           rel=1e-7)
    out = token_logprobs(logits, target, temperature=0.5)
    assert float(out.detach()) == pytest.approx(float(torch.log(torch.tensor(4 / 30, dtype=torch.float64))),
                                                rel=1e-14)
    # d logp / d x = (onehot - softmax) / T = ([0, 1, 0] - [1, 4, 25]/30) / 0.5 = [-1/15, 26/15, -25/15]
    out.sum().backward()
    torch.testing.assert_close(logits.grad, torch.tensor([[[-1 / 15, 26 / 15, -25 / 15]]], dtype=torch.float64),
                               rtol=1e-13, atol=0)


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_non_contiguous_slice_of_model_output(chunk):
    # the trainer passes logits[:, P-1:-1] (predictions for the completion tokens): a strided view
    P = 3
    g = torch.Generator().manual_seed(2)
    full = torch.randn(B, P + T, V, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, V, (B, T), generator=g)
    view = full[:, P - 1:-1]
    assert not view.is_contiguous()
    out = token_logprobs(view, targets, temperature=0.9, chunk_tokens=chunk)
    (grad,) = torch.autograd.grad(out.sum(), full)

    full_ref = full.detach().clone().requires_grad_(True)
    ref = _naive_logp(full_ref[:, P - 1:-1], targets, 0.9)
    (grad_ref,) = torch.autograd.grad(ref.sum(), full_ref)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad, grad_ref, rtol=0, atol=1e-12)
    # positions outside the slice get no gradient
    assert torch.equal(grad[:, : P - 1], torch.zeros_like(grad[:, : P - 1]))
    assert torch.equal(grad[:, -1], torch.zeros_like(grad[:, -1]))


@pytest.mark.parametrize("chunk", [1, 4])
def test_bf16_logits(chunk):
    logits, targets = _data(torch.bfloat16)
    x = logits.clone().requires_grad_(True)
    out = token_logprobs(x, targets, temperature=0.8, chunk_tokens=chunk)
    assert out.dtype == torch.float32
    # the float32 computation on the same (bf16-rounded) values
    x_ref = logits.float().requires_grad_(True)
    ref = _naive_logp(x_ref, targets, 0.8)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    out.sum().backward()
    ref.sum().backward()
    assert x.grad.dtype == torch.bfloat16
    # the gradient is rounded to bf16 (8 significant bits): relative 2^-8 plus a small absolute floor
    torch.testing.assert_close(x.grad.float(), x_ref.grad, rtol=2 ** -8, atol=1e-6)


@pytest.mark.parametrize("chunk", [1, 3, 64])
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_entropy_matches_naive(chunk, temperature):
    logits, _ = _data(torch.float32)
    logp = torch.log_softmax(logits / temperature, dim=-1)
    naive = -(logp.exp() * logp).sum(-1)
    out = token_entropy(logits, temperature=temperature, chunk_tokens=chunk)
    assert out.dtype == torch.float32 and not out.requires_grad
    torch.testing.assert_close(out, naive, rtol=0, atol=1e-5)


def test_entropy_by_hand_and_with_masked_vocabulary():
    # uniform over 4: log 4; [1/8, 2/8, 5/8]: -(1/8 log 1/8 + 1/4 log 1/4 + 5/8 log 5/8) = 0.9002561;
    # a -inf logit (masked entry, p = 0) contributes nothing: [0, log 3, -inf] -> [1/4, 3/4]: 0.5623351
    ninf = float("-inf")
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0],
                            [0.0, 0.6931471805599453, 1.6094379124341003, ninf],
                            [0.0, 1.0986122886681098, ninf, ninf]]])
    out = token_entropy(logits, chunk_tokens=2)
    torch.testing.assert_close(out, torch.tensor([[1.3862944, 0.9002561, 0.5623351]]), rtol=0, atol=1e-6)


def _saved_bytes(fn):
    """Storages that autograd keeps for the backward of ``fn()``: {data_ptr: nbytes}, each storage once."""
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return saved


@pytest.mark.parametrize("sliced", [False, True])
def test_saved_for_backward_is_the_logits_plus_O_BT(sliced):
    # bf16 logits [2, 8+1, 1000]: the model output, alive anyway for the model's backward.
    b, t, v = 2, 8, 1000
    full = torch.randn(b, t + 1, v).to(torch.bfloat16).requires_grad_(True)
    logits = full[:, :-1] if sliced else full[:, :t].contiguous()
    targets = torch.randint(0, v, (b, t))
    own = logits.untyped_storage()
    budget = 16 * b * t  # int64 targets (8 B) + float32 logsumexp (4 B) per position, with slack

    saved = _saved_bytes(lambda: token_logprobs(logits, targets, chunk_tokens=3))
    # the logits themselves are kept (not copied): the same storage, which the caller owns already
    assert saved.pop(own.data_ptr()) == own.nbytes()
    assert sum(saved.values()) <= budget

    # the naive path keeps a float32 [B, T, V] tensor: 2 * 8 * 1000 * 4 = 64,000 bytes beyond the logits
    naive = _saved_bytes(lambda: _naive_logp(logits, targets, 1.0))
    naive.pop(own.data_ptr(), None)
    assert sum(naive.values()) >= b * t * v * 4 > budget
