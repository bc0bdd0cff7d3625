"""What a GRPOTrainer is built from: the policy and its tokenizer, the reference, AdamW and its schedule, the
seeds, the run folder's name (klgrpo/train/trainer.py composes them)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Callable

import torch

from klgrpo.backends.hf import load_causal_lm, load_tokenizer, resolve_dtype
from klgrpo.core.reference import FrozenCopyReference
from klgrpo.train.config import LR_SCHEDULES, GRPOConfig, OptimConfig
from klgrpo.train.run_folder import timestamped_run_dir


def load_policy(cfg: GRPOConfig, device: torch.device, log: Callable[[str], None] | None = None, model=None,
                tokenizer=None):
    """(tokenizer, policy): given or loaded (folder, hub name or GGUF file), dropout off, LoRA-wrapped and
    gradient-checkpointed as configured, in train mode. ``log`` (None: silent) announces a load."""
    dtype = resolve_dtype(cfg.model.dtype, device)
    if model is None and log is not None:
        log(f"loading {cfg.model.name_or_path} ({dtype}, {device})")
    own_tokenizer = bool(cfg.model.tokenizer)
    tokenizer = tokenizer or load_tokenizer(cfg.model.tokenizer or cfg.model.name_or_path,
                                            cfg.model.trust_remote_code,
                                            gguf_file="" if own_tokenizer else cfg.model.gguf_file,
                                            field="model.tokenizer" if own_tokenizer else "model.name_or_path")
    model = model.to(device) if model is not None else load_causal_lm(
        cfg.model.name_or_path, cfg.model, device, dtype, gguf_file=cfg.model.gguf_file)
    disable_dropout(model)
    if cfg.model.lora.r > 0:
        from klgrpo.backends.lora import apply_lora

        model = apply_lora(model, cfg.model.lora)
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    return tokenizer, model


def build_optimizer(model, o: OptimConfig, device: torch.device) -> torch.optim.Optimizer:
    trainable = [p for p in model.parameters() if p.requires_grad]
    # One fused kernel over all parameters instead of a loop of small ops per tensor (0.45 ms of a 38 ms step
    # for the demo-size model on the CPU); its rounding differs from the loop's by at most an ulp or so.
    fused = device.type in ("cpu", "cuda") and all(p.is_floating_point() for p in trainable)
    return torch.optim.AdamW(trainable, lr=o.lr, betas=(o.beta1, o.beta2), weight_decay=o.weight_decay,
                             fused=fused or None)


def build_reference(cfg: GRPOConfig, model, device: torch.device):
    """The frozen reference: the policy with its adapter off (LoRA), the model at kl.reference, or a copy."""
    ref_path = cfg.kl.reference
    if cfg.model.lora.r > 0 and not ref_path:
        from klgrpo.core.reference import AdapterDisabledReference

        return AdapterDisabledReference(model, cfg.model.fast_path)
    if ref_path:
        dtype = next(model.parameters()).dtype
        ref_model = load_causal_lm(ref_path, cfg.model, device, dtype, field="kl.reference")
        return FrozenCopyReference(ref_model, cfg.model.fast_path)
    return FrozenCopyReference.copy_of(model, cfg.model.fast_path)


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


def disable_dropout(model) -> None:
    """Dropout off, so the log-probs of the rollout policy equal the old log-probs of the first update."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0


def make_scheduler(optimizer, cfg: GRPOConfig):
    from transformers import get_scheduler

    name = LR_SCHEDULES[cfg.optim.schedule]
    return get_scheduler(name, optimizer, num_warmup_steps=cfg.optim.warmup_steps,
                         num_training_steps=cfg.train.steps)


def run_dir_for(cfg: GRPOConfig) -> Path:
    if cfg.train.output_dir:
        return Path(cfg.train.output_dir)
    return Path("runs") / cfg.train.run_name if cfg.train.run_name else timestamped_run_dir()
