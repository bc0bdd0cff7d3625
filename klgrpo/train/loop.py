"""The run around the steps: the run folder's lock, evaluation before and after, the metrics sinks, the stop
rules (non-finite steps, wall clock), checkpoints (every save_every steps, at the end, on Ctrl-C / SIGTERM) and
the summary. ``GRPOTrainer.train`` runs it; klgrpo/train/trainer.py has the step itself."""

from __future__ import annotations

import json
import signal
import time
from contextlib import contextmanager
from typing import Any, Callable

import torch

from klgrpo.train import metric_names as names
from klgrpo.train.building import base_model_path
from klgrpo.train.checkpoint import SHARDS_DIR
from klgrpo.train.guard import NonFiniteError
from klgrpo.train.metrics import SUMMARY_FILE, MetricsLogger
from klgrpo.train.run_folder import open_run_folder, resolve_auto_resume
from klgrpo.train.stop_signals import sigterm_as_interrupt
from klgrpo.train.tally import StepTally


def run_training(trainer, resume: str | None = None, overwrite: bool = False,
                 summary_extras: Callable[[dict], dict] | None = None) -> dict[str, Any]:
    """Run to train.steps. A fresh run refuses a folder that holds a run unless ``overwrite``; ``resume``
    ("latest", a checkpoint folder, or "auto": latest if there is one, else a fresh start) continues one
    (run_folder.py). ``summary_extras(summary)`` returns fields to add to the summary before summary.json is
    written (the demo's)."""
    dist, cfg = trainer.dist, trainer.cfg
    # Rank 0 decides; a refusal reaches every rank before any collective of the run, so none is left waiting.
    if resume == "auto":
        resume, overwrite = dist.agreed(lambda: resolve_auto_resume(trainer.run_dir, cfg), shared=True)
    lock = dist.agreed(lambda: open_run_folder(trainer.run_dir, cfg, resume, overwrite, log=trainer.log))
    trainer._run_lock = lock
    if trainer.replay is not None and dist.is_main:
        trainer.replay.write_cache()  # sampled before the folder was open: written now that it is this run's
    try:
        return _train(trainer, resume, summary_extras)
    finally:
        if lock is not None:
            lock.release()


def _train(trainer, resume: str | None, summary_extras=None) -> dict[str, Any]:
    cfg, main = trainer.cfg, trainer.dist.is_main
    if resume:
        trainer.resume(resume)
        if trainer._run_lock is not None:
            trainer._run_lock.config_after_resume(trainer.log)
    start = time.perf_counter()
    # Greedy evaluation runs on rank 0 only (sharded parameters: the others help gather the weights).
    evaluate = bool(trainer.eval_sets) and (main or trainer.engine.shards_parameters)
    if evaluate and trainer.step == 0:
        trainer._eval_before = trainer.evaluate()
    eval_before = trainer._eval_before  # a resumed run keeps the numbers measured before its first step
    history = StepTally()  # what the summary needs, not every row (constant memory per step)
    logger = (MetricsLogger(trainer.run_dir, cfg.train.steps, tensorboard=cfg.logging.tensorboard,
                            progress=cfg.logging.progress, start_step=trainer.step, report_to=cfg.logging.report_to,
                            project=cfg.logging.project, config=cfg.to_dict()) if main else SilentLogger())
    with logger:
        if eval_before and trainer.step == 0:
            logger.log(0, eval_before)
        with sigterm_as_interrupt(deferred=trainer.dist.enabled) as signals, save_on_interrupt(trainer, logger):
            while trainer.step < cfg.train.steps:
                metrics = trainer.train_step()
                step = trainer.step
                if evaluate and cfg.eval.every and step % cfg.eval.every == 0 and step < cfg.train.steps:
                    metrics.update(trainer.evaluate())
                logger.log(trainer.step, metrics)
                for line in trainer.kl_watch.observe(trainer.step, metrics.get(names.RAW_KL)):
                    logger.message(line)
                    logger.text("warnings/kl", line, trainer.step)
                for line in trainer.entropy_watch.observe(trainer.step, metrics.get(names.ENTROPY)):
                    logger.message(line)
                    logger.text("warnings/entropy", line, trainer.step)
                history.append(metrics)
                stop = should_stop(trainer, start, signals)
                if cfg.train.save_every and trainer.step % cfg.train.save_every == 0 and not stop:
                    trainer.save()
                if stop:
                    break
        if trainer._stop_reason:
            logger.message(f"stopped at step {trainer.step}: {trainer._stop_reason}")
        eval_after = trainer.evaluate() if evaluate else {}
        if eval_after:
            logger.log(trainer.step, eval_after)
    last = trainer.run_dir / "checkpoints" / f"step_{trainer.step}"
    if not last.exists() or (last / SHARDS_DIR).is_dir():
        trainer.save(whole=True)  # the last checkpoint is always whole (sharded or missing: written now)
    if main and cfg.model.lora.r > 0 and cfg.model.lora.save_merged:
        from klgrpo.backends.lora import export_merged

        export_merged(trainer.run_dir / "checkpoints" / f"step_{trainer.step}", trainer.run_dir / "merged",
                      base_model=base_model_path(cfg.model) or None)
    summary = run_summary(trainer, history, eval_before, eval_after, time.perf_counter() - start)
    if main and summary_extras is not None:
        summary.update(summary_extras(summary))
    if main:
        (trainer.run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))
        if cfg.logging.plots:
            from klgrpo.train.report import make_plots

            make_plots(trainer.run_dir)
    trainer.dist.barrier()
    if trainer.guard.exhausted:
        raise NonFiniteError(trainer.guard.stop_message(trainer.step))
    return summary


