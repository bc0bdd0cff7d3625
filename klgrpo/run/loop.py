"""The run around the steps: the run folder's lock, evaluation before and after, the metrics sinks, the KL
warning signs, the stop rules (non-finite steps, wall clock), checkpoints (every save_every steps, at the end, on
Ctrl-C / SIGTERM) and the summary. ``TrainingRun`` holds them; the step itself is train/step.py's ``GRPOStep``,
and checkpoints are read and written only through store/checkpoint.py and store/resume.py."""

from __future__ import annotations

import json
import os
import signal
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

import torch

from klgrpo.config.schema import GRPOConfig
from klgrpo.config.terms import run_horizon
from klgrpo.errors import warn
from klgrpo.run.evaluation import evaluate_sets
from klgrpo.run.kl_watch import EntropyWatch, KLWatch, SamplerWatch
from klgrpo.run.metrics import MetricsLogger
from klgrpo.run.runaway import ROLLED_BACK, STOPPED, KLReach, RunawayGuard
from klgrpo.run.tally import StepTally
from klgrpo.store.checkpoint import LINEAGE_KEY, checkpoint_writer, is_sharded, step_folder
from klgrpo.store.resume import load_resumable_checkpoint, set_aside
from klgrpo.store.run_folder import SUMMARY_FILE, open_run_folder, resolve_auto_resume
from klgrpo.train import metric_names as names
from klgrpo.train.building import base_model_path
from klgrpo.train.distributed import Distributed
from klgrpo.train.guard import NonFiniteError
from klgrpo.train.step import GRPOStep
from klgrpo.train.stop_signals import sigterm_as_interrupt


