"""What a KL runaway does (``kl.on_runaway``), and how far adaptive beta reached (the summary's kl_reach).

A runaway is judged on the KL warning signs' windows (``kl.warn_window`` consecutive steps, run/kl_watch.py):

    runaway   the window's mean per-token KL is above kl.runaway_above and above the previous window's mean
              (the first window's "previous" is 0: every run starts at the reference)
    healthy   the window's mean is at or below kl.runaway_above: the state at the window's start (whose KL the
              window measured) is the rollback target

``warn`` does nothing here (the warning signs say it). ``stop`` keeps the checkpoint at the last healthy window's
start on disk (never pruned while it is the target) and stops the run cleanly at the runaway, naming it.
``rollback`` restores the last healthy window's start (the data position and RNG included), multiplies beta by
kl.runaway_beta_factor and the learning rate (its schedule) by kl.runaway_lr_factor, and trains on, at most
kl.runaway_max_rollbacks times (a runaway after them is only warned).

Both kept states (the window's start and the target) are checkpoints on disk, never pruned while kept (a state at
a step no checkpoint was saved at is written once); when the run's memory allows, the target is also held in
memory (the step's ``snapshot()`` and a copy of the run's own state), which a rollback restores without reading the
disk. The guard changes the step only through its methods (``snapshot`` / ``restore``, ``rescale``) and the run
only through its public ones (``state_dict`` / ``load_state_dict``, ``load_checkpoint``, ``save``).

A rollback restores, then writes the restored state (its rollback count and factors included) as the checkpoint
of its target step, one lineage higher (store/checkpoint.py), and only then deletes the undone steps' checkpoints:
a process killed before that checkpoint is in place resumes from the newest one of the run, the target or an
undone step, which replays to the same rollback; killed after it, from it. Either way the run goes on as if never
killed.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path
from typing import Any

from klgrpo.errors import ConfigError
from klgrpo.math.kl_control import horizon_to_reach
from klgrpo.run.kl_watch import WindowMeans
from klgrpo.store.checkpoint import checkpoints_after, is_complete, remove_checkpoints_after, step_folder
from klgrpo.train.step_state import StepSnapshot

HEALTHY, WINDOW_END, RUNAWAY = "healthy", "window_end", "runaway"
#: the verdicts that act, and each record's "action" in the summary (WARNED: a runaway past kl.runaway_max_rollbacks)
ROLLED_BACK, STOPPED, WARNED = "rolled_back", "stopped", "warned"
#: The share of the available memory an in-memory rollback target may take; above it the target is on disk.
MEMORY_SHARE = 0.25
#: Adaptive beta's target band for the KL, in units of kl.target (the step rule's default band).
REACH_BAND = (0.5, 1.5)


# ---------------------------------------------------------------------------------------- the in-memory target
def available_memory() -> int:
    """Bytes of memory available to a new allocation (MemAvailable; the free pages where /proc is absent)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


# ---------------------------------------------------------------------------------------------- the guard
@dataclasses.dataclass
class Kept:
    """A state the run can go back to: the step it ended, its checkpoint folder, and with the memory store the
    step's snapshot and a copy of the run's own state."""

    step: int
    snapshot: StepSnapshot | None = None
    folder: Path | None = None
    run_state: dict[str, Any] | None = None

    @classmethod
    def in_memory(cls, run, folder: Path) -> Kept:
        step = run.grpo_step
        return cls(step.completed, snapshot=step.snapshot(), folder=folder,
                   run_state=copy.deepcopy(run.state_dict()))