def should_stop(trainer, start: float, signals=None) -> bool:
    """Decided identically on every rank (the wall-clock verdict of rank 0 is shared). ``signals``: a
    ``DeferredStop`` (several processes); a signal any rank received stops all of them here, raising the
    interrupt that saves the step just completed."""
    cfg = trainer.cfg
    if trainer.guard.exhausted:
        trainer._stop_reason = trainer.guard.stop_message(trainer.step)
        return True
    over = bool(cfg.train.max_wall_seconds) and time.perf_counter() - start > cfg.train.max_wall_seconds
    if trainer.dist.enabled:
        noted = signals is not None and signals.signal is not None
        verdict = trainer.dist.max(torch.tensor([float(over and trainer.dist.is_main), float(noted)],
                                                device=trainer.device))
        over = bool(verdict[0].item())
        if verdict[1].item():
            raise signals.interrupt()
    if over:
        trainer._stop_reason = f"train.max_wall_seconds={cfg.train.max_wall_seconds:g} reached"
    return over


def run_summary(trainer, history: StepTally, eval_before: dict, eval_after: dict, wall: float) -> dict[str, Any]:
    """The run summary: what `klgrpo train` prints and summary.json holds."""
    last = history.last
    return {
        "steps": trainer.step,
        "wall_seconds": round(wall, 2),
        "seconds_per_step": history.mean(names.TIME_STEP, digits=4),
        "eval_before": {k.removeprefix(names.EVAL_PREFIX): v for k, v in eval_before.items()},
        "eval_after": {k.removeprefix(names.EVAL_PREFIX): v for k, v in eval_after.items()},
        "final_kl": last.get(names.RAW_KL),
        "final_replay_kl": last.get(names.KL_REPLAY),
        "final_beta": trainer.controller.value,
        "final_reward": last.get(names.REWARD),
        "kl_estimator": trainer.cfg.kl.estimator,
        "kl_placement": trainer.cfg.kl.placement,
        "stopped_early": trainer._stop_reason or None,
        "world_size": trainer.dist.world_size,
        "run_dir": str(trainer.run_dir),
    }


class SilentLogger:
    """The metrics sink of ranks other than 0."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def log(self, step, metrics):
        pass

    def message(self, text):
        pass

    def text(self, name, text, step):
        pass


@contextmanager
def save_on_interrupt(trainer, logger):
    """Ctrl-C: write a checkpoint of the last completed step, then stop (exit code 130 from the CLI)."""
    try:
        yield
    except KeyboardInterrupt:
        # A second Ctrl-C (or a SIGTERM) must not cut the save short.
        previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            trainer._rollback_partial_step()
            path = trainer.save()
            logger.message(f"interrupted: saved {path}; continue with --resume latest")
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        raise
