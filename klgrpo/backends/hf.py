"""The transformers backend: loading a causal LM and its tokenizer, device and dtype resolution."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from klgrpo.errors import ConfigError

if TYPE_CHECKING:
    from klgrpo.train.config import ModelConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: model.dtype's values: "auto" (bfloat16 on a GPU that supports it, else float32) or a name above.
DTYPE_NAMES = ("auto", *_DTYPES)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(name)
    except RuntimeError:
        raise ConfigError(f"model.device={name!r} is not a torch device; use auto, cpu, cuda or cuda:N") from None


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    return _DTYPES[name]


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False):
    """AutoTokenizer with left padding (generation) and a pad token (eos when the tokenizer has none)."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load a tokenizer from {name_or_path!r} (model.tokenizer / model.name_or_path): "
                          f"{str(exc).splitlines()[0]}") from None
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_causal_lm(name_or_path: str, cfg: "ModelConfig", device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(
            name_or_path, dtype=dtype, trust_remote_code=cfg.trust_remote_code
        )
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load a causal LM from {name_or_path!r} (model.name_or_path): "
                          f"{str(exc).splitlines()[0]}") from None
    return model.to(device)
