"""Truncated sampling as the trained policy: each position's kept set, and log-probs renormalised over it.

A sampler with a filter on (top-k, top-p, min-p) draws each token from the truncated distribution

    pi_S(v) = pi(v) 1[v in S_t] / pi(S_t),     S_t = the tokens the filters keep at position t,

so the trainer, to score what was sampled, must score pi_S, not pi (docs/algorithm.md, "Truncated sampling").
Every filter keeps the highest-scoring tokens (top-k: the k largest; top-p: the largest until their mass reaches
top_p; min-p: those with probability >= min_p * the largest), so a kept set is the top n_t tokens by score and
one integer per position describes it: the sampler records n_t (``kept_count``; 0: no filter there, the whole
vocabulary). The trainer rebuilds S_t from its own logits as the n_t tokens it ranks highest, always with the
sampled token in it: a near tie can order the two models' boundary tokens differently, and where the sampled
token ranks just outside the trainer's top n_t, the set is the top n_t - 1 and that token, the sampler's own set
when the two swapped (counted in sampler/kept_set_mismatch, never scored as impossible).
"""

from __future__ import annotations

import torch
from torch import Tensor

#: rollout.truncation's values: train the truncated distribution drawn from, or score the whole softmax
TRUNCATIONS = ("policy", "ignore")
#: a kept count that means "no filter at this position": the whole vocabulary
WHOLE_VOCABULARY = 0


def truncate_scores(scores: Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                    min_p_first: bool = False) -> Tensor:
    """``scores`` (logits / temperature, float) with -inf outside the kept set, the filters applied as
    transformers' TopKLogitsWarper, TopPLogitsWarper and MinPLogitsWarper apply them, in that order, or with min-p
    first (``min_p_first``: vLLM's order; min-p and top-k commute, top-p does not): top-k keeps the scores >= the
    k-th largest (ties kept); top-p drops the smallest tokens whose cumulative probability is <= 1 - top_p and
    always keeps the most likely one; min-p drops the tokens whose probability is < min_p * the largest."""
    if min_p > 0.0 and min_p_first:
        scores = _min_p(scores, min_p)
    if 0 < top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1)
        drop = sorted_scores.softmax(dim=-1).cumsum(dim=-1) <= 1.0 - top_p
        drop[..., -1] = False
        scores = scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    if min_p > 0.0 and not min_p_first:
        scores = _min_p(scores, min_p)
    return scores


def _min_p(scores: Tensor, min_p: float) -> Tensor:
    """-inf where p < min_p * max p, i.e. score < max score + log(min_p) (the largest always stays)."""
    probs = scores.softmax(dim=-1)
    return scores.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))


def kept_counts(filtered_scores: Tensor) -> Tensor:
    """n_t, the size of each position's kept set, from scores with -inf outside it: int32 [...]."""
    return torch.isfinite(filtered_scores).sum(dim=-1, dtype=torch.int32)


def kept_set(scores: Tensor, targets: Tensor, counts: Tensor) -> tuple[Tensor, Tensor]:
    """(kept, outside): each position's kept set as a bool mask [..., V], and where the target ranked outside it.

    The set is the ``counts`` tokens ``scores`` [..., V] ranks highest (exactly that many: of tokens tied at the
    boundary, torch.topk's choice; the tied ones hold the same mass, so which one does not change a log-prob).
    Where the target is not among them (``outside``: a near tie the two models ordered differently), the set is
    the top counts - 1 and the target, so it keeps its size: the sampler's own set when the two boundary tokens
    swapped. The whole vocabulary where the count is WHOLE_VOCABULARY. ``targets`` and ``counts`` [...]."""
    whole = counts <= WHOLE_VOCABULARY
    k = min(int(counts.max()) if counts.numel() else 0, scores.shape[-1])
    if k <= 0:
        return torch.ones(scores.shape, dtype=torch.bool, device=scores.device), torch.zeros_like(whole)
    top = torch.topk(scores, k, dim=-1).indices
    n = counts.long().clamp(1, k).unsqueeze(-1)
    rank = torch.arange(k, device=scores.device)
    index = targets.long().unsqueeze(-1)
    outside = ~((top == index) & (rank < n)).any(-1) & ~whole
    kept = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    kept.scatter_(-1, top, rank < n - outside.long().unsqueeze(-1)).scatter_(-1, index, True)
    return kept | whole.unsqueeze(-1), outside


def mask_outside_(scores: Tensor, targets: Tensor, counts: Tensor) -> Tensor:
    """``scores`` with -inf outside each position's kept set (kept_set), in place."""
    return scores.masked_fill_(~kept_set(scores, targets, counts)[0], float("-inf"))


def settled_counts(counts: Tensor, completion_mask: Tensor, vocabulary: int) -> Tensor:
    """Kept-set sizes as a batch stores them, int32: WHOLE_VOCABULARY after a row's completion and where the
    filters cut nothing (a set as large as the vocabulary)."""
    return counts.to(torch.int32).masked_fill(~completion_mask | (counts >= vocabulary), WHOLE_VOCABULARY)


def reference_over_kept_set(scores: Tensor, ref_scores: Tensor | None, targets: Tensor,
                            counts: Tensor) -> tuple[Tensor | None, Tensor, Tensor]:
    """(log ref_S(y_t), log pi(S_t), outside) per position: the reference renormalised over the POLICY's kept
    set S_t (kept_set), the log of the mass the policy keeps there, and where the target ranked outside it.
    ``scores`` and ``ref_scores`` are logits / temperature [..., V]; ``ref_scores`` None (no reference) gives None
    in its place."""
    kept, outside = kept_set(scores, targets, counts)
    dropped = ~kept
    log_mass = torch.logsumexp(scores.masked_fill(dropped, float("-inf")), -1) - torch.logsumexp(scores, -1)
    if ref_scores is None:
        return None, log_mass, outside
    kept_lse = torch.logsumexp(ref_scores.masked_fill(dropped, float("-inf")), -1)
    return ref_scores.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1) - kept_lse, log_mass, outside
