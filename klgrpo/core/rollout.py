"""Group sampling: G completions per prompt, masks and truncation flags.

``generate_groups`` encodes the prompts, hands them to a sampler (klgrpo/backends/samplers.py: klgrpo's KV-cached
loop, transformers' generate with a dynamic or a static cache; ``SamplingParams.sampler`` names it, "auto" picks
the fastest for the device), and turns its completion ids into the padded batch with masks through the first EOS.
``warm_up_sampler`` compiles, before a run's first batch, every shape a compiling sampler will meet.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from klgrpo.backends.samplers import SamplingParams, resolve_sampler
from klgrpo.backends.sampling import SampledRollout, SamplingFilters
from klgrpo.errors import ConfigError, KLGRPOError
from klgrpo.math.truncation import settled_counts

__all__ = ["EncodedPrompts", "PromptTooLong", "RolloutBatch", "SamplingParams", "batch_widths", "compiling_sampler",
           "completion_mask_from_ids", "encode_groups", "encode_prompts", "eos_token_ids", "generate_groups",
           "grouped_batch", "sample_encoded", "warm_up_sampler"]


class PromptTooLong(ConfigError):
    """A prompt plus max_new_tokens does not fit the model's context (transformers only warns, then samples from
    positions the model never saw). ``index``: the prompt's position in the call's list."""

    def __init__(self, index: int, tokens: int, max_new_tokens: int, limit: int):
        self.index, self.tokens, self.max_new_tokens, self.limit = index, tokens, max_new_tokens, limit
        super().__init__(f"a prompt has {tokens} tokens: with max_new_tokens={max_new_tokens} it needs "
                         f"{tokens + max_new_tokens} positions, more than the model's context of {limit} "
                         f"(max_position_embeddings)")


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
    sampler_logp     [B, T] the sampler's own log-prob of each sampled token (log mu, float32; 0 after EOS), or
                     None where the sampler gives none: what the sampler-mismatch metrics and correction read
    filters          the distribution the sampler drew from (temperature, top-k, top-p, min-p)
    weights_version  the version of the policy's weights that drew the completions (``Sampler.sync_weights``)
    kept_count       [B, T] int32 under a filter that truncates: the size of the kept set each token was drawn
                     from (klgrpo.math.truncation; 0: the whole vocabulary, as after EOS), as the sampler recorded
                     it or, where it records none, rebuilt from the filters on the policy's logits (step's
                     ``truncation``); None without truncation
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
    sampler_logp: Tensor | None = None
    filters: SamplingFilters = SamplingFilters()
    weights_version: int = 0
    kept_count: Tensor | None = None

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


def context_overflow(model, tokenizer, texts: list[str], max_new_tokens: int) -> tuple[int, int, int] | None:
    """(index of the longest text, its tokens, the model's context) when that text plus ``max_new_tokens`` needs
    more positions than the model has (max_position_embeddings: transformers only warns, then samples from
    positions the model never saw); None when everything fits or the model names no limit."""
    if _context_limit(model) is None or not texts:
        return None
    return _overflow(model, [len(ids) for ids in tokenizer(texts)["input_ids"]], max_new_tokens)


def _context_limit(model) -> int | None:
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return limit if isinstance(limit, int) and limit > 0 else None


def _overflow(model, lengths: list[int], max_new_tokens: int) -> tuple[int, int, int] | None:
    limit = _context_limit(model)
    if limit is None or not lengths:
        return None
    worst = max(range(len(lengths)), key=lengths.__getitem__)
    return (worst, int(lengths[worst]), limit) if lengths[worst] + max_new_tokens > limit else None


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


#: A log-probability above this is impossible (a probability above 1), not rounding: log of a float32
#: probability rounded up from 1 is at most ~1e-7.
MAX_LOGPROB = 1e-5


def check_sampler_logprobs(logp: Tensor, completion_ids: Tensor, completion_mask: Tensor, sampler: str) -> None:
    """Refuse, in one line naming the sampler, log-probs that cannot be a distribution's: of another shape than the
    sampled ids, NaN or infinite, or above 0, at any completion token. Never averaged into a metric or a weight."""
    if logp.shape != completion_ids.shape:
        raise KLGRPOError(f"rollout.sampler {sampler} returned log-probs of shape {tuple(logp.shape)} for "
                          f"completions of shape {tuple(completion_ids.shape)}: one log-prob per sampled token is "
                          f"needed; report this sampler, or set rollout.sampler kv_loop")
    values = logp.detach().float()[completion_mask.to(logp.device)]
    bad = ~torch.isfinite(values)
    what = "NaN or infinite" if bool(bad.any()) else "above 0" if bool((values > MAX_LOGPROB).any()) else ""
    if what:
        count = int(bad.sum()) if what.startswith("NaN") else int((values > MAX_LOGPROB).sum())
        raise KLGRPOError(f"rollout.sampler {sampler} returned {count} log-prob(s) {what} of {values.numel()} "
                          f"sampled tokens: a log-probability is finite and <= 0; the step was not taken (check the "
                          f"sampler's model and dtype, or set rollout.sampler kv_loop)")


@dataclass
class EncodedPrompts:
    """A rollout's prompts as a sampler takes them: each distinct prompt once, left-padded (``ids``, ``mask`` [N,
    P]), with what turns the sampler's completions into the batch (the prompts as given, the EOS and pad ids)."""

    prompts: list
    ids: Tensor
    mask: Tensor
    eos_ids: list[int]
    pad_id: int

    @property
    def width(self) -> int:
        return self.ids.shape[1]


