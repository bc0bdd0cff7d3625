"""The demo's tiny causal LM: a transformers Llama with random weights (about 132k parameters by default)."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from klgrpo.apps.demo.tokenizer import build_char_tokenizer


def build_tiny_model(
    vocab_size: int,
    seed: int,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    intermediate: int = 256,
    max_positions: int = 32,
    pad_token_id: int = 0,
    eos_token_id: int = 1,
    bos_token_id: int | None = None,
) -> LlamaForCausalLM:
    """A randomly initialised LlamaForCausalLM with tied input/output embeddings.

    The default special ids are those of :func:`klgrpo.apps.demo.tokenizer.build_char_tokenizer` (pad 0, eos 1,
    no bos). The initialisation draws from a private RNG seeded with ``seed``: the global torch RNG is
    left untouched and the same seed gives the same weights.
    """
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        intermediate_size=intermediate,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        bos_token_id=bos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        pad_token_id=pad_token_id, eos_token_id=eos_token_id, bos_token_id=bos_token_id, do_sample=False
    )
    return model


def build_tiny_model_for(tokenizer: PreTrainedTokenizerBase, seed: int, **sizes) -> LlamaForCausalLM:
    """:func:`build_tiny_model` with the vocabulary size and special ids read from ``tokenizer``."""
    return build_tiny_model(
        len(tokenizer),
        seed,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        **sizes,
    )


def save_tiny_model_and_tokenizer(path: str | Path, seed: int = 0, **sizes) -> Path:
    """Write a random-init tiny model (safetensors) and the char tokenizer into ``path``; returns ``path``.

    For tests anywhere in klgrpo that need a real local checkpoint: both load with
    ``AutoModelForCausalLM.from_pretrained(path)`` and ``AutoTokenizer.from_pretrained(path)``.
    """
    path = Path(path)
    tokenizer = build_char_tokenizer()
    model = build_tiny_model_for(tokenizer, seed, **sizes)
    with quiet_progress_bars():
        model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


@contextmanager
def quiet_progress_bars() -> Iterator[None]:
    """Silence transformers' progress bars inside the block (transformers 5 draws one for every
    save_pretrained/from_pretrained, even of a 0.5 MB model); the previous setting is restored."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
