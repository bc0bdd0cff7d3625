"""Multi-process training: the few collective operations the trainer needs, and nothing when alone.

Launch with ``accelerate launch -m klgrpo train ...`` or ``torchrun --nproc_per_node N -m klgrpo train ...``
(on CPUs: ``ACCELERATE_USE_CPU=1``, gloo). The process group is set up by accelerate's PartialState from the
launcher's environment. Layout: every rank draws the same global prompt indices and keeps its contiguous
slice, so each prompt's G completions stay on one rank; rewards are gathered so advantages (also
scale="batch") equal the single-process ones; the loss of each rank is normalised by GLOBAL counts and the
gradients are SUMMED across ranks, so loss, gradient and metrics equal a single process on the same batch.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import Tensor


def _launched_with_several_processes() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


class Distributed:
    """Rank, world size and collectives; a no-op stand-in for a single process."""

    def __init__(self):
        self.rank, self.world_size, self.local_rank = 0, 1, 0
        if _launched_with_several_processes() or (dist.is_available() and dist.is_initialized()):
            from accelerate import PartialState

            # Without cpu=True a machine with no GPU silently becomes "rank 0 of 1" in every process.
            state = PartialState(cpu=not torch.cuda.is_available())
            self.rank, self.world_size = state.process_index, state.num_processes
            self.local_rank = state.local_process_index
            self.device = state.device
        else:
            self.device = None

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def local_slice(self, n: int) -> slice:
        """This rank's contiguous share of n items (n divisible by the world size)."""
        share = n // self.world_size
        return slice(self.rank * share, (self.rank + 1) * share)

    def sum(self, t: Tensor) -> Tensor:
        if self.enabled:
            t = t.clone()
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def max(self, t: Tensor) -> Tensor:
        if self.enabled:
            t = t.clone()
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t

    def gather(self, t: Tensor) -> Tensor:
        """Concatenate equally-shaped tensors of all ranks along dim 0, in rank order."""
        if not self.enabled:
            return t
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t.contiguous())
        return torch.cat(parts, dim=0)

    def gather_objects(self, obj) -> list:
        if not self.enabled:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def sum_gradients(self, params) -> None:
        """grad <- sum over ranks (one flat buffer per dtype: one collective instead of one per tensor)."""
        if not self.enabled:
            return
        grads = [p.grad for p in params if p.grad is not None]
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for group in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in group])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            offset = 0
            for g in group:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()
