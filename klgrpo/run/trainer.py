"""GRPOTrainer, the public face: ``GRPOTrainer(config).train()``.

It builds two things and hands the work to them: the step (train/step.py's ``GRPOStep``: policy, reference,
optimizer, scheduler, KL controller, guard, the batch in use; built by train/step_build.py) and the run around
the steps (run/loop.py's ``TrainingRun``: run folder, lock, logs, evaluations, KL warning signs, stop rules,
checkpoints). docs/design.md draws the data path of one step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from klgrpo.config.schema import GRPOConfig
from klgrpo.core.batch import StepBatch
from klgrpo.errors import ConfigError, warn
from klgrpo.run.evaluation import load_eval_sets
from klgrpo.run.loop import TrainingRun
from klgrpo.train.building import run_dir_for, seed_everything
from klgrpo.train.distributed import Distributed
from klgrpo.train.engine import start_engine
from klgrpo.train.step import GRPOStep
from klgrpo.train.step_build import GivenParts, build_step


class GRPOTrainer:
    """Train ``config.model`` with GRPO and the configured KL; ``train()`` returns the run summary.

    ``grpo_step`` (a GRPOStep) and ``run`` (a TrainingRun) are its two parts; ``model``, ``tokenizer``,
    ``reference``, ``controller``, ``optimizer`` and ``step`` (updates done) are the step's live objects."""

    def __init__(self, config: GRPOConfig, *, model=None, tokenizer=None, train_dataset=None,
                 eval_sets: dict[str, Any] | None = None, loss_fn=None, log=print):
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # per-shard save/load bars would break the step progress bar
        self.cfg = cfg = config
        self.log = log
        self.warnings = config.validate(dataset_given=train_dataset is not None)
        for w in self.warnings:
            warn(w)
        if cfg.train.torch_threads:
            torch.set_num_threads(cfg.train.torch_threads)
        self.dist = Distributed(cfg.train.dist_timeout_s)
        self.engine = start_engine()  # DDP / FSDP2 / DeepSpeed from `accelerate launch`, or nothing
        self.engine.check(cfg)
        if cfg.rollout.prompts_per_step % self.dist.world_size:
            raise ConfigError(f"rollout.prompts_per_step={cfg.rollout.prompts_per_step} must be divisible by the "
                              f"{self.dist.world_size} processes, so every prompt's group stays on one process")
        seed_everything(cfg.train.seed + self.dist.rank)  # rank 0 samples exactly as a single process would
        self.run_dir = Path(self.dist.gather_objects(str(run_dir_for(cfg)))[0])  # rank 0's name (it has a timestamp)
        eval_sets = eval_sets if eval_sets is not None else load_eval_sets(cfg)
        given = GivenParts(model=model, tokenizer=tokenizer, train_dataset=train_dataset, loss_fn=loss_fn)
        self.grpo_step: GRPOStep = build_step(cfg, self.dist, self.engine, self.run_dir, given, log=log)
        self.run = TrainingRun(self.grpo_step, self.run_dir, eval_sets, cfg, self.dist, log=log)

    # ---------------------------------------------------------------------------------- the live objects
    @property
    def model(self):
        return self.grpo_step.model

    @property
    def tokenizer(self):
        return self.grpo_step.tokenizer

    @property
    def reference(self):
        return self.grpo_step.reference

    @property
    def controller(self):
        return self.grpo_step.controller

    @property
    def optimizer(self):
        return self.grpo_step.optimizer

    @property
    def device(self) -> torch.device:
        return self.grpo_step.device

    @property
    def step(self) -> int:
        """Optimizer updates done."""
        return self.grpo_step.completed

    # ------------------------------------------------------------------------------------------- the work
    def make_batch(self) -> StepBatch:
        """A rollout with rewards, advantages and reference log-probs, without updating."""
        return self.grpo_step.make_batch()

    def train_step(self) -> dict[str, float]:
        """Generate when needed, then one optimizer update and the controller's; returns the step's metrics."""
        return self.run.train_step()[0]

    def evaluate(self) -> dict[str, float]:
        return self.run.evaluate()

    def save(self, whole: bool = False) -> Path:
        return self.run.save(whole)

    def resume(self, resume: str) -> None:
        self.run.resume(resume)

    def train(self, resume: str | None = None, overwrite: bool = False,
              summary_extras: Callable[[dict], dict] | None = None) -> dict[str, Any]:
        """Run to train.steps. A fresh run refuses a folder that holds a run unless ``overwrite``; ``resume``
        ("latest" or a checkpoint folder) continues one. ``summary_extras(summary)`` returns fields to add to
        the summary before summary.json is written (the demo's)."""
        return self.run.train(resume, overwrite, summary_extras)