def encode_groups(model, tokenizer, prompts: list, params: SamplingParams) -> EncodedPrompts:
    """The prompts of one rollout encoded for a sampler on ``model``'s device; PromptTooLong where one does not fit
    the model's context with ``params.max_new_tokens``."""
    texts = encode_prompts(tokenizer, prompts, params.system_prompt, params.as_chat)
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    if (over := _overflow(model, enc["attention_mask"].sum(-1).tolist(), params.max_new_tokens)) is not None:
        raise PromptTooLong(*over[:2], params.max_new_tokens, over[2])
    device = next(model.parameters()).device
    return EncodedPrompts(prompts=list(prompts), ids=enc["input_ids"].to(device),
                          mask=enc["attention_mask"].to(device), eos_ids=eos_token_ids(model, tokenizer),
                          pad_id=tokenizer.pad_token_id)


@torch.no_grad()
def sample_encoded(model, encoded: EncodedPrompts, params: SamplingParams) -> tuple[SampledRollout, str]:
    """(``params.sampler``'s draw for ``encoded``, the name of the sampler that drew it: transformers' generate
    where the one named cannot reproduce the call), the model in eval mode while it runs."""
    sampler, opened = resolve_sampler(params.sampler, model, encoded.width + params.max_new_tokens, params)
    was_training = model.training
    model.eval()
    try:
        sampled = sampler.sample(model, encoded.ids, encoded.mask, params, encoded.pad_id, encoded.eos_ids)
    finally:
        model.train(was_training)
        if opened:  # a sampler named for this call alone (not a run's): closed with it
            sampler.close()
    return sampled, sampler.name or str(params.sampler)


@torch.no_grad()
def generate_groups(model, tokenizer, prompts: list, params: SamplingParams) -> RolloutBatch:
    """Sample ``params.group_size`` completions for each prompt with ``params.sampler``; returns the padded batch
    with its masks."""
    encoded = encode_groups(model, tokenizer, prompts, params)
    sampled, sampler_name = sample_encoded(model, encoded, params)
    return grouped_batch(model, tokenizer, encoded, sampled, params.group_size, sampler_name)


