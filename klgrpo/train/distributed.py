"""Multi-process training: the few collective operations the trainer needs, and nothing when alone.

Launch with ``accelerate launch --config_file examples/accelerate/<ddp|fsdp2|...>.yaml -m klgrpo train ...``
(docs/distributed.md). The process group is accelerate's (its PartialState, set up from the launcher's
environment); model and optimizer preparation (DDP, FSDP2, DeepSpeed) live in klgrpo.train.engine. Layout:
every rank draws the same global prompt indices and keeps its contiguous slice, so each prompt's G completions
stay on one rank; rewards are gathered so advantages (also scale="batch") equal the single-process ones; the
loss of each rank is normalised by GLOBAL counts and the gradients are SUMMED across ranks, so loss, gradient
and metrics equal a single process on the same batch.

Failures never hang the other ranks: the process group's collectives time out after ``train.dist_timeout_s``
(torch's default is 30 minutes), and a refusal decided by rank 0 alone (the run folder) is shared with
``agreed`` before any other collective, so every rank stops with the same message (docs/reliability.md).
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from typing import Callable, TypeVar

import torch
from torch import Tensor


def _launched_with_several_processes() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


T = TypeVar("T")


def _init_restarted_cpu_group(timeout: timedelta | None) -> None:
    """A worker that ``torchrun --max-restarts`` restarted, on CPUs: the launcher keeps one key-value store
    across attempts, and a new gloo group reads the previous attempt's addresses from it when they are still
    there (seen here: "connection refused", or a hang at start-up). The group of attempt N gets keys of its
    own; accelerate then adopts the initialised group."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if (attempt == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or torch.cuda.is_available()
            or torch.distributed.is_initialized()):
        return
    from torch.distributed import PrefixStore, TCPStore

    store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                     **({"timeout": timeout} if timeout else {}))
    torch.distributed.init_process_group("gloo", store=PrefixStore(f"klgrpo/attempt_{attempt}", store),
                                         rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                                         **({"timeout": timeout} if timeout else {}))


def lost_peer_message(exc: BaseException) -> str | None:
    """One line for a collective that failed because another process died, stopped or stalled past
    ``train.dist_timeout_s`` (None for any other error)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    backend_error = getattr(torch.distributed, "DistError", ())
    text = str(exc)
    if not (isinstance(exc, backend_error) or (isinstance(exc, RuntimeError)
                                               and any(k in text for k in ("gloo", "NCCL", "nccl", "Timed out")))):
        return None
    from klgrpo.errors import first_line

    return (f"the processes of this run lost each other ({first_line(exc)}): another process failed, was killed or "
            f"stalled past train.dist_timeout_s; its own output says why; continue with --resume latest")


def close_process_group(wait_s: float = 30.0) -> None:
    """At the end of a multi-process command whose ranks have all passed the run's last barrier: take this rank's
    process group down, so that no communication thread is still running while the interpreter exits (gloo's can
    abort the process there: "terminate called without an active exception", after a run that had finished). No
    collective: each rank closes its own group. Waits at most ``wait_s`` for it, then lets the process exit."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    import threading

    closing = threading.Thread(target=torch.distributed.destroy_process_group, daemon=True)
    closing.start()
    closing.join(wait_s)


def exit_now_if_distributed(code: int) -> None:
    """At the very end of a multi-process command that finished (every result written, the process group closed):
    run the process's exit handlers, flush, and leave without the interpreter's teardown. On a loaded machine one
    gloo rank in about 20 aborted in that teardown even with its group destroyed ("terminate called without an
    active exception"), and the launcher then reported a finished run as failed. A single process returns."""
    if not (torch.distributed.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1):
        return
    import atexit

    atexit._run_exitfuncs()  # what exit handlers a run registered (temporary folders, trackers) still run
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class Distributed:
    """Rank, world size and collectives; a no-op stand-in for a single process. ``timeout_s``: how long a
    collective waits for the other ranks (applies when this call creates the process group)."""

    def __init__(self, timeout_s: float | None = None):
        self.rank, self.world_size, self.local_rank = 0, 1, 0
        if _launched_with_several_processes() or (torch.distributed.is_available()
                                                   and torch.distributed.is_initialized()):
            from accelerate import PartialState

            # Without cpu=True a machine with no GPU silently becomes "rank 0 of 1" in every process.
            timeout = timedelta(seconds=timeout_s) if timeout_s else None
            _init_restarted_cpu_group(timeout)
            state = PartialState(cpu=not torch.cuda.is_available(), **({"timeout": timeout} if timeout else {}))
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

    def broadcast_object(self, obj):
        """Rank 0's ``obj`` on every rank."""
        if not self.enabled:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def agreed(self, decide_on_main: Callable[[], T], shared: bool = False) -> T | None:
        """Run ``decide_on_main`` on rank 0 only and share its verdict: its result on rank 0 (on every rank with
        ``shared``, else None elsewhere), or the same klgrpo error (a refusal) raised on every rank. Call it
        before any collective the refusal must not strand the other ranks in."""
        from klgrpo.errors import KLGRPOError, first_line

        result, failure, refusal = None, None, None
        if self.is_main:
            try:
                result = decide_on_main()
            except Exception as exc:  # anything else is shared as one line too, and re-raised as is on rank 0
                failure = exc
                refusal = exc if isinstance(exc, KLGRPOError) else KLGRPOError(
                    f"process 0 failed: {type(exc).__name__}: {first_line(exc)}")
        refusal = self.broadcast_object(refusal)
        if failure is not None:
            raise failure
        if refusal is not None:
            raise refusal
        return self.broadcast_object(result) if shared else result

    def barrier(self) -> None:
        if self.enabled:
            from accelerate import PartialState

            PartialState().wait_for_everyone()
