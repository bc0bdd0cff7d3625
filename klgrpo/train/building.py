"""The training-side parts of a GRPOTrainer: AdamW and its schedule, the seeds, the run folder's name
(klgrpo/train/step_build.py composes them with the policy of backends/policy.py and the reference of
core/reference.py)."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from klgrpo.config.schema import LR_SCHEDULES, GRPOConfig, OptimConfig
from klgrpo.store.run_folder import timestamped_run_dir


def build_optimizer(model, o: OptimConfig, device: torch.device) -> torch.optim.Optimizer:
    trainable = [p for p in model.parameters() if p.requires_grad]
    # One fused kernel over all parameters instead of a loop of small ops per tensor (0.45 ms of a 38 ms step
    # for the demo-size model on the CPU); its rounding differs from the loop's by at most an ulp or so.
    fused = device.type in ("cpu", "cuda") and all(p.is_floating_point() for p in trainable)
    return torch.optim.AdamW(trainable, lr=o.lr, betas=(o.beta1, o.beta2), weight_decay=o.weight_decay,
                             fused=fused or None)


def base_model_path(model_cfg) -> str:
    """model.name_or_path, with model.gguf_file joined on (the spelling export_merged loads a GGUF base from)."""
    if model_cfg.gguf_file:
        return str(Path(model_cfg.name_or_path) / model_cfg.gguf_file)
    return model_cfg.name_or_path


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)  # seed + rank (+ a resume's offset) may pass numpy's upper bound
    except ImportError:
        pass


def make_scheduler(optimizer, cfg: GRPOConfig):
    from transformers import get_scheduler

    name = LR_SCHEDULES[cfg.optim.schedule]
    return get_scheduler(name, optimizer, num_warmup_steps=cfg.optim.warmup_steps,
                         num_training_steps=cfg.train.steps)


def run_dir_for(cfg: GRPOConfig) -> Path:
    if cfg.train.output_dir:
        return Path(cfg.train.output_dir)
    return Path("runs") / cfg.train.run_name if cfg.train.run_name else timestamped_run_dir()
