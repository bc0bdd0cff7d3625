"""Per-token log-probabilities of target ids from logits, without a float32 copy of all of [B, T, V].

    logp_t = x_t[y_t] - logsumexp_v x_t[v]          (x = logits / temperature)
    entropy_t = logsumexp(x_t) - sum_v softmax(x_t)[v] x_t[v]

The naive ``log_softmax(logits.float()).gather(...)`` allocates a float32 copy of the whole logit tensor
plus its log-softmax (4x a bf16 tensor) and autograd keeps one for the backward. Here the positions are
processed in blocks (whole rows when they fit, else pieces of a row) of at most ``chunk_tokens`` positions and
a bounded float32 scratch (``_block_budget``: at most a quarter of the logits' bytes and 64 MiB); each block
is upcast once into a fresh buffer that every later step overwrites in place, so the extra memory is about
one block. A custom autograd function keeps
only the logits (already alive for the model's own backward) and one float32 logsumexp per position; the
backward recomputes softmax block by block: d logp_t / d x_t = (onehot(y_t) - softmax(x_t)) / temperature.
The entropy is differentiable too (the entropy bonus, loss.entropy_coef): with p = softmax(x_t / temperature),
d entropy_t / d x_t = -p (log p + entropy_t) / temperature, added in the same block pass only when the entropy
receives a gradient.
Blocks spanning many rows also keep the number of small operations low when the vocabulary is small.
"""

from __future__ import annotations

import torch
from torch import Tensor

from klgrpo.math.truncation import mask_outside_

#: Positions per block at most. Small vocabularies get few, large blocks; large ones are capped below.
DEFAULT_CHUNK_TOKENS = 8192
#: Scratch per block at most: the smaller of MAX_BLOCK_BYTES and a quarter of the logits' own bytes, so the
#: extra memory stays a fraction of the logits whatever their size, but at least MIN_BLOCK_BYTES (a small
#: vocabulary then fits in one block). 64 MiB is 110 positions of a 151,936-token vocabulary in float32.
MAX_BLOCK_BYTES = 64 * 2 ** 20
MIN_BLOCK_BYTES = 2 ** 20


