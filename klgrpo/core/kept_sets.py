"""The kept-set pass of truncated sampling (``rollout.truncation policy``): once per generated batch, without
gradient, the policy at the weights that drew the batch and the reference side by side.

For every completion position it settles the kept set S_t the token was drawn from (the sampler's recorded
size, or, for a sampler that records none, the size the filters keep on the policy's logits) and computes what
the step needs besides the update's own forward:

    ref_logp        log ref_S(y_t) = log ref(y_t) - log ref(S_t): the reference renormalised over the SAME token
                    set (the policy's kept set, not the reference's own), so every KL estimator estimates
                    KL(pi_S || ref_S) with the value and gradient properties it declares
    log_kept_mass   log pi(S_t), the mass the filters kept (sampler/kept_mass)
    mismatch        the positions where the trainer's set is not the sampler's: the filters on the trainer's
                    logits keep another count than the sampler recorded, or the sampled token ranks outside it
                    (sampler/kept_set_mismatch)

Cost: one forward of the policy without gradient per batch; the reference's forward replaces the one it runs
anyway. See docs/algorithm.md, "Truncated sampling".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from klgrpo.core.forward import position_ids_from_mask
from klgrpo.core.rollout import RolloutBatch
from klgrpo.math.truncation import kept_counts, reference_over_kept_set, settled_counts, truncate_scores


@dataclass
class KeptSets:
    """What the kept-set pass found for a batch, each [B, T] (0 / False after a row's completion)."""

    kept_count: Tensor     # int32, the set sizes the update scores with (0: the whole vocabulary)
    ref_logp: Tensor       # float32, log ref_S(y_t) (0 without a reference)
    log_kept_mass: Tensor  # float32, log pi(S_t) under the policy that drew the batch
    mismatch: Tensor       # bool

    def rows(self, sl: slice) -> "KeptSets":
        return KeptSets(self.kept_count[sl], self.ref_logp[sl], self.log_kept_mass[sl], self.mismatch[sl])


@torch.no_grad()
def kept_set_pass(policy, reference, batch: RolloutBatch, slices: list[slice]) -> KeptSets:
    """The batch's kept sets (module docstring), rows ``slices`` at a time (the micro-batches). ``policy`` is the
    forward the update runs (every rank calls this), at the weights that drew ``batch``."""
    filters, t = batch.filters, batch.completion_ids.shape[1]
    parts = []
    for sl in slices:
        ids, mask = batch.input_ids[sl], batch.attention_mask[sl]
        out = policy(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask), use_cache=False,
                     logits_to_keep=t + 1)
        x = out.logits[:, :-1].float() / filters.temperature
        r = None if reference is None else reference.logits(ids, mask, keep=t + 1)[:, :-1].float() / filters.temperature
        completion = batch.completion_mask[sl]
        targets = batch.completion_ids[sl]
        rebuilt = settled_counts(kept_counts(truncate_scores(x, filters.top_k, filters.top_p, filters.min_p,
                                                       filters.min_p_first)), completion, x.shape[-1])
        recorded = None if batch.kept_count is None else batch.kept_count[sl]
        counts = rebuilt if recorded is None else recorded
        ref_logp, log_mass, outside = reference_over_kept_set(x, r, targets, counts)
        if ref_logp is None:  # no reference (a run without KL): nothing to renormalise
            ref_logp = torch.zeros_like(log_mass)
        mismatch = outside if recorded is None else outside | (rebuilt != recorded)
        parts.append(KeptSets(counts.to(torch.int32), ref_logp.masked_fill(~completion, 0.0),
                              log_mass.masked_fill(~completion, 0.0), mismatch & completion))
        del x, r
    return KeptSets(*(torch.cat([getattr(p, name) for p in parts]) for name in
                      ("kept_count", "ref_logp", "log_kept_mass", "mismatch")))

