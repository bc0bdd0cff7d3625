"""The policy as a trainer needs it: loaded (folder, hub name or GGUF file) or given, dropout off, LoRA-wrapped
and gradient-checkpointed as its settings say, in train mode."""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from klgrpo.backends.hf import load_causal_lm, load_tokenizer, resolve_dtype
from klgrpo.backends.lora import LoraSettings, apply_lora


class PolicySettings(Protocol):
    """What loading the policy reads (a ModelConfig)."""

    name_or_path: str
    tokenizer: str
    gguf_file: str
    dtype: str
    trust_remote_code: bool
    gradient_checkpointing: bool
    lora: LoraSettings


def load_policy(settings: PolicySettings, device: torch.device, log: Callable[[str], None] | None = None,
                model=None, tokenizer=None):
    """(tokenizer, policy): ``model`` / ``tokenizer`` when given, else loaded from ``settings``. ``log`` (None:
    silent) announces a load."""
    dtype = resolve_dtype(settings.dtype, device)
    if model is None and log is not None:
        log(f"loading {settings.name_or_path} ({dtype}, {device})")
    own_tokenizer = bool(settings.tokenizer)
    tokenizer = tokenizer or load_tokenizer(settings.tokenizer or settings.name_or_path,
                                            settings.trust_remote_code,
                                            gguf_file="" if own_tokenizer else settings.gguf_file,
                                            field="model.tokenizer" if own_tokenizer else "model.name_or_path")
    model = model.to(device) if model is not None else load_causal_lm(
        settings.name_or_path, settings, device, dtype, gguf_file=settings.gguf_file)
    disable_dropout(model)
    if settings.lora.r > 0:
        model = apply_lora(model, settings.lora)
    if settings.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    return tokenizer, model


def load_reference_model(path: str, settings: PolicySettings, device: torch.device, policy):
    """The reference's own weights (kl.reference), in the policy's dtype, frozen by the reference that wraps them."""
    dtype = next(policy.parameters()).dtype
    return load_causal_lm(path, settings, device, dtype, field="kl.reference")


def disable_dropout(model) -> None:
    """Dropout off, so the log-probs of the rollout policy equal the old log-probs of the first update."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