class TrainingRun:
    """A run of ``step`` in ``run_dir``: ``train()`` to train.steps, ``save()``, ``resume()``, ``evaluate()``."""

    def __init__(self, step: GRPOStep, run_dir: Path, eval_sets: dict[str, Any], cfg: GRPOConfig,
                 dist: Distributed, log: Callable = print):
        self.grpo_step, self.run_dir, self.eval_sets, self.log = step, Path(run_dir), eval_sets, log
        self.cfg, self.dist = cfg, dist
        kl = self.cfg.kl
        self.kl_watch = KLWatch(kl.warn_above, kl.warn_below, kl.warn_window)
        self.entropy_watch = EntropyWatch(self.cfg.train.entropy_warn_below, self.cfg.train.entropy_warn_window)
        r = self.cfg.rollout
        self.sampler_watch = SamplerWatch(r.warn_ess_below, r.warn_chi2_above, kl.warn_window)
        self.runaway = RunawayGuard(kl)  # kl.on_runaway (run/runaway.py)
        self.kl_reach = KLReach(kl.target, kl.warn_window) if kl.controller == "adaptive" else None
        self.lock = None  # rank 0's, while train() runs
        self.stop_reason = ""
        self.eval_before: dict[str, float] = {}  # measured before the first step; a resumed run keeps it

    # ------------------------------------------------------------------------------------------- a step
    def train_step(self) -> tuple[dict[str, float], Any]:
        """One step of the run (the KL dump of kl.dump_every written into the run folder when due); returns the
        step's metrics and the KL observation."""
        every = self.cfg.kl.dump_every
        due = bool(every and (self.grpo_step.completed + 1) % every == 0)
        return self.grpo_step.advance(dump_kl=self._dump_kl if due else None)

    def _dump_kl(self, logp: torch.Tensor, batch) -> None:
        from klgrpo.core.kl_dump import DUMP_DIR, save_dump

        step = self.grpo_step.completed + 1
        folder = self.run_dir / DUMP_DIR
        folder.mkdir(parents=True, exist_ok=True)
        save_dump(folder / f"step_{step:06d}.safetensors", step, logp, batch.ref_logp, batch.loss_mask)

    def evaluate(self) -> dict[str, float]:
        """Rank 0 evaluates; with sharded parameters every rank enters (to gather the weights) and waits."""
        step = self.grpo_step
        with step.full_weights() as model:
            return evaluate_sets(model, step.tokenizer, self.eval_sets, self.cfg) if self.dist.is_main else {}

    # ------------------------------------------------------------------------------------------ the run
    def train(self, resume: str | None = None, overwrite: bool = False,
              summary_extras: Callable[[dict], dict] | None = None) -> dict[str, Any]:
        """Run to train.steps. A fresh run refuses a folder that holds a run unless ``overwrite``; ``resume``
        ("latest", a checkpoint folder, or "auto": latest if there is one, else a fresh start) continues one
        (run_folder.py). ``summary_extras(summary)`` returns fields to add to the summary before summary.json is
        written (the demo's)."""
        dist, cfg = self.dist, self.cfg
        # Rank 0 decides; a refusal reaches every rank before any collective of the run, so none is left waiting.
        if resume == "auto":
            resume, overwrite = dist.agreed(lambda: resolve_auto_resume(self.run_dir, cfg), shared=True)
        self.lock = dist.agreed(lambda: open_run_folder(self.run_dir, cfg, resume, overwrite, log=self.log))
        try:
            if resume:
                self.resume(resume)
                if self.lock is not None:
                    self.lock.config_after_resume(self.log)
            return self._train(summary_extras)
        finally:
            self.grpo_step.close()  # its sampler's engine and generation process go with the run
            if self.lock is not None:
                self.lock.release()

    def _train(self, summary_extras=None) -> dict[str, Any]:
        cfg, step, main = self.cfg, self.grpo_step, self.dist.is_main
        start = time.perf_counter()
        # Greedy evaluation runs on rank 0 only; every rank enters it (sharded weights: the others help gather them).
        evaluate = bool(self.eval_sets)
        if evaluate and step.completed == 0:
            self.eval_before = self.evaluate()
        history = StepTally()  # what the summary needs, not every row (constant memory per step)
        logger = (MetricsLogger(self.run_dir, cfg.train.steps, tensorboard=cfg.logging.tensorboard,
                                progress=cfg.logging.progress, start_step=step.completed,
                                report_to=cfg.logging.report_to, project=cfg.logging.project,
                                config=cfg.to_dict()) if main else SilentLogger())
        with logger:
            if self.eval_before and step.completed == 0:
                logger.log(0, self.eval_before)
            if step.completed < cfg.train.steps:
                step.start(logger.message if main else None)
            self._steps(logger, history, start, evaluate)
            if self.stop_reason and self.stop_reason != self.runaway.stop_reason:  # the guard said its own once
                logger.message(f"stopped at step {step.completed}: {self.stop_reason}")
            eval_after = self.evaluate() if evaluate else {}
            if eval_after:
                logger.log(step.completed, eval_after)
        self._finish_checkpoints()
        summary = self.summary(history, eval_after, time.perf_counter() - start)
        if main:
            if "kl_reach" in summary:
                self.log(summary["kl_reach"]["line"])
            if summary_extras is not None:
                summary.update(summary_extras(summary))
            (self.run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))
            if cfg.logging.plots:
                from klgrpo.run.report import make_plots

                make_plots(self.run_dir)
        self.dist.barrier()
        if step.guard.exhausted:
            raise NonFiniteError(step.guard.stop_message(step.completed))
        return summary

    def _steps(self, logger, history: StepTally, start: float, evaluate: bool) -> None:
        cfg, step = self.cfg, self.grpo_step
        gate = None if self.dist.enabled else step.stop_gate  # several processes: every stop waits for the boundary
        with sigterm_as_interrupt(deferred=self.dist.enabled, gate=gate) as signals, save_on_interrupt(self, logger):
            if step.completed < cfg.train.steps:
                self.runaway.begin(self, logger.message)
            while step.completed < cfg.train.steps:
                metrics, observation = self.train_step()
                done = step.completed
                if evaluate and cfg.eval.every and done % cfg.eval.every == 0 and done < cfg.train.steps:
                    metrics.update(self.evaluate())
                logger.log(done, metrics)
                kl = observation.token_mean if names.RAW_KL in metrics else None  # no reference: no KL seen
                for watch, value, name in ((self.kl_watch, kl, "warnings/kl"),
                                           (self.entropy_watch, metrics.get(names.ENTROPY), "warnings/entropy")):
                    for line in watch.observe(done, value):
                        logger.message(line)
                        logger.text(name, line, done)
                for line in self.sampler_watch.observe(done, metrics.get(names.SAMPLER_ESS),
                                                       metrics.get(names.SAMPLER_CHI2_TOKEN)):
                    logger.message(line)
                    logger.text("warnings/sampler", line, done)
                verdict = self._runaway_verdict(done, kl, logger)  # a rollback leaves step.completed < done
                history.append(metrics)
                step.stop_gate.release()  # the step is complete and logged: a stop that waited for it comes now
                stop = verdict == STOPPED or self.should_stop(start, signals)
                if verdict == STOPPED:
                    self.stop_reason = self.runaway.stop_reason
                if cfg.train.save_every and done % cfg.train.save_every == 0 and not stop and verdict != ROLLED_BACK:
                    # A stop waits for the checkpoint: raised inside the save (shutil.rmtree pruning an old one),
                    # it could turn into an OSError that skipped the interrupted run's own save.
                    step.stop_gate.hold()
                    self.save()
                    step.stop_gate.release()
                if not stop:
                    self.runaway.keep(self, verdict)  # after the save: a checkpoint of this step is reused
                if stop:
                    break

    def _runaway_verdict(self, done: int, kl: float | None, logger) -> str | None:
        """The KL's reach (adaptive controller) and kl.on_runaway's verdict on the window ending at ``done``; both
        observe after the warning signs, so a rollback restores their windows with the rest."""
        if self.kl_reach is not None:
            self.kl_reach.observe(done, kl)
        return self.runaway.after_step(self, done, kl, logger)

    def _finish_checkpoints(self) -> None:
        """The last checkpoint is always whole (sharded or missing: written now); with model.lora.save_merged the
        merged model is exported beside it."""
        cfg, done = self.cfg, self.grpo_step.completed
        last = step_folder(self.run_dir, done)
        if not last.exists() or is_sharded(last):
            self.save(whole=True)
        if self.dist.is_main and cfg.model.lora.r > 0 and cfg.model.lora.save_merged:
            from klgrpo.backends.lora import export_merged

            export_merged(last, self.run_dir / "merged", base_model=base_model_path(cfg.model) or None)

    def should_stop(self, start: float, signals=None) -> bool:
        """Decided identically on every rank (the wall-clock verdict of rank 0 is shared). ``signals``: a
        ``DeferredStop`` (several processes); a signal any rank received stops all of them here, raising the
        interrupt that saves the step just completed."""
        cfg, dist, guard = self.cfg, self.dist, self.grpo_step.guard
        if guard.exhausted:
            self.stop_reason = guard.stop_message(self.grpo_step.completed)
            return True
        over = bool(cfg.train.max_wall_seconds) and time.perf_counter() - start > cfg.train.max_wall_seconds
        if dist.enabled:
            noted = signals is not None and signals.signal is not None
            verdict = dist.max(torch.tensor([float(over and dist.is_main), float(noted)], device=dist.device))
            over = bool(verdict[0].item())
            if verdict[1].item():
                raise signals.interrupt()
        if over:
            self.stop_reason = f"train.max_wall_seconds={cfg.train.max_wall_seconds:g} reached"
        return over

    def summary(self, history: StepTally, eval_after: dict, wall: float) -> dict[str, Any]:
        """The run summary: what `klgrpo train` prints and summary.json holds."""
        last, step = history.last, self.grpo_step
        return {
            "steps": step.completed,
            "wall_seconds": round(wall, 2),
            "seconds_per_step": history.mean(names.TIME_STEP, digits=4),
            "eval_before": _accuracies(self.eval_before),
            "eval_after": _accuracies(eval_after),
            "final_kl": last.get(names.RAW_KL),
            "final_replay_kl": last.get(names.KL_REPLAY),
            "final_beta": step.beta,
            "final_reward": last.get(names.REWARD),
            "kl_estimator": self.cfg.kl.estimator,
            "kl_placement": self.cfg.kl.placement,
            "stopped_early": self.stop_reason or None,
            "world_size": self.dist.world_size,
            "run_dir": str(self.run_dir),
            **self._kl_summaries(),
        }

    def _kl_summaries(self) -> dict[str, Any]:
        """kl_reach (the adaptive controller) and runaway (kl.on_runaway stop or rollback), where they apply."""
        out, cfg = {}, self.cfg
        if self.kl_reach is not None:
            step, batch = self.grpo_step, cfg.rollout.prompts_per_step * cfg.rollout.group_size
            out["kl_reach"] = self.kl_reach.summary(cfg.kl.coef, step.beta, step.beta_updates, run_horizon(cfg), batch)
        if self.runaway.enabled:
            out["runaway"] = self.runaway.summary()
        return out

    # ------------------------------------------------------------------------------------ checkpoints
    def save(self, whole: bool = False) -> Path:
        """Every rank calls this: the step writes what it owns (with train.sharded_checkpoints, unless ``whole``,
        every rank its shards) into the checkpoint folder that store/checkpoint.py makes atomic and prunes."""
        step, dist = self.grpo_step, self.dist
        sharded = self.cfg.train.sharded_checkpoints and not whole
        with checkpoint_writer(self.run_dir, step.completed, owner=dist.is_main, keep=self.cfg.train.keep_checkpoints,
                               pid=dist.broadcast_object(os.getpid()), ready=dist.barrier,
                               protect=self.runaway.protected) as folder:
            step.save(folder, sharded=sharded, run_state=self.state_dict())
        dist.barrier()
        return step_folder(self.run_dir, step.completed)

    def state_dict(self) -> dict[str, Any]:
        """The run's own part of a checkpoint (the step writes its own)."""
        state = {"eval_before": self.eval_before, "kl_watch": self.kl_watch.state_dict(),
                 "entropy_watch": self.entropy_watch.state_dict(), "sampler_watch": self.sampler_watch.state_dict(),
                 "run_config": self.cfg.to_dict()}  # the settings a resume checks config.yaml against
        if self.runaway.enabled:
            state["runaway"] = self.runaway.state_dict()
            state[LINEAGE_KEY] = self.runaway.rollbacks  # a rollback's checkpoint outranks the steps it undid
        if self.kl_reach is not None:
            state["kl_reach"] = self.kl_reach.state_dict()
        return state

    def resume(self, resume: str) -> None:
        """Continue from ``resume`` ("latest": the newest checkpoint that loads; a corrupt newest one is named and
        skipped for an older one)."""
        ckpt, damaged = self._load_resumable(resume)
        if damaged:  # every rank has read what it needs before rank 0 renames anything
            self.dist.barrier()
            for moved in set_aside(damaged) if self.dist.is_main else ():
                warn(f"kept the checkpoint that did not load as {moved}: the steps after {ckpt.name} are trained "
                     f"again and write their own")
        self.log(f"resumed from {ckpt} at step {self.grpo_step.completed}")

    def load_checkpoint(self, checkpoint: str | Path) -> Path:
        """The step's state and the run's own from ``checkpoint`` ("latest", or one folder of this run's, whose
        checksums must hold: store/resume.py); returns the folder loaded."""
        return self._load_resumable(checkpoint)[0]

    def _load_resumable(self, checkpoint: str | Path) -> tuple[Path, list[Path]]:
        ckpt, _, damaged = load_resumable_checkpoint(self.run_dir, str(checkpoint), load=self._load)
        return ckpt, damaged

    def _load(self, folder: Path) -> dict[str, Any]:
        state = self.grpo_step.load(folder)
        self.load_state_dict(state)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The run's own part of a trainer state (``state_dict``'s keys; a rollback in memory restores it too)."""
        self.kl_watch.load_state_dict(state.get("kl_watch"))
        self.entropy_watch.load_state_dict(state.get("entropy_watch"))
        self.sampler_watch.load_state_dict(state.get("sampler_watch"))
        self.runaway.load_state_dict(state.get("runaway"))
        if self.kl_reach is not None:
            self.kl_reach.load_state_dict(state.get("kl_reach"))
        self.eval_before = state.get("eval_before") or {}


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

    def rewind(self, step):
        pass

    def text(self, name, text, step):
        pass


@contextmanager
def save_on_interrupt(run: TrainingRun, logger):
    """Ctrl-C: write a checkpoint of the last completed step, then stop (exit code 130 from the CLI)."""
    try:
        yield
    except KeyboardInterrupt:
        # A second Ctrl-C (or a SIGTERM) must not cut the save short.
        previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            path = run.save()  # the step interrupted before its optimizer step is undone first
            logger.message(f"interrupted: saved {path}; continue with --resume latest")
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        raise


def _accuracies(results: dict[str, float]) -> dict[str, float]:
    """{set name: accuracy} of an evaluation's metrics (its entropies stay in metrics.jsonl)."""
    return {k.removeprefix(names.EVAL_PREFIX): v for k, v in results.items() if names.is_eval_accuracy(k)}
