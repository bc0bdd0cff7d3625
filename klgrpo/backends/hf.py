"""The transformers backend: loading a causal LM and its tokenizer, device and dtype resolution."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from klgrpo.errors import ConfigError

if TYPE_CHECKING:
    from klgrpo.train.config import ModelConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"model.device={name!r} is not a torch device; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"model.device={name!r} but torch finds no CUDA GPU; use --model.device cpu or auto")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"model.device={name!r} but only {torch.cuda.device_count()} CUDA GPU(s) exist; "
                              f"use cuda:0..cuda:{torch.cuda.device_count() - 1} or auto")
    elif device.type == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise ConfigError(f"model.device={name!r} but MPS is not available; use --model.device cpu or auto")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    return _DTYPES[name]


def looks_like_local_path(name: str) -> bool:
    """A hub id is "name" or "org/name"; a path starts with / . ~ or has more parts, or its first part exists."""
    from pathlib import Path

    text = str(name)
    if text.startswith(("/", ".", "~")) or text.count("/") > 1 or "\\" in text:
        return True
    first = text.split("/", 1)[0]
    return "/" in text and Path(first).is_dir()


def check_local_model_path(name_or_path: str, field: str) -> None:
    """A mistyped local folder gets "no such folder", not the hub's repo-id text."""
    from pathlib import Path

    path = Path(str(name_or_path)).expanduser()
    if looks_like_local_path(name_or_path) and not path.exists():
        raise ConfigError(f"{field} {name_or_path!r}: no such folder (relative paths start at {Path.cwd()}); "
                          f"check the path, or give a hub model name such as Qwen/Qwen2.5-0.5B-Instruct")
    if path.is_file():
        raise ConfigError(f"{field} {name_or_path!r} is a file; give the model's folder (the one with config.json)")


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False, field: str = "model.name_or_path"):
    """AutoTokenizer with left padding (generation) and a pad token (eos when the tokenizer has none)."""
    from transformers import AutoTokenizer

    check_local_model_path(name_or_path, field)
    try:
        tok = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load a tokenizer from {name_or_path!r} ({field}): "
                          f"{_first_line(exc)}") from None
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_causal_lm(name_or_path: str, cfg: "ModelConfig", device: torch.device, dtype: torch.dtype,
                   field: str = "model.name_or_path"):
    from transformers import AutoModelForCausalLM

    check_local_model_path(name_or_path, field)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            name_or_path, dtype=dtype, trust_remote_code=cfg.trust_remote_code
        )
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load a causal LM from {name_or_path!r} ({field}): "
                          f"{_first_line(exc)}") from None
    return model.to(device)


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
