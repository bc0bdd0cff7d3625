"""Loading the policy and tokenizer, and the one forward pass that turns a batch into per-token log-probs."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from klgrpo.errors import ConfigError
from klgrpo.math.logprobs import token_logprobs, token_logprobs_and_entropy

if TYPE_CHECKING:
    from klgrpo.config import ModelConfig
    from klgrpo.rollout import RolloutBatch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Positions that skip left padding, as transformers' generate assigns them."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def completion_logprobs(
    model,
    batch: "RolloutBatch",
    temperature: float,
    rows: slice | Tensor | None = None,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """log pi(y_t | prefix) for the completion tokens of ``batch`` (optionally a subset of rows), [b, T].

    One forward over prompt + completion; logits at positions P-1 .. P+T-2 predict the T completion tokens.
    """
    input_ids, attention_mask = batch.input_ids, batch.attention_mask
    completion_ids = batch.completion_ids
    if rows is not None:
        input_ids, attention_mask, completion_ids = input_ids[rows], attention_mask[rows], completion_ids[rows]
    t = completion_ids.shape[1]
    # Only the last T + 1 positions' logits are needed: no output-layer work on the prompt.
    out = model(input_ids=input_ids, attention_mask=attention_mask,
                position_ids=position_ids_from_mask(attention_mask), use_cache=False, logits_to_keep=t + 1)
    logits = out.logits[:, :-1]
    if with_entropy:
        return token_logprobs_and_entropy(logits, completion_ids, temperature)
    return token_logprobs(logits, completion_ids, temperature), None
