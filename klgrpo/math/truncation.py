"""Truncated sampling as the trained policy: each position's kept set, and log-probs renormalised over it.

A sampler with a filter on (top-k, top-p, min-p) draws each token from the truncated distribution

    pi_S(v) = pi(v) 1[v in S_t] / pi(S_t),     S_t = the tokens the filters keep at position t,

so the trainer, to score what was sampled, must score pi_S, not pi (docs/algorithm.md, "Truncated sampling").
Every filter keeps the highest-scoring tokens (top-k: the k largest; top-p: the largest until their mass reaches
top_p; min-p: those with probability >= min_p * the largest), so a kept set is the top n_t tokens by score and
one integer per position describes it: the sampler records n_t (``kept_count``; 0: no filter there, the whole
vocabulary). The trainer rebuilds S_t from its own logits as the n_t tokens it ranks highest, always with the
sampled token in it (a near tie can order the two models' boundary tokens differently: that position is counted
in sampler/kept_set_mismatch, never scored as impossible).
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


def kept_floor(scores: Tensor, targets: Tensor, counts: Tensor) -> tuple[Tensor, Tensor]:
    """(floor, outside) per position: a score is kept where it is >= ``floor``. The floor is the ``counts``-th
    largest of ``scores`` [..., V], lowered to the target's score where the target ranks below (``outside``: True
    there); -inf where the count is WHOLE_VOCABULARY. ``targets`` and ``counts`` [...]."""
    whole = counts <= WHOLE_VOCABULARY
    k = int(counts.max()) if counts.numel() else 0
    floor = torch.full(counts.shape, float("-inf"), dtype=scores.dtype, device=scores.device)
    if k <= 0:
        return floor, torch.zeros_like(whole)
    k = min(k, scores.shape[-1])
    top = torch.topk(scores, k, dim=-1).values
    nth = top.gather(-1, (counts.long().clamp(1, k) - 1).unsqueeze(-1)).squeeze(-1)
    target = scores.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    outside = (target < nth) & ~whole
    floor = torch.where(whole, floor, torch.minimum(nth, target))
    return floor, outside


def mask_below_(scores: Tensor, floor: Tensor) -> Tensor:
    """``scores`` with -inf below each position's floor, in place."""
    return scores.masked_fill_(scores < floor.unsqueeze(-1), float("-inf"))


def log_kept_mass(scores: Tensor, floor: Tensor) -> Tensor:
    """log sum_{v in S_t} softmax(scores)[v] per position: the log of the mass the kept set holds (0 for the
    whole vocabulary)."""
    kept = scores.masked_fill(scores < floor.unsqueeze(-1), float("-inf"))
    return torch.logsumexp(kept, dim=-1) - torch.logsumexp(scores, dim=-1)


def settled_counts(counts: Tensor, completion_mask: Tensor, vocabulary: int) -> Tensor:
    """Kept-set sizes as a batch stores them, int32: WHOLE_VOCABULARY after a row's completion and where the
    filters cut nothing (a set as large as the vocabulary)."""
    return counts.to(torch.int32).masked_fill(~completion_mask | (counts >= vocabulary), WHOLE_VOCABULARY)


def reference_over_kept_set(scores: Tensor, ref_scores: Tensor | None, targets: Tensor,
                            counts: Tensor) -> tuple[Tensor | None, Tensor, Tensor]:
    """(log ref_S(y_t), log pi(S_t), outside) per position: the reference renormalised over the POLICY's kept
    set S_t (the ``counts`` tokens ``scores`` ranks highest, widened to hold the target), the log of the mass the
    policy keeps there, and where the target ranked outside (kept_floor). ``scores`` and ``ref_scores`` are
    logits / temperature [..., V]; ``ref_scores`` None (no reference) gives None in its place."""
    floor, outside = kept_floor(scores, targets, counts)
    dropped = scores < floor.unsqueeze(-1)
    log_mass = torch.logsumexp(scores.masked_fill(dropped, float("-inf")), -1) - torch.logsumexp(scores, -1)
    if ref_scores is None:
        return None, log_mass, outside
    kept_lse = torch.logsumexp(ref_scores.masked_fill(dropped, float("-inf")), -1)
    return ref_scores.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1) - kept_lse, log_mass, outside