class RunawayGuard:
    """kl.on_runaway for a TrainingRun: ``begin(run, log)`` before the steps, ``after_step(run, step, kl, logger)``
    after each (HEALTHY, WINDOW_END, RUNAWAY, ROLLED_BACK, STOPPED, or None inside a window), ``keep(run, verdict)``
    after the step's checkpoint; ``state_dict`` travels in every checkpoint, ``summary()`` into summary.json.

    Two states are kept: the one at the start of the window in progress, and the target, the start of the last
    healthy window. The target is the state whose KL that window measured: the KL of a step is the policy's before
    its update, so a window's steps measure the states from its start to its second-to-last step."""

    def __init__(self, kl_cfg):
        self.cfg = kl_cfg
        self.action = kl_cfg.on_runaway
        self.windows = WindowMeans(kl_cfg.warn_window)
        self.rollbacks, self.beta_scale, self.lr_scale = 0, 1.0, 1.0
        self.records: list[dict[str, Any]] = []
        self.store = ""  # "memory" or "disk", chosen by begin()
        self.window_start: Kept | None = None
        self.target: Kept | None = None
        self._saving: Kept | None = None  # the state being written as a checkpoint
        self._steps_at_load: tuple[int | None, int | None] = (None, None)  # (window start, target) of a checkpoint
        self.stop_reason = ""

    @property
    def enabled(self) -> bool:
        return self.action != "warn"

    @property
    def protected(self) -> tuple[Path, ...]:
        """The checkpoints that pruning must keep: the window start and the target, on disk."""
        kept = (self.window_start, self.target, self._saving)
        return tuple(k.folder for k in kept if k is not None and k.folder is not None)

    @property
    def store_words(self) -> str:
        return "in memory" if self.store == "memory" else "on disk"

    def begin(self, run, log) -> None:
        """Choose where the kept states live; a fresh run keeps its start as both."""
        if not self.enabled:
            return
        if run.dist.enabled:
            raise ConfigError(f"kl.on_runaway {self.action} runs in one process; with several use kl.on_runaway "
                              f"warn")
        need, free = run.grpo_step.snapshot_bytes(), available_memory()
        self.store = "memory" if self.action == "rollback" and 2 * need <= MEMORY_SHARE * free else "disk"
        where = (f"in memory (CPU copies, 2 x {need / 2**30:.2f} GiB of {free / 2**30:.1f} GiB available) and on "
                 f"disk" if self.store == "memory" else "on disk")
        where += " (checkpoints kept while they are needed)"
        log(f"kl.on_runaway {self.action}: the start of the last healthy window is kept {where}")
        completed = run.grpo_step.completed
        window_step, target_step = self._steps_at_load  # a resumed run's; None: a fresh run
        # the kept states of the process before (on disk: protected from the save below) ...
        self.target = self._on_disk(run, target_step, completed, log)
        self.window_start = self._on_disk(run, window_step, completed, log)
        now = self._keep_now(run)  # ... and this step's, which stands in for any of them that is not
        self.target, self.window_start = self.target or now, self.window_start or now

    def _on_disk(self, run, step: int | None, completed: int, log) -> Kept | None:
        """A kept state of the process before this resume, from its checkpoint; None where it is this step's
        state, or was in the memory of the stopped process (said in a line: the resumed state stands in)."""
        if step is None or step == completed:
            return None
        folder = step_folder(run.run_dir, step)
        if is_complete(folder):
            return Kept(step, folder=folder)
        log(f"kl.on_runaway: the state of step {step} was in the memory of the stopped process; the resumed state "
            f"of step {completed} stands in for it")
        return None

    def _keep_now(self, run) -> Kept:
        """This step's state, kept: its checkpoint (written now if the step has none), and with the memory store
        its CPU copies too. On disk in both stores, so that a kill before a rollback resumes to the same run."""
        step = run.grpo_step.completed
        folder = step_folder(run.run_dir, step)
        if not is_complete(folder):
            self._saving = Kept(step, folder=folder)  # protected from the save's own pruning
            run.save()
            self._saving = None
        return Kept.in_memory(run, folder) if self.store == "memory" else Kept(step, folder=folder)

    def keep(self, run, verdict: str | None) -> None:
        """After a window's end (and its checkpoint): a healthy window's start becomes the target, and this step
        starts the next window."""
        if not self.enabled or verdict not in (HEALTHY, WINDOW_END, RUNAWAY):
            return
        if verdict == HEALTHY:
            self.target = self.window_start
        self.window_start = self._keep_now(run)

    def after_step(self, run, step: int, kl: float | None, logger) -> str | None:
        """Judge the window that ends at ``step``; act on a runaway."""
        if not self.enabled or kl is None or not math.isfinite(kl):
            return None
        window = self.windows.observe(step, kl)
        if window is None:
            return None
        mean, previous, first = window.mean, window.previous, window.first_step
        if mean <= self.cfg.runaway_above:
            return HEALTHY
        if mean <= previous:
            return WINDOW_END
        seen = (f"KL runaway at step {step}: the KL is {mean:.4g} per token (mean of steps {first}-{step}), above "
                f"kl.runaway_above {self.cfg.runaway_above:g} and rising (previous window {previous:.4g})")
        if self.action == "stop":
            return self._stop(step, mean, seen, logger)
        if self.rollbacks >= self.cfg.runaway_max_rollbacks:
            self.records.append({"action": WARNED, "step": step, "kl": mean})
            self._announce(logger, step, f"{seen}: kl.runaway_max_rollbacks ({self.cfg.runaway_max_rollbacks}) "
                                         f"reached, training on")
            return RUNAWAY
        return self._rollback(run, step, mean, seen, logger)

    def _stop(self, step: int, mean: float, seen: str, logger) -> str:
        folder = self.target.folder
        self.stop_reason = (f"{seen}; kl.on_runaway stop: the last healthy window started at the checkpoint {folder} "
                            f"(step {self.target.step}): train on from its weights (model.name_or_path {folder}, "
                            f"kl.reference the original model) with a larger kl.coef or a smaller optim.lr")
        self.records.append({"action": STOPPED, "step": step, "kl": mean, "checkpoint": str(folder),
                             "target_step": self.target.step})
        self._announce(logger, step, self.stop_reason)
        return STOPPED

    def _rollback(self, run, step: int, mean: float, seen: str, logger) -> str:
        grpo, target = run.grpo_step, self.target
        grpo.stop_gate.hold()  # a signal waits until the rollback is whole
        try:
            undone = checkpoints_after(run.run_dir, target.step)
            progress = self._progress()
            self._restore(run, target)
            self._load_progress(progress)
            logger.rewind(target.step)
            beta, lr = self._apply_factors(grpo)
            self.rollbacks += 1
            record = {"action": ROLLED_BACK, "step": step, "kl": mean, "to_step": target.step, "beta": beta,
                      "base_lr": lr, "rollback": self.rollbacks, "store": self.store,
                      "removed_checkpoints": [p.name for p in undone]}
            self.records.append(record)
            self.window_start = self.target = Kept(target.step, folder=step_folder(run.run_dir, target.step))
            # The restored state with its count and factors, one lineage higher: from the moment it is in place a
            # resume takes it, never an undone step, so the undone checkpoints can go.
            run.save()
            remove_checkpoints_after(run.run_dir, target.step)
            if self.store == "memory":
                self.target = self.window_start = Kept.in_memory(run, self.target.folder)
        finally:
            grpo.stop_gate.release()
        self._announce(logger, step, f"{seen}: rolled back to step {target.step} (the start of the last healthy "
                                     f"window, kept {self.store_words}), beta now {beta:.4g}, lr x{self.lr_scale:g} "
                                     f"(rollback {self.rollbacks} of {self.cfg.runaway_max_rollbacks})")
        return ROLLED_BACK

    @staticmethod
    def _restore(run, target: Kept) -> None:
        """The run back at ``target``: from memory (the step's snapshot and the run's state), else from its
        checkpoint folder."""
        if target.snapshot is None:
            run.load_checkpoint(target.folder)
            return
        run.grpo_step.restore(target.snapshot)
        run.load_state_dict(copy.deepcopy(target.run_state))  # the kept copy stays intact for another rollback

    def _apply_factors(self, grpo) -> tuple[float, float]:
        """beta x kl.runaway_beta_factor, the learning rate and its schedule x kl.runaway_lr_factor (the step's
        ``rescale``); returns the new beta and the schedule's base learning rate."""
        beta_factor, lr_factor = self.cfg.runaway_beta_factor, self.cfg.runaway_lr_factor
        beta, lr = grpo.rescale(beta_factor, lr_factor)
        self.beta_scale *= beta_factor
        self.lr_scale *= lr_factor
        return beta, lr

    def _announce(self, logger, step: int, line: str) -> None:
        logger.message(line)
        logger.text("warnings/kl_runaway", line, step)

    # ------------------------------------------------------------------------------------------- state
    def _progress(self) -> dict[str, Any]:
        """What a rollback does not undo: its own count, factors and records."""
        return {"rollbacks": self.rollbacks, "beta_scale": self.beta_scale, "lr_scale": self.lr_scale,
                "records": [dict(r) for r in self.records]}

    def _load_progress(self, progress: dict[str, Any]) -> None:
        self.rollbacks, self.beta_scale = int(progress["rollbacks"]), float(progress["beta_scale"])
        self.lr_scale, self.records = float(progress["lr_scale"]), [dict(r) for r in progress["records"]]

    def state_dict(self) -> dict[str, Any]:
        return {**self._progress(), "windows": self.windows.state_dict(),
                "window_start_step": self.window_start.step if self.window_start else None,
                "target_step": self.target.step if self.target else None}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if not state:
            return
        self._load_progress(state)
        self.windows.load_state_dict(state["windows"])
        self._steps_at_load = (state.get("window_start_step"), state.get("target_step"))

    def summary(self) -> dict[str, Any] | None:
        if not self.enabled:
            return None
        return {"on_runaway": self.action, "rollbacks": self.rollbacks, "beta_scale": self.beta_scale,
                "lr_scale": self.lr_scale, "target_store": self.store, "actions": [dict(r) for r in self.records]}


