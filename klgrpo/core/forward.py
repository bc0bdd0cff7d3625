"""The policy's forward pass over a rollout: per-token log-probs (and entropy) of the completion tokens.

Policy and reference both go through :func:`completion_logprobs`, so at equal weights their log-probs, and the
KL between them, are exactly equal.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from klgrpo.backends.kv_decoder import KVSampler, decoder_parts
from klgrpo.math.logprobs import token_logprobs, token_logprobs_and_entropy

if TYPE_CHECKING:
    from klgrpo.core.rollout import RolloutBatch


#: model.forward's choices: ``fast`` (klgrpo's teacher-forced decoder, each prompt once per group, where
#: ``teacher_forcing_model`` allows it), ``transformers`` (the model's own forward with the attention implementation
#: it was loaded with: SDPA by default), ``auto`` (``MEASURED_FASTER``). Both feed the same
#: blocked log-prob head (klgrpo.math.logprobs).
FORWARDS = ("auto", "fast", "transformers")
#: model.forward auto: the forward measured faster (update plus reference) per device type by
#: benchmarks/forward_choice.py, whose results files (benchmarks/results/forward_choice_<device>.json) a test
#: holds this table to. A device type without a measurement keeps the fast path, as before the choice existed.
MEASURED_FASTER = {"cpu": "fast"}


def uses_fast_forward(choice: str, fast_path: bool, device_type: str) -> bool:
    """Whether the training forward and the reference run klgrpo's decoder: model.forward ``choice`` resolved for
    ``device_type`` ("cpu", "cuda"...); model.fast_path false means transformers everywhere, whatever the choice."""
    if not fast_path or choice == "transformers":
        return False
    if choice == "auto":
        return MEASURED_FASTER.get(device_type, "fast") == "fast"
    return True


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Positions that skip left padding, as transformers' generate assigns them."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def completion_logprobs(
    model,
    batch: "RolloutBatch",
    temperature: float,
    rows: slice | Tensor | None = None,
    with_entropy: bool = False,
    fast_path: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """log pi(y_t | prefix) for the completion tokens of ``batch`` (optionally a subset of rows), [b, T].

    One forward over prompt + completion; logits at positions P-1 .. P+T-2 predict the T completion tokens.
    With ``fast_path`` (model.fast_path), for the architectures klgrpo's decoder reproduces
    (``teacher_forcing_model``), that forward is the decoder's layer code run with each distinct prompt once
    (``KVSampler.teacher_forced_logits``); else the model's own forward.
    """
    input_ids, attention_mask = batch.input_ids, batch.attention_mask
    completion_ids = batch.completion_ids
    if rows is not None:
        input_ids, attention_mask, completion_ids = input_ids[rows], attention_mask[rows], completion_ids[rows]
    t = completion_ids.shape[1]
    base = teacher_forcing_model(model, input_ids.shape[1]) if fast_path else None
    if base is not None:
        p = input_ids.shape[1] - t
        prompts, masks, g = _distinct_prompts(input_ids[:, :p], attention_mask[:, :p], batch.group_size)
        if g > 1:  # rows hold whole groups: one prompt pass per group; otherwise nothing to share
            return _shared_prompt_logprobs(base, model is not base, prompts, masks, completion_ids, g, temperature,
                                           with_entropy)
    # Only the last T + 1 positions' logits are needed: no output-layer work on the prompt.
    out = model(input_ids=input_ids, attention_mask=attention_mask,
                position_ids=position_ids_from_mask(attention_mask), use_cache=False, logits_to_keep=t + 1)
    logits = out.logits[:, :-1]
    if with_entropy:
        return token_logprobs_and_entropy(logits, completion_ids, temperature)
    return token_logprobs(logits, completion_ids, temperature), None


def teacher_forcing_model(model, total_len: int):
    """The log-prob fast path's capability check: the model whose layers klgrpo's decoder runs for
    ``completion_logprobs`` (the wrapped one when ``model`` is torch.compile's wrapper), or None where the model's
    own forward must run: an architecture the decoder does not reproduce, a wrapper that hides the model (DDP,
    DeepSpeed), gradient checkpointing (the decoder keeps every activation) or attention dropout while training
    (the decoder has none)."""
    base = model._orig_mod if isinstance(model, torch._dynamo.eval_frame.OptimizedModule) else model
    if base.training and getattr(getattr(base, "config", None), "attention_dropout", 0.0):
        return None
    if any(getattr(m, "gradient_checkpointing", False) for m in base.modules()):
        return None
    return base if decoder_parts(base, total_len) is not None else None


def _teacher_forced_logits(model, prompts: Tensor, masks: Tensor, completion_ids: Tensor, group_size: int):
    loop = KVSampler.for_model(model, prompts.shape[1] + completion_ids.shape[1], fuse=False)
    return loop.teacher_forced_logits(prompts, masks, completion_ids, group_size)


_compiled_teacher_forced_logits = None


def _distinct_prompts(prompt_ids: Tensor, prompt_mask: Tensor, group_size: int) -> tuple[Tensor, Tensor, int]:
    """(prompts, masks, G): each prompt once when the rows hold whole groups of G copies, else every row (G=1)."""
    g = group_size
    if g > 1 and prompt_ids.shape[0] % g == 0:
        ids, mask = prompt_ids[::g], prompt_mask[::g]
        if torch.equal(ids.repeat_interleave(g, 0), prompt_ids) and torch.equal(mask.repeat_interleave(g, 0),
                                                                                prompt_mask):
            return ids, mask, g
    return prompt_ids, prompt_mask, 1


def _shared_prompt_logprobs(model, compiled: bool, prompts: Tensor, masks: Tensor, completion_ids: Tensor, g: int,
                            temperature: float, with_entropy: bool):
    """completion_logprobs through ``KVSampler.teacher_forced_logits``: the G rows of a group share one prompt
    pass (``prompts``/``masks`` hold each prompt once); ``compiled``: that function under torch.compile
    (train.compile), built once per process."""
    global _compiled_teacher_forced_logits
    forward = _teacher_forced_logits
    if compiled:
        if _compiled_teacher_forced_logits is None:
            _compiled_teacher_forced_logits = torch.compile(_teacher_forced_logits)
        forward = _compiled_teacher_forced_logits
    first, rest = forward(model, prompts, masks, completion_ids, g)
    per_position = token_logprobs_and_entropy if with_entropy else token_logprobs
    parts = [per_position(first[:, None], completion_ids[:, :1], temperature)]
    if rest is not None:
        parts.append(per_position(rest, completion_ids[:, 1:], temperature))
    if not with_entropy:
        return torch.cat(parts, dim=1), None
    return torch.cat([lp for lp, _ in parts], dim=1), torch.cat([ent for _, ent in parts], dim=1)