def grouped_batch(model, tokenizer, encoded: EncodedPrompts, sampled: SampledRollout, group_size: int,
                  sampler_name: str) -> RolloutBatch:
    """The padded batch of ``sampled``'s completions of ``encoded``: G rows a prompt, masks through the first EOS,
    the decoded texts, the sampler's log-probs checked (``check_sampler_logprobs``, naming ``sampler_name``) and 0
    after EOS, its kept sets settled."""
    device = encoded.ids.device
    prompt_ids = encoded.ids.repeat_interleave(group_size, dim=0)
    prompt_mask = encoded.mask.repeat_interleave(group_size, dim=0)
    prompt_len, eos_ids = prompt_ids.shape[1], encoded.eos_ids
    completion_ids, sampler_logp = sampled.completion_ids.to(device), sampled.logp
    if completion_ids.shape[1] == 0:  # every row stopped at once: keep one (masked) column
        completion_ids = torch.full((prompt_ids.shape[0], 1), tokenizer.pad_token_id, device=device,
                                    dtype=prompt_ids.dtype)
        sampler_logp = None if sampler_logp is None else torch.zeros(completion_ids.shape, device=device)
    completion_mask, truncated = completion_mask_from_ids(completion_ids, eos_ids)
    if sampler_logp is not None:
        check_sampler_logprobs(sampler_logp, completion_ids, completion_mask, sampler_name)
        sampler_logp = sampler_logp.to(device, torch.float32).masked_fill(~completion_mask, 0.0)
    kept_count = sampled.kept_count if sampled.filters.truncates else None
    if kept_count is not None:  # a set as large as the vocabulary is no truncation: 0 says so, cheaply
        if kept_count.shape != completion_ids.shape:
            kept_count = torch.zeros(completion_ids.shape, dtype=torch.int32, device=device)
        kept_count = settled_counts(kept_count.to(device), completion_mask,
                                    model.get_output_embeddings().weight.shape[0])
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
        group_size=group_size,
        prompts=[prompt for prompt in encoded.prompts for _ in range(group_size)],
        completions=completions,
        sampler_logp=sampler_logp,
        filters=sampled.filters,
        weights_version=sampled.weights_version,
        kept_count=kept_count,
    )


def batch_widths(lengths: list[int], prompts_per_batch: int, padded_width) -> list[int]:
    """The padded widths a batch of ``prompts_per_batch`` of prompts with these token lengths can have: a batch is
    as wide as its longest prompt, which is at least the ``prompts_per_batch``-th shortest."""
    if not lengths:
        return []
    floor = sorted(lengths)[min(prompts_per_batch, len(lengths)) - 1]
    return sorted({padded_width(n) for n in lengths if n >= floor})


def compiling_sampler(model, params: SamplingParams):
    """``params.sampler`` when it compiles a kernel per input shape on ``model``'s device (``Sampler.compiles``),
    else None."""
    sampler, opened = resolve_sampler(params.sampler, model, 1, params)
    if sampler.compiles(model, params):
        return sampler
    if opened:
        sampler.close()
    return None


@torch.no_grad()
def warm_up_sampler(model, tokenizer, prompts: list, params: SamplingParams, prompts_per_batch: int,
                    announce=None) -> list[int]:
    """Compile now every shape the sampler will meet on batches of ``prompts_per_batch`` of ``prompts``, where it
    compiles one kernel per shape (transformers' static-cache generate on CUDA), so that no later step pays for a
    shape it meets for the first time. ``announce(widths)`` is called before the compiling starts. The random
    state is restored: the run samples what it would have sampled without the warm-up. Returns the widths
    compiled; [] where the sampler compiles nothing."""
    sampler = compiling_sampler(model, params)
    if sampler is None:
        return []
    texts = encode_prompts(tokenizer, prompts, params.system_prompt, params.as_chat)
    widths = batch_widths([len(ids) for ids in tokenizer(texts)["input_ids"]], prompts_per_batch,
                          sampler.padded_width)
    if announce is not None:
        announce(widths)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            for width in widths:
                sampler.warm_up(model, width, prompts_per_batch, params, tokenizer.pad_token_id,
                                eos_token_ids(model, tokenizer))
    finally:
        model.train(was_training)
    return widths


def longest_prompt_tokens(tokenizer, prompts, system_prompt: str = "", as_chat: bool = False,
                          candidates: int = 64) -> int:
    """Tokens of the longest prompt as a rollout encodes it; only the ``candidates`` longest by characters are
    tokenized (a large dataset costs no pass of the tokenizer), so a rare prompt could be longer: an estimate
    built on it stays low."""
    longest = sorted(prompts, key=lambda p: len(str(p)), reverse=True)[:candidates]
    if not longest:
        return 0
    texts = encode_prompts(tokenizer, longest, system_prompt, as_chat)
    return max(len(ids) for ids in tokenizer(texts)["input_ids"])
