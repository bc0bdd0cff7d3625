"""Per-token log-probabilities of target ids from logits, without a float32 copy of all of [B, T, V].

    logp_t = x_t[y_t] - logsumexp_v x_t[v]          (x = logits / temperature)
    entropy_t = logsumexp(x_t) - sum_v softmax(x_t)[v] x_t[v]

The naive ``log_softmax(logits.float()).gather(...)`` allocates a float32 copy of the whole logit tensor
(4x a bf16 tensor with its intermediates) and autograd keeps it for the backward. Here the rows are processed
in chunks of ``chunk_tokens`` positions, each upcast to float32 on its own, and a custom autograd function
keeps only the logits (already alive for the model's own backward) and one float32 logsumexp per position;
the backward recomputes softmax chunk by chunk: d logp_t / d x_t = onehot(y_t) - softmax(x_t).
"""

from __future__ import annotations

import torch
from torch import Tensor

#: Positions per chunk (within one row): 256 x 151,936 vocabulary x 4 bytes = 0.16 GB of float32 scratch.
DEFAULT_CHUNK_TOKENS = 256


def _row_chunks(shape: torch.Size, chunk: int):
    """(row, slice) pairs covering [B, T] with at most ``chunk`` positions each; each block is contiguous in V."""
    b, t = shape[0], shape[1]
    step = max(1, chunk)
    for i in range(b):
        for start in range(0, t, step):
            yield i, slice(start, start + step)


def _accumulation_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


class _TokenLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_BTV: Tensor, targets_BT: Tensor, temperature: float, chunk: int) -> Tensor:
        b, t, _ = logits_BTV.shape
        acc = _accumulation_dtype(logits_BTV)
        logp_BT = torch.empty(b, t, dtype=acc, device=logits_BTV.device)
        lse_BT = torch.empty_like(logp_BT)
        for i, sl in _row_chunks(logits_BTV.shape, chunk):
            x = logits_BTV[i, sl].to(acc)
            if temperature != 1.0:
                x = x / temperature
            lse = torch.logsumexp(x, dim=-1)
            lse_BT[i, sl] = lse
            logp_BT[i, sl] = x.gather(-1, targets_BT[i, sl, None]).squeeze(-1) - lse
        ctx.save_for_backward(logits_BTV, targets_BT, lse_BT)
        ctx.temperature, ctx.chunk = temperature, chunk
        return logp_BT

    @staticmethod
    def backward(ctx, grad_BT: Tensor):
        logits_BTV, targets_BT, lse_BT = ctx.saved_tensors
        temperature = ctx.temperature
        grad_logits = torch.empty(logits_BTV.shape, dtype=logits_BTV.dtype, device=logits_BTV.device)
        for i, sl in _row_chunks(logits_BTV.shape, ctx.chunk):
            g = grad_BT[i, sl].to(lse_BT.dtype).unsqueeze(-1) / temperature
            x = logits_BTV[i, sl].to(lse_BT.dtype)
            if temperature != 1.0:
                x = x / temperature
            block = torch.exp(x - lse_BT[i, sl, None]).mul_(-g)
            block.scatter_add_(-1, targets_BT[i, sl, None], g)
            grad_logits[i, sl] = block.to(grad_logits.dtype)
        return grad_logits, None, None, None


def token_logprobs(
    logits_BTV: Tensor,
    targets_BT: Tensor,
    temperature: float = 1.0,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> Tensor:
    """log softmax(logits / temperature)[target] per position [B, T]; differentiable in the logits.

    Accumulates in float32 (float64 for float64 logits) whatever the logits' dtype (bf16 included).

    ``logits_BTV`` may be a slice of the model output (e.g. ``logits[:, P-1:-1]``); it is never copied whole.
    """
    return _TokenLogProbs.apply(logits_BTV, targets_BT.long(), float(temperature), int(chunk_tokens))


@torch.no_grad()
def token_entropy(logits_BTV: Tensor, temperature: float = 1.0, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> Tensor:
    """Entropy of softmax(logits / temperature) per position, float32 [B, T] (no gradient: a metric)."""
    out = torch.empty(logits_BTV.shape[:2], dtype=torch.float32, device=logits_BTV.device)
    for i, sl in _row_chunks(logits_BTV.shape, chunk_tokens):
        x = logits_BTV[i, sl].float() / temperature
        lse = torch.logsumexp(x, dim=-1)
        p = torch.softmax(x, dim=-1)
        # 0 * (-inf) is nan: a masked-out vocabulary entry (logit -inf, p = 0) contributes 0 to the entropy.
        out[i, sl] = lse - torch.where(p > 0, p * x, torch.zeros_like(p)).sum(-1)
    return out
