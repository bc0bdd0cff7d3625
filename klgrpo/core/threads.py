"""torch's intra-op thread count for a block of code, restored afterwards."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


@contextmanager
def torch_threads(n: int | None = 1) -> Iterator[None]:
    """Run the block with ``n`` torch threads (None: leave the count alone). Tiny tensors (the verifier's checks,
    the demo's SFT) gain nothing from intra-op threads and lose to their synchronisation on a busy CPU."""
    previous = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
