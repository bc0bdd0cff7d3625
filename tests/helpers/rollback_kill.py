"""A training run killed with SIGKILL at one point of a kl.on_runaway rollback (tests/test_runaway.py).

    python -m helpers.rollback_kill CONFIG.yaml POINT [disk]

POINT: before_restore, after_restore, inside_save (the rollback's checkpoint written, the old one of its step moved
aside, the new one not yet in place), after_save, between_removals (of the undone checkpoints), after_removals.
``disk``: no memory to spare, so the kept states live on disk only. The process kills itself there: nothing of it
runs after (no handler, no finally), as with kill -9.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from klgrpo.config.schema import GRPOConfig
from klgrpo.run import runaway
from klgrpo.run.trainer import GRPOTrainer
from klgrpo.store import checkpoint

POINTS = ("before_restore", "after_restore", "inside_save", "after_save", "between_removals", "after_removals")


def die(*_args, **_kwargs):
    os.kill(os.getpid(), signal.SIGKILL)


def kill_before(owner, name: str) -> None:
    setattr(owner, name, die)


def kill_after(owner, name: str) -> None:
    real = getattr(owner, name)

    def then_die(*args, **kwargs):
        real(*args, **kwargs)
        die()

    setattr(owner, name, then_die)


def kill_at_nth(owner, name: str, n: int, counts) -> None:
    """Kill at the ``n``-th call of ``owner.name`` whose arguments ``counts``."""
    real, seen = getattr(owner, name), []

    def maybe_die(*args, **kwargs):
        if counts(*args):
            seen.append(args)
            if len(seen) == n:
                die()
        return real(*args, **kwargs)

    setattr(owner, name, maybe_die)


def arm(point: str, target_step: int = 0) -> None:
    target = f"step_{target_step}"
    if point == "before_restore":  # from memory or from the target's checkpoint
        kill_before(runaway.RunawayGuard, "_restore")
    elif point == "after_restore":
        kill_after(runaway.RunawayGuard, "_apply_factors")
    elif point == "inside_save":  # the second rename of a temporary folder into the target's: the rollback's
        kill_at_nth(checkpoint.os, "replace", 2,
                    lambda src, dst: Path(dst).name == target and Path(src).name.startswith(".tmp_"))
    elif point == "after_save":
        kill_before(runaway, "remove_checkpoints_after")
    elif point == "between_removals":
        kill_at_nth(checkpoint, "_remove", 2, lambda folder: Path(folder).name.startswith("step_"))
    elif point == "after_removals":
        kill_after(runaway.RunawayGuard, "_announce")
    else:
        raise SystemExit(f"unknown point {point!r}; one of {', '.join(POINTS)}")


if __name__ == "__main__":
    config, point = sys.argv[1], sys.argv[2]
    if sys.argv[3:] == ["disk"]:
        runaway.available_memory = lambda: 0
    arm(point)
    GRPOTrainer(GRPOConfig.from_yaml(config), log=lambda *_: None).train()
    raise SystemExit("the run finished: the kill point was never reached")
