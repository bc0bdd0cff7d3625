"""Group sampling: G completions per prompt, masks and truncation flags.

Sampling runs klgrpo's own KV-cached loop (``KVSampler``) when the model is a supported decoder (Llama,
Mistral, Qwen2, Qwen3; LoRA-wrapped or not), else transformers ``generate``. The loop draws each token from
softmax(logits / temperature) after the top-k and top-p filters, as ``generate`` with do_sample=True does,
without its per-step machinery (logits processors, stopping criteria, cache objects, mask builders), which
dominates the time of small models (0.6x of ``generate``'s time for the demo-size model on the CPU,
docs/benchmarks.md). It reads nothing else from ``model.generation_config`` (no repetition penalty, no
suppressed tokens), so the samples come from the very distribution whose log-probs the loss uses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from klgrpo.backends.kv_decoder import KVSampler


#: transformers ``generate``'s KV cache when klgrpo samples through it (``rollout.generate_cache``).
GENERATE_CACHES = ("dynamic", "static")


@dataclass(frozen=True)
class SamplingParams:
    """How ``generate_groups`` samples: the rollout settings of one call, by name.

    group_size      G, completions per prompt
    max_new_tokens  completion length limit; a row without EOS by then is truncated
    temperature     sample from softmax(logits / temperature); > 0
    top_p, top_k    nucleus and top-k filters (1.0 and 0: off)
    system_prompt   system message prepended to chat prompts
    as_chat         wrap string prompts as one user message and apply the tokenizer's chat template
    compiled        run the KV-cached loop's steps through torch.compile where the model allows it
    generate_cache  "dynamic": klgrpo's KV-cached loop where it reproduces the model (model.fast_path on), else
                    transformers' generate with its dynamic cache; "static": always transformers' generate with a
                    preallocated cache, which transformers compiles on CUDA (seconds once, then several times
                    faster than the loop there); the training log-probs keep model.fast_path either way
    """

    group_size: int
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    system_prompt: str = ""
    as_chat: bool = False
    compiled: bool = False
    generate_cache: str = "dynamic"


@dataclass
class RolloutBatch:
    """N prompts x G completions, laid out group after group (rows [g*G, (g+1)*G) share prompt g).

    Shapes: B = N * G rows, L = prompt_len + T, T = the longest completion (at most max_new_tokens).

    input_ids        [B, L] prompt (left-padded to prompt_len) followed by the completion (right-padded to T)
    attention_mask   [B, L] 1 on real prompt tokens and on completion tokens up to and including EOS
    completion_ids   [B, T] the sampled tokens (the pad id after EOS)
    completion_mask  [B, T] 1 on completion tokens up to and including the first EOS
    truncated        [B]    no EOS within max_new_tokens
    prompts          the B prompts as given (each repeated G times); completions: the B decoded texts
    """

    input_ids: Tensor
    attention_mask: Tensor
    completion_ids: Tensor
    completion_mask: Tensor
    truncated: Tensor
    prompt_len: int
    group_size: int
    prompts: list
    completions: list[str]

    @property
    def size(self) -> int:
        return self.completion_ids.shape[0]


def encode_prompts(tokenizer, prompts: list, system_prompt: str = "", as_chat: bool = False) -> list[str]:
    """Prompt texts: chat message lists (and strings when ``as_chat``) go through the tokenizer's chat template;
    other strings stay as they are."""
    texts = []
    for p in prompts:
        if as_chat and isinstance(p, str):
            p = [{"role": "user", "content": p}]
        if isinstance(p, list):
            messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + p
            if getattr(tokenizer, "chat_template", None):
                texts.append(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
            else:
                texts.append("\n".join(m["content"] for m in messages))
        else:
            texts.append(p)
    return texts


def eos_token_ids(model, tokenizer) -> list[int]:
    """The ids that end a completion, for sampling and greedy evaluation alike: every id in
    ``model.generation_config.eos_token_id`` (one id or a list, as chat models have) and
    ``tokenizer.eos_token_id``, in that order, without repeats."""
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def completion_mask_from_ids(completion_ids: Tensor, eos_ids: list[int]) -> tuple[Tensor, Tensor]:
    """Mask through the first EOS (inclusive) and the truncated flag (no EOS at all)."""
    is_eos = torch.zeros_like(completion_ids, dtype=torch.bool)
    for e in eos_ids:
        is_eos |= completion_ids == e
    # Number of EOS strictly before position t: positions after the first EOS have >= 1.
    eos_before = torch.cumsum(is_eos.long(), dim=-1) - is_eos.long()
    mask = eos_before == 0
    truncated = ~is_eos.any(dim=-1)
    return mask, truncated


@torch.no_grad()
def generate_groups(model, tokenizer, prompts: list, params: SamplingParams) -> RolloutBatch:
    """Sample ``params.group_size`` completions for each prompt; returns the padded batch with its masks.

    The KV-cached loop (klgrpo.backends.kv_decoder) runs for the architectures it reproduces unless
    model.fast_path is off; else transformers ``generate``."""
    p = params
    texts = encode_prompts(tokenizer, prompts, p.system_prompt, p.as_chat)
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    device = next(model.parameters()).device
    unique_ids, unique_mask = enc["input_ids"].to(device), enc["attention_mask"].to(device)
    prompt_ids = unique_ids.repeat_interleave(p.group_size, dim=0)
    prompt_mask = unique_mask.repeat_interleave(p.group_size, dim=0)
    prompt_len = prompt_ids.shape[1]
    eos_ids = eos_token_ids(model, tokenizer)
    was_training = model.training
    model.eval()
    try:
        loop = (KVSampler.for_model(model, prompt_len + p.max_new_tokens)
                if p.temperature > 0 and p.generate_cache != "static" else None)
        if loop is not None:  # the loop runs each distinct prompt once, then its G copies share the cache
            completion_ids = loop.sample(unique_ids, unique_mask, p.max_new_tokens, p.temperature, p.top_p, p.top_k,
                                         tokenizer.pad_token_id, eos_ids, p.group_size, p.compiled)
        else:
            out = model.generate(
                input_ids=prompt_ids, attention_mask=prompt_mask, do_sample=True, temperature=p.temperature,
                top_p=p.top_p, top_k=p.top_k, max_new_tokens=p.max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                eos_token_id=eos_ids, **({"cache_implementation": "static"} if p.generate_cache == "static" else {}),
            )
            completion_ids = out[:, prompt_len:]
    finally:
        model.train(was_training)
    if completion_ids.shape[1] == 0:  # every row stopped at once: keep one (masked) column
        completion_ids = torch.full((prompt_ids.shape[0], 1), tokenizer.pad_token_id, device=device,
                                    dtype=prompt_ids.dtype)
    completion_mask, truncated = completion_mask_from_ids(completion_ids, eos_ids)
    # Tokens after EOS are padding: give them a harmless id and no attention.
    completion_ids = torch.where(completion_mask, completion_ids, torch.full_like(completion_ids,
                                                                                  tokenizer.pad_token_id))
    # The mask is a prefix of each row (through the first EOS): one batch_decode of the rows cut to their lengths.
    rows, lengths = completion_ids.tolist(), completion_mask.sum(-1).tolist()
    completions = tokenizer.batch_decode([row[:n] for row, n in zip(rows, lengths)], skip_special_tokens=True)
    return RolloutBatch(
        input_ids=torch.cat([prompt_ids, completion_ids], dim=1),
        attention_mask=torch.cat([prompt_mask, completion_mask.to(prompt_mask.dtype)], dim=1),
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        truncated=truncated,
        prompt_len=prompt_len,
        group_size=p.group_size,
        prompts=[prompt for prompt in prompts for _ in range(p.group_size)],
        completions=completions,
    )


# ------------------------------------------------------------------------------------- the KV-cached loop
