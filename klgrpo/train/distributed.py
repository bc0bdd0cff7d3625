"""Multi-process training: the few collective operations the trainer needs, and nothing when alone.

Launch with ``accelerate launch --config_file examples/accelerate/<ddp|fsdp2|...>.yaml -m klgrpo train ...``
(docs/distributed.md). The process group is accelerate's (its PartialState, set up from the launcher's
environment); model and optimizer preparation (DDP, FSDP2, DeepSpeed) live in klgrpo.train.engine. Layout:
every rank draws the same global prompt indices and keeps its contiguous slice, so each prompt's G completions
stay on one rank; rewards are gathered so advantages (also scale="batch") equal the single-process ones; the
loss of each rank is normalised by GLOBAL counts and the gradients are SUMMED across ranks, so loss, gradient
and metrics equal a single process on the same batch.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor


def _launched_with_several_processes() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


class Distributed:
    """Rank, world size and collectives; a no-op stand-in for a single process."""

    def __init__(self):
        self.rank, self.world_size, self.local_rank = 0, 1, 0
        if _launched_with_several_processes() or (torch.distributed.is_available()
                                                   and torch.distributed.is_initialized()):
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
        if not self.enabled:
            return t
        from accelerate.utils import reduce

        return reduce(t.clone(), reduction="sum")

    def max(self, t: Tensor) -> Tensor:
        """Elementwise maximum over ranks."""
        return self.gather(t.unsqueeze(0)).amax(dim=0) if self.enabled else t

    def gather(self, t: Tensor) -> Tensor:
        """Concatenate equally-shaped tensors of all ranks along dim 0, in rank order."""
        if not self.enabled:
            return t
        from accelerate.utils import gather

        return gather(t.contiguous())

    def gather_objects(self, obj) -> list:
        if not self.enabled:
            return [obj]
        from accelerate.utils import gather_object

        return gather_object([obj])

    def barrier(self) -> None:
        if self.enabled:
            from accelerate import PartialState

            PartialState().wait_for_everyone()