# ------------------------------------------------------------------------------------------- adaptive beta's reach
class KLReach:
    """Whether the KL that adaptive beta steers reached its target band (REACH_BAND x kl.target), judged on the
    warning signs' windows: the first window whose mean is in the band, and the last window's mean."""

    def __init__(self, target: float, window: int):
        self.target = float(target)
        self.windows = WindowMeans(window)
        self.first_in_band: int | None = None
        self.last_mean: float | None = None

    @property
    def band(self) -> tuple[float, float]:
        return REACH_BAND[0] * self.target, REACH_BAND[1] * self.target

    def in_band(self, value: float) -> bool:
        low, high = self.band
        return low <= value <= high

    def observe(self, step: int, kl: float | None) -> None:
        if kl is None or not math.isfinite(kl):
            return
        window = self.windows.observe(step, kl)
        if window is None:
            return
        mean = self.last_mean = window.mean
        if self.first_in_band is None and self.in_band(mean):
            self.first_in_band = step

    def summary(self, beta_start: float, beta_now: float, updates: int, horizon: float, batch: int) -> dict[str, Any]:
        """The summary's kl_reach: the band, the step the KL first reached it, whether the last window was in
        it, and, when not, the horizon that would have brought it there (horizon_to_reach: beta went from
        ``beta_start`` to ``beta_now`` in ``updates`` updates) as a line."""
        low, high = self.band
        last, window = self.last_mean, self.windows.window
        reached = last is not None and self.in_band(last)
        needed = None if reached or last is None else horizon_to_reach(
            beta_start, beta_now, updates, last, self.target, batch)
        out = {"target": self.target, "band": [low, high], "window": window, "first_step_in_band": self.first_in_band,
               "last_window_kl": last, "reached": reached, "horizon": horizon, "horizon_to_reach": needed}
        out["line"] = self._line(out, updates)
        return out

    def _line(self, r: dict[str, Any], updates: int) -> str:
        band = f"[{r['band'][0]:.4g}, {r['band'][1]:.4g}] (kl.target {self.target:g})"
        if r["last_window_kl"] is None:
            return f"KL reach: no window of {r['window']} steps ended; nothing to say about the band {band}"
        end = self.windows.last_end
        last = f"{r['last_window_kl']:.4g} (mean of steps {end - r['window'] + 1}-{end})"
        first = (f"first in the band at step {r['first_step_in_band']}" if r["first_step_in_band"] is not None
                 else "never in the band")
        if r["reached"]:
            return f"KL reach: the KL reached its band {band}, {first}, and ended in it at {last}"
        line = f"KL reach: the KL ended outside its band {band} at {last}, {first}"
        if r["horizon_to_reach"] is None:
            return line
        return (f"{line}; a kl.horizon of about {r['horizon_to_reach']:.3g} (this run's {r['horizon']:.4g}) would "
                f"have brought it to the target in these {updates} updates (estimate: KL ~ 1/beta, the controller's "
                f"error saturated)")

    def state_dict(self) -> dict[str, Any]:
        return {"windows": self.windows.state_dict(), "first_in_band": self.first_in_band,
                "last_mean": self.last_mean}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if not state:
            return
        self.windows.load_state_dict(state["windows"])
        self.first_in_band, self.last_mean = state["first_in_band"], state["last_mean"]
