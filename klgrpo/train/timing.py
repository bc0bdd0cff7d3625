"""Phase timers of a training step: time/generate, time/reward, time/reward_model, time/reference, time/update.

On a GPU, kernels run asynchronously, so a timer read right after a phase measures mostly its kernel launches
and the next phase's timer absorbs the wait. ``synchronize_timers(True)`` makes every phase timer wait for the
device when it starts and when it stops: exact per-phase times, at the cost of one device sync per phase
(the benchmarks turn it on). time/step is exact either way: each step ends with the metrics' host sync.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

import torch

_synchronize = False


def synchronize_timers(enabled: bool = True) -> None:
    """Make the phase timers synchronise with the CUDA device (no effect without one)."""
    global _synchronize
    _synchronize = bool(enabled)


def _device_sync() -> None:
    if _synchronize and torch.cuda.is_available():
        torch.cuda.synchronize()


@contextmanager
def phase_timer(timings: dict[str, float], key: str) -> Iterator[None]:
    """Add the seconds spent in the ``with`` block to ``timings[key]``."""
    _device_sync()
    t0 = time.perf_counter()
    yield
    _device_sync()
    timings[key] = timings.get(key, 0.0) + time.perf_counter() - t0
