"""What a signal does to a training run: SIGTERM (a scheduler's preemption, ``docker stop``) stops it like Ctrl-C,
after the trainer saved the last complete step; under a launcher, SIGTERM and SIGINT are noted and every rank
stops together at the next step boundary (run/loop.py; docs/reliability.md).

A stop that lands inside a step undoes the step (its data order, RNG and batch) as long as the weights are
untouched; from the optimizer step on the step cannot be undone, so a ``StopGate`` holds the signal until the
step is complete and logged, and raises it then (the resumed run is then bitwise the uninterrupted one)."""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's preemption, ``docker stop``): handled like Ctrl-C, the CLI exits 143."""


class DeferredStop:
    """Signals received while several processes train: noted here, acted on at the next step boundary, where
    the ranks agree to stop together (a rank that raised mid-step would leave the others in a collective)."""

    def __init__(self):
        self.signal: int | None = None

    def interrupt(self) -> KeyboardInterrupt:
        """What the trainer raises once the ranks agreed to stop (on a rank that saw no signal: Terminated, the
        launcher's way of stopping a run)."""
        return KeyboardInterrupt() if self.signal == signal.SIGINT else Terminated()


class StopGate:
    """Held from a step's optimizer step until the step is recorded: SIGTERM / SIGINT received meanwhile are noted
    and raised by ``release()``. Without the handlers of ``sigterm_as_interrupt(gate=...)`` it does nothing."""

    def __init__(self):
        self.held = False
        self.pending: int | None = None

    def hold(self) -> None:
        self.held = True

    def reset(self) -> None:
        """Open, forgetting a noted signal (a step starts, or the run is already stopping)."""
        self.held, self.pending = False, None

    def release(self) -> None:
        """Open the gate; a signal noted while it was held is raised now."""
        self.held = False
        signum, self.pending = self.pending, None
        if signum is not None:
            raise KeyboardInterrupt() if signum == signal.SIGINT else Terminated()


@contextmanager
def sigterm_as_interrupt(deferred: bool = False, gate: StopGate | None = None):
    """Within the block, SIGTERM raises ``Terminated`` (a KeyboardInterrupt), so the trainer saves the last
    complete step as on Ctrl-C. ``deferred`` (several processes): SIGTERM and SIGINT are only noted in the
    yielded ``DeferredStop`` and the trainer stops at the step boundary. ``gate`` (one process): SIGINT is handled
    too, and both wait while the gate is held. Only the main thread can install handlers; elsewhere this does
    nothing."""
    stop = DeferredStop()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def _raise(signum, frame):
        if gate is not None and gate.held:
            gate.pending = gate.pending or signum
            return
        raise KeyboardInterrupt() if signum == signal.SIGINT else Terminated()

    def _note(signum, frame):
        stop.signal = stop.signal or signum

    signals = (signal.SIGTERM, signal.SIGINT) if deferred or gate is not None else (signal.SIGTERM,)
    previous = {s: signal.signal(s, _note if deferred else _raise) for s in signals}
    try:
        yield stop
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