def _block_budget(logits: Tensor) -> int:
    return max(MIN_BLOCK_BYTES, min(MAX_BLOCK_BYTES, logits.numel() * logits.element_size() // 4))


def _blocks(shape: torch.Size, chunk: int, bytes_per_position: int, budget: int):
    """(rows, positions) slice pairs tiling [B, T]: whole rows when a row fits in a block, else pieces of a row;
    each block holds at most ``chunk`` positions and at most ``budget`` bytes of scratch."""
    b, t = shape[0], shape[1]
    size = max(1, min(chunk, budget // max(1, bytes_per_position)))
    if t == 0:
        return
    if size >= t:
        rows = size // t
        for i in range(0, b, rows):
            yield slice(i, i + rows), slice(0, t)
    else:
        for i in range(b):
            for start in range(0, t, size):
                yield slice(i, i + 1), slice(start, start + size)


def _accumulation_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _scaled_copy(block: Tensor, acc: torch.dtype, temperature: float) -> Tensor:
    """A fresh ``acc`` copy of ``block`` / temperature (safe to overwrite in place)."""
    x = block.to(acc, copy=True)
    return x.div_(temperature) if temperature != 1.0 else x


def _logsumexp_(x: Tensor) -> Tensor:
    """logsumexp over the last dim, overwriting ``x`` with exp(x - max); a row of -inf gives -inf."""
    m = x.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    return x.sub_(m).exp_().sum(dim=-1).log_().add_(m.squeeze(-1))


def _kept_copy(block: Tensor, acc: torch.dtype, temperature: float, targets: Tensor,
               counts: Tensor | None) -> Tensor:
    """``_scaled_copy`` with -inf outside each position's kept set (truncated sampling, math.truncation.kept_set)
    when kept-set sizes are given; the forward and the backward rebuild the same set from the same scores."""
    x = _scaled_copy(block, acc, temperature)
    return x if counts is None else mask_outside_(x, targets, counts)


class _TokenLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_BTV: Tensor, targets_BT: Tensor, temperature: float, chunk: int, with_entropy: bool,
                kept_BT: Tensor | None):
        b, t, v = logits_BTV.shape
        acc = _accumulation_dtype(logits_BTV)
        logp_BT = torch.empty(b, t, dtype=acc, device=logits_BTV.device)
        lse_BT = torch.empty_like(logp_BT)
        entropy_BT = torch.empty(b, t, dtype=acc, device=logits_BTV.device) if with_entropy else None
        buffers = 2 if with_entropy else 1  # the entropy needs exp(z) beside z
        budget = _block_budget(logits_BTV)
        for rows, cols in _blocks(logits_BTV.shape, chunk, buffers * v * torch.finfo(acc).bits // 8, budget):
            # the kept set: the sampler's count of top tokens, the sampled one always in
            x = _kept_copy(logits_BTV[rows, cols], acc, temperature, targets_BT[rows, cols],
                           None if kept_BT is None else kept_BT[rows, cols])
            target_x = x.gather(-1, targets_BT[rows, cols, None]).squeeze(-1)
            if with_entropy:
                lse, entropy_BT[rows, cols] = _logsumexp_and_entropy_(x)
            else:
                lse = _logsumexp_(x)
            lse_BT[rows, cols] = lse
            logp_BT[rows, cols] = target_x - lse
            del x  # before the next block's buffer exists: one block of scratch at a time
        ctx.save_for_backward(logits_BTV, targets_BT, lse_BT, kept_BT, *((entropy_BT,) if with_entropy else ()))
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.set_materialize_grads(False)  # an output nobody differentiates (the entropy metric) costs nothing
        if with_entropy:
            return logp_BT, entropy_BT
        return logp_BT

    @staticmethod
    def backward(ctx, grad_BT: Tensor | None, grad_entropy_BT: Tensor | None = None):
        logits_BTV, targets_BT, lse_BT, kept_BT, *entropy = ctx.saved_tensors
        temperature = ctx.temperature
        acc = lse_BT.dtype
        grad_logits = torch.empty(logits_BTV.shape, dtype=logits_BTV.dtype, device=logits_BTV.device)
        v = logits_BTV.shape[-1]
        budget = _block_budget(logits_BTV)
        buffers = 1 if grad_entropy_BT is None else 2
        for rows, cols in _blocks(logits_BTV.shape, ctx.chunk, buffers * v * torch.finfo(acc).bits // 8, budget):
            counts = None if kept_BT is None else kept_BT[rows, cols]
            log_p = _kept_copy(logits_BTV[rows, cols], acc, temperature, targets_BT[rows, cols], counts)
            log_p.sub_(lse_BT[rows, cols, None])
            p = log_p.exp() if grad_entropy_BT is not None else log_p.exp_()
            if grad_entropy_BT is not None:  # p (log p + H) per unit of entropy gradient (p = 0 adds 0)
                g_h = (grad_entropy_BT[rows, cols].to(acc) / temperature).unsqueeze(-1)
                log_p.add_(entropy[0][rows, cols, None].to(acc)).mul_(p).mul_(g_h).nan_to_num_(nan=0.0)
            if grad_BT is not None:
                g = (grad_BT[rows, cols].to(acc) / temperature).unsqueeze(-1)
                block = p.mul_(-g).scatter_add_(-1, targets_BT[rows, cols, None], g)  # g * (onehot - softmax)
                if grad_entropy_BT is not None:
                    block.sub_(log_p)
            else:
                block = log_p.neg_()
            grad_logits[rows, cols] = block
            del log_p, p, block
        return grad_logits, None, None, None, None, None


def _logsumexp_and_entropy_(x: Tensor) -> tuple[Tensor, Tensor]:
    """(logsumexp, float32 entropy of softmax(x)) over the last dim, overwriting ``x``.

    H = log Z - sum_v e_v z_v / Z with z = x - max, e = exp(z), Z = sum e; a -inf logit (p = 0) adds 0."""
    m = x.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    z = x.sub_(m)
    e = torch.exp(z)
    total = e.sum(dim=-1)
    weighted = e.mul_(z.clamp_(min=torch.finfo(z.dtype).min)).sum(dim=-1)  # 0 * (-inf) would be nan
    log_total = total.log()
    return log_total + m.squeeze(-1), log_total - weighted / total


def token_logprobs(logits_BTV: Tensor, targets_BT: Tensor, temperature: float = 1.0,
                   chunk_tokens: int = DEFAULT_CHUNK_TOKENS, kept_BT: Tensor | None = None) -> Tensor:
    """log softmax(logits / temperature)[target] per position [B, T]; differentiable in the logits.

    Accumulates in float32 (float64 for float64 logits) whatever the logits' dtype (bf16 included).

    ``logits_BTV`` may be a slice of the model output (e.g. ``logits[:, P-1:-1]``); it is never copied whole.
    ``kept_BT`` (truncated sampling, klgrpo.math.truncation): each position's kept-set size (0: the whole
    vocabulary); the softmax is then over that kept set, the distribution the sampler drew from.
    """
    return _TokenLogProbs.apply(logits_BTV, targets_BT.long(), float(temperature), int(chunk_tokens), False,
                                kept_BT)


def token_logprobs_and_entropy(logits_BTV: Tensor, targets_BT: Tensor, temperature: float = 1.0,
                               chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                               kept_BT: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(token_logprobs(...), token_entropy(...)) from one pass over the logits: each block is upcast once
    instead of twice. Both are differentiable in the logits (module docstring); the entropy is in float32
    (float64 for float64 logits); under ``kept_BT`` both are the kept set's distribution's."""
    return _TokenLogProbs.apply(logits_BTV, targets_BT.long(), float(temperature), int(chunk_tokens), True,
                                kept_BT)


@torch.no_grad()
def token_entropy(logits_BTV: Tensor, temperature: float = 1.0, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> Tensor:
    """Entropy of softmax(logits / temperature) per position, float32 [B, T] (no gradient: a metric)."""
    out = torch.empty(logits_BTV.shape[:2], dtype=torch.float32, device=logits_BTV.device)
    budget = _block_budget(logits_BTV)
    for rows, cols in _blocks(logits_BTV.shape, chunk_tokens, 2 * 4 * logits_BTV.shape[-1], budget):
        x = _scaled_copy(logits_BTV[rows, cols], torch.float32, temperature)
        out[rows, cols] = _logsumexp_and_entropy_(x)[1].float()
        del x
    return out
