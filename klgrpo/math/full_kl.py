"""The exact KL over the vocabulary at every sampled prefix, with its exact gradient, in bounded memory.

    a_t = log softmax(x_t),  r_t = log softmax(x_ref_t)       (x = logits / temperature, per position t)
    KL_t = sum_v exp(a_t[v]) (a_t[v] - r_t[v])                 = KL(pi(.|prefix_t) || pi_ref(.|prefix_t))
    d KL_t / d x_t[v] = p_t[v] ((a_t[v] - r_t[v]) - KL_t) / temperature

``kl.estimator: full`` puts beta * KL_t in the loss instead of a one-sample estimate k(l_t): no variance over
the vocabulary, and its gradient at each prefix is exactly the reverse KL's (docs/kl_guide.md). Under truncated
sampling both sums run over the policy's kept set S_t, a and r renormalised over it: KL(pi_S || ref_S).

Memory: the reference's logits are never materialised whole. The reference hands over the INPUT of its output
layer (``ref_hidden_BTH``, [B, T, H] with H much smaller than V) and that layer (``ref_head``); each block of
positions recomputes its reference logits, in the forward and again in the backward, like the policy side of
:mod:`klgrpo.math.logprobs` recomputes its softmax. Extra memory: the hidden states, three float32 per position
and one block of scratch (at most a quarter of the logits' bytes, 64 MiB at most).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from klgrpo.math.kl import FIRST_EPOCH_SAMPLINGS, SAMPLINGS
from klgrpo.math.logprobs import (
    DEFAULT_CHUNK_TOKENS,
    _accumulation_dtype,
    _block_budget,
    _blocks,
    _kept_copy,
    _logsumexp_and_entropy_,
    _scaled_copy,
)

#: ``kl.estimator`` names served here rather than by the per-token ESTIMATORS registry (whose functions
#: take a sampled log-ratio; this needs both models' whole distributions).
FULL_KL = "full"
FULL_KL_ESTIMATORS = (FULL_KL,)

#: What the expected gradient of beta * w * KL_t (loss placement only) follows, by (level, sampling) as in
#: klgrpo.math.kl's tables; ``klgrpo verify-kl`` checks every entry. Token level (one prefix): KL_t does not
#: depend on the sampled token, so E_q[grad (w KL)] = grad KL for q = pi or mu with w = 1, sg(pi/mu) or pi/mu
#: in the graph (whose extra term KL * E_mu[grad w] = KL * grad sum_y pi(y) is 0): reverse, every sampling.
#: Sequence level: grad E_pi[sum_t KL_t] also has the term E_pi[sum_t KL_t * grad log pi(prefix_t)], which a
#: loss-only term never produces: neither (like k2).
FULL_KL_GRADIENTS = {
    **{("token", sampling): "reverse" for sampling in SAMPLINGS + FIRST_EPOCH_SAMPLINGS},
    **{("sequence", sampling): "neither" for sampling in SAMPLINGS},
}

#: Float buffers of V entries alive per position in a block at most: the policy's x, log-softmax and exp, the
#: reference head's output and its log-softmax.
_BUFFERS = 5


def _ref_log_softmax(ref_head: Callable[[Tensor], Tensor], hidden: Tensor, acc: torch.dtype,
                     temperature: float, kept: Tensor | None = None) -> Tensor:
    """log ref over the vocabulary, or, with ``kept`` (the policy's kept set, bool [..., V]), log ref_S: -inf
    outside the set, renormalised over it."""
    with torch.no_grad():
        r = _scaled_copy(ref_head(hidden), acc, temperature)
    if kept is not None:
        r.masked_fill_(~kept, float("-inf"))
    return r.sub_(torch.logsumexp(r, dim=-1, keepdim=True))


class _FullKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_BTV: Tensor, targets_BT: Tensor, ref_hidden_BTH: Tensor, ref_head, temperature: float,
                chunk: int, kept_BT: Tensor | None):
        b, t, v = logits_BTV.shape
        acc = _accumulation_dtype(logits_BTV)
        out = {name: torch.empty(b, t, dtype=acc, device=logits_BTV.device)
               for name in ("logp", "lse", "kl", "ref_logp")}
        entropy_BT = torch.empty(b, t, dtype=torch.float32, device=logits_BTV.device)
        budget = _block_budget(logits_BTV)
        for rows, cols in _blocks(logits_BTV.shape, chunk, _BUFFERS * v * torch.finfo(acc).bits // 8, budget):
            # both sides over the policy's kept set (docs/algorithm.md, Truncated sampling)
            x = _kept_copy(logits_BTV[rows, cols], acc, temperature, targets_BT[rows, cols],
                           None if kept_BT is None else kept_BT[rows, cols])
            target = targets_BT[rows, cols, None]
            kept = None if kept_BT is None else torch.isfinite(x)
            target_x = x.gather(-1, target).squeeze(-1)
            r = _ref_log_softmax(ref_head, ref_hidden_BTH[rows, cols], acc, temperature, kept)
            a = x.clone()
            lse, entropy_BT[rows, cols] = _logsumexp_and_entropy_(x)
            a.sub_(lse.unsqueeze(-1))
            out["ref_logp"][rows, cols] = r.gather(-1, target).squeeze(-1)
            out["kl"][rows, cols] = _kl_rows_(a, r)
            out["lse"][rows, cols] = lse
            out["logp"][rows, cols] = target_x - lse
            del x, a, r, kept
        ctx.save_for_backward(logits_BTV, targets_BT, ref_hidden_BTH, out["lse"], out["kl"], kept_BT)
        ctx.ref_head, ctx.temperature, ctx.chunk = ref_head, temperature, chunk
        ctx.mark_non_differentiable(entropy_BT, out["ref_logp"])
        return out["logp"], out["kl"], entropy_BT, out["ref_logp"]

    @staticmethod
    def backward(ctx, grad_logp_BT: Tensor, grad_kl_BT: Tensor, *_non_differentiable):
        logits_BTV, targets_BT, ref_hidden_BTH, lse_BT, kl_BT, kept_BT = ctx.saved_tensors
        temperature = ctx.temperature
        acc = lse_BT.dtype
        zeros = torch.zeros_like(lse_BT)
        grad_logp_BT = zeros if grad_logp_BT is None else grad_logp_BT.to(acc)
        grad_kl_BT = zeros if grad_kl_BT is None else grad_kl_BT.to(acc)
        grad_logits = torch.empty(logits_BTV.shape, dtype=logits_BTV.dtype, device=logits_BTV.device)
        v = logits_BTV.shape[-1]
        budget = _block_budget(logits_BTV)
        for rows, cols in _blocks(logits_BTV.shape, ctx.chunk, _BUFFERS * v * torch.finfo(acc).bits // 8, budget):
            counts = None if kept_BT is None else kept_BT[rows, cols]
            a = _kept_copy(logits_BTV[rows, cols], acc, temperature, targets_BT[rows, cols], counts)
            kept = None if counts is None else torch.isfinite(a)
            a.sub_(lse_BT[rows, cols, None])
            r = _ref_log_softmax(ctx.ref_head, ref_hidden_BTH[rows, cols], acc, temperature, kept)
            g_logp = (grad_logp_BT[rows, cols] / temperature).unsqueeze(-1)
            g_kl = (grad_kl_BT[rows, cols] / temperature).unsqueeze(-1)
            # g_kl * p * ((a - r) - KL) - g_logp * p + onehot * g_logp, built in r's buffer
            r.neg_().add_(a).masked_fill_(torch.isneginf(a), 0.0)  # p = 0 there: no gradient, not 0 * inf
            r.sub_(kl_BT[rows, cols, None]).mul_(g_kl).sub_(g_logp).mul_(a.exp_())
            r.scatter_add_(-1, targets_BT[rows, cols, None], g_logp)
            grad_logits[rows, cols] = r
            del a, r, kept
        return grad_logits, None, None, None, None, None, None


def _kl_rows_(a: Tensor, r: Tensor) -> Tensor:
    """sum_v exp(a) (a - r) over the last dim, overwriting both (no new [.., V] float buffer); a
    zero-probability entry adds 0 (even where r = -inf)."""
    diff = r.neg_().add_(a).masked_fill_(torch.isneginf(a), 0.0)
    return a.exp_().mul_(diff).sum(dim=-1)


def token_logprobs_and_full_kl(
    logits_BTV: Tensor,
    targets_BT: Tensor,
    ref_hidden_BTH: Tensor,
    ref_head: Callable[[Tensor], Tensor],
    temperature: float = 1.0,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    kept_BT: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(logp, full_kl, entropy, ref_logp), each [B, T], from one pass over the policy's logits.

    ``logp`` = log softmax(x)[target] and ``full_kl`` = KL_t (module docstring) are differentiable in
    ``logits_BTV``; ``entropy`` (float32) and ``ref_logp`` (the reference's log-prob of the target, computed
    from ``ref_head(ref_hidden_BTH)``: compare it with the reference's own log-probs to catch an output layer
    that is not the whole story, e.g. a logit soft-cap) carry no gradient. ``ref_head`` maps [..., H] to
    [..., V] logits and runs without gradient. Accumulates in float32 (float64 for float64 logits).

    ``kept_BT`` (truncated sampling, klgrpo.math.truncation): each position's kept-set size (0: the whole
    vocabulary). Both distributions are then taken over the policy's kept set S_t: logp = log pi_S(y_t),
    full_kl = KL(pi_S || ref_S), ref_logp = log ref_S(y_t), the entropy pi_S's.
    """
    return _FullKL.apply(logits_BTV, targets_BT.long(), ref_hidden_BTH, ref_head, float(temperature),
                         int(chunk_tokens), kept_BT)
