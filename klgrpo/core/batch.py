"""A generated batch with everything computed once for it (rewards, advantages, reference log-probs)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from klgrpo.core.kept_sets import KeptSets
from klgrpo.core.rollout import RolloutBatch
from klgrpo.math.aggregation import Normalizer


def micro_slices(n: int, size: int) -> list[slice]:
    """Rows 0..n in slices of ``size`` (0: one slice of all rows): the micro-batches of an update, a reference
    pass or a replay pass."""
    size = size or n
    return [slice(s, min(s + size, n)) for s in range(0, n, size)]

@dataclass
class StepBatch:
    """A generated batch and everything computed once for it, reused for num_iterations updates."""

    rollout: RolloutBatch
    rewards: torch.Tensor            # [B] total reward
    reward_columns: dict[str, torch.Tensor]
    advantages: torch.Tensor         # [B]
    loss_mask: torch.Tensor          # [B, T] completion mask (minus truncated rows when masked)
    normalizer: Normalizer
    ref_logp: torch.Tensor | None    # [B, T]
    old_logp: torch.Tensor | None    # [B, T]; None until the batch's first update (then old = logp.detach())
    # [B, T] the trainer's own log-probs at the sampling weights (its first update's), kept for the sampler panel of
    # later updates; None until then, or with one update per batch
    trainer_old_logp: torch.Tensor | None = None
    kept_sets: KeptSets | None = None  # truncated sampling: the kept-set pass (core/kept_sets.py)
    timings: dict[str, float] = field(default_factory=dict)
    iterations_done: int = 0

    def rows(self, sl: slice) -> "StepBatch":
        """The same batch restricted to rows ``sl`` (whole groups), keeping the global normaliser."""
        r = self.rollout
        g = r.group_size
        assert sl.start % g == 0 and sl.stop % g == 0, "a shard must hold whole groups"
        rollout = RolloutBatch(
            input_ids=r.input_ids[sl], attention_mask=r.attention_mask[sl], completion_ids=r.completion_ids[sl],
            completion_mask=r.completion_mask[sl], truncated=r.truncated[sl], prompt_len=r.prompt_len,
            group_size=g, prompts=r.prompts[sl], completions=r.completions[sl],
            sampler_logp=None if r.sampler_logp is None else r.sampler_logp[sl], filters=r.filters,
            weights_version=r.weights_version, kept_count=None if r.kept_count is None else r.kept_count[sl])
        pick = (lambda t: None if t is None else t[sl])
        return StepBatch(rollout=rollout, rewards=self.rewards[sl],
                         reward_columns={k: v[sl] for k, v in self.reward_columns.items()},
                         advantages=self.advantages[sl], loss_mask=self.loss_mask[sl], normalizer=self.normalizer,
                         ref_logp=pick(self.ref_logp), old_logp=pick(self.old_logp),
                         trainer_old_logp=pick(self.trainer_old_logp),
                         kept_sets=None if self.kept_sets is None else self.kept_sets.rows(sl),
                         timings=dict(self.timings),
                         iterations_done=self.iterations_done)
