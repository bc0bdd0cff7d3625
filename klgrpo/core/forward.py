"""The policy's forward pass over a rollout: per-token log-probs (and entropy) of the completion tokens.

Policy and reference both go through :func:`completion_logprobs`, so at equal weights their log-probs, and the
KL between them, are exactly equal.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
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
    kept_sets: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """log pi(y_t | prefix) for the completion tokens of ``batch`` (optionally a subset of rows), [b, T].

    One forward over prompt + completion; logits at positions P-1 .. P+T-2 predict the T completion tokens.
    With ``fast_path`` (model.forward), for the architectures klgrpo's decoder reproduces
    (``teacher_forcing_model``), that forward is the decoder's layer code run with each distinct prompt once
    (``KVSampler.teacher_forced_logits``); else the model's own forward. The rows run in chunks of similar
    completion length (``length_chunks``), each cut to its longest completion and its prompts' longest
    left padding removed: causal attention makes the cut positions irrelevant to the kept ones, so the
    log-probs of completion tokens are the same; positions past a row's completion read 0.
    ``kept_sets`` (the policy's side under truncated sampling): each position's softmax over the kept set its
    token was drawn from (``batch.kept_count``, klgrpo.math.truncation), not over the whole vocabulary.
    """
    input_ids, attention_mask = batch.input_ids, batch.attention_mask
    completion_ids, completion_mask = batch.completion_ids, batch.completion_mask
    kept = batch.kept_count if kept_sets else None
    if rows is not None:
        input_ids, attention_mask, completion_ids = input_ids[rows], attention_mask[rows], completion_ids[rows]
        completion_mask = completion_mask[rows]
        kept = None if kept is None else kept[rows]
    t = completion_ids.shape[1]
    p = input_ids.shape[1] - t
    base = teacher_forcing_model(model, input_ids.shape[1]) if fast_path else None
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):  # train.compile: one shape, no chunks
        return _forward_rows(model, base, input_ids, attention_mask, completion_ids, batch.group_size, temperature,
                             with_entropy, kept)
    hidden = getattr(getattr(model, "config", None), "hidden_size", None) or CHUNK_REFERENCE_HIDDEN
    chunks = length_chunks(completion_mask.sum(1), p, input_ids.device.type, hidden)
    parts = []
    for index, width in chunks:
        ids, mask = (input_ids, attention_mask) if index is None else (input_ids[index], attention_mask[index])
        first = _first_used_column(mask[:, :p])
        rows_kept = None if kept is None else kept[:, :width] if index is None else kept[index, :width]
        parts.append(_forward_rows(model, base, ids[:, first:p + width], mask[:, first:p + width],
                                   completion_ids[:, :width] if index is None else completion_ids[index, :width],
                                   batch.group_size, temperature, with_entropy, rows_kept))
    return _rows_in_order(parts, chunks, t, len(input_ids), with_entropy)


def _rows_in_order(parts: list, chunks: list, t: int, n_rows: int, with_entropy: bool
                   ) -> tuple[Tensor, Tensor | None]:
    """The chunks' (log-probs, entropy) back in the batch's row order, each padded with 0 to ``t`` positions."""
    if len(chunks) == 1:  # every row in order: only the cut-off positions to restore
        width = chunks[0][1]
        if width == t:
            return parts[0]
        return F.pad(parts[0][0], (0, t - width)), F.pad(parts[0][1], (0, t - width)) if with_entropy else None
    device = parts[0][0].device
    order = torch.cat([i if i is not None else torch.arange(n_rows, device=device) for i, _ in chunks])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(len(order), device=order.device)

    def joined(k: int) -> Tensor:
        return torch.cat([F.pad(part[k], (0, t - part[k].shape[1])) for part in parts])[inverse]

    return joined(0), joined(1) if with_entropy else None


#: A chunk's fixed cost (module calls, kernel launches) in row-positions' worth of work, per device type, for a
#: model of hidden size CHUNK_REFERENCE_HIDDEN: what a chunk of rows must save in padding to be worth running on
#: its own. On the CPU a position costs far more relative to a call than on a GPU, so the CPU splits more. A
#: narrower model's position costs less (about hidden^2 per layer), so its fixed cost counts for more positions.
CHUNK_OVERHEAD_POSITIONS = {"cpu": 64}
DEFAULT_CHUNK_OVERHEAD = 2048
CHUNK_REFERENCE_HIDDEN = 256


def length_chunks(lengths: Tensor, prompt_len: int, device_type: str,
                  hidden: int = CHUNK_REFERENCE_HIDDEN) -> list[tuple[Tensor | None, int]]:
    """[(row indices or None for all rows in order, width)]: the rows sorted by completion length and cut into
    chunks that minimise the padded positions, sum of rows x (prompt_len + width), plus a fixed cost per chunk
    (``CHUNK_OVERHEAD_POSITIONS``, scaled up for a model narrower than CHUNK_REFERENCE_HIDDEN); width is the
    chunk's longest completion (at least 1). Cuts fall on multiples of b/32 rows, so the search stays small."""
    b = lengths.numel()
    lengths_sorted, order = torch.sort(lengths, descending=True, stable=True)
    longest = [max(1, x) for x in lengths_sorted.tolist()]
    overhead = CHUNK_OVERHEAD_POSITIONS.get(device_type, DEFAULT_CHUNK_OVERHEAD)
    overhead *= max(1.0, (CHUNK_REFERENCE_HIDDEN / max(1, hidden)) ** 2)
    step = -(-b // 32)
    cuts = list(range(0, b, step)) + [b]
    best, back = [0.0] + [float("inf")] * (len(cuts) - 1), [0] * len(cuts)
    for j in range(1, len(cuts)):
        for i in range(j):
            cost = best[i] + (cuts[j] - cuts[i]) * (prompt_len + longest[cuts[i]]) + overhead
            if cost < best[j]:
                best[j], back[j] = cost, i
    spans, j = [], len(cuts) - 1
    while j > 0:
        spans.append((cuts[back[j]], cuts[j]))
        j = back[j]
    if len(spans) == 1:
        return [(None, longest[0])]
    return [(order[a:c], longest[a]) for a, c in reversed(spans)]


def _first_used_column(prompt_mask: Tensor) -> int:
    """The first prompt column some row uses (the columns before are every row's left padding)."""
    used = prompt_mask.any(0)
    return int(used.float().argmax()) if bool(used.any()) else 0


def _forward_rows(model, base, input_ids: Tensor, attention_mask: Tensor, completion_ids: Tensor, group_size: int,
                  temperature: float, with_entropy: bool, kept: Tensor | None = None
                  ) -> tuple[Tensor, Tensor | None]:
    """completion_logprobs of these rows at their full width: klgrpo's decoder (``base`` not None) where some
    rows share a prompt, else the model's forward."""
    t = completion_ids.shape[1]
    if base is not None:
        p = input_ids.shape[1] - t
        prompts, masks, sharing = _distinct_prompts(input_ids[:, :p], attention_mask[:, :p], group_size)
        if sharing is not None:  # one prompt pass per distinct prompt; otherwise nothing to share
            return _shared_prompt_logprobs(base, model is not base, prompts, masks, completion_ids, sharing,
                                           temperature, with_entropy, kept)
    # Only the last T + 1 positions' logits are needed: no output-layer work on the prompt.
    out = model(input_ids=input_ids, attention_mask=attention_mask,
                position_ids=position_ids_from_mask(attention_mask), use_cache=False, logits_to_keep=t + 1)
    logits = out.logits[:, :-1]
    if with_entropy:
        return token_logprobs_and_entropy(logits, completion_ids, temperature, kept_BT=kept)
    return token_logprobs(logits, completion_ids, temperature, kept_BT=kept), None


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


def _distinct_prompts(prompt_ids: Tensor, prompt_mask: Tensor,
                      group_size: int) -> tuple[Tensor, Tensor, int | Tensor | None]:
    """(prompts, masks, sharing): each prompt once, with ``sharing`` G when the rows hold whole groups of G
    copies, else the prompt index of each row when some rows share a prompt, else None (every row its own)."""
    g = group_size
    if g > 1 and prompt_ids.shape[0] % g == 0:
        ids, mask = prompt_ids[::g], prompt_mask[::g]
        if torch.equal(ids.repeat_interleave(g, 0), prompt_ids) and torch.equal(mask.repeat_interleave(g, 0),
                                                                                prompt_mask):
            return ids, mask, g
    p = prompt_ids.shape[1]
    distinct, index = torch.unique(torch.cat([prompt_ids, prompt_mask.long()], dim=1), dim=0, return_inverse=True)
    if distinct.shape[0] == prompt_ids.shape[0]:
        return prompt_ids, prompt_mask, None
    return distinct[:, :p], distinct[:, p:].to(prompt_mask.dtype), index


def _shared_prompt_logprobs(model, compiled: bool, prompts: Tensor, masks: Tensor, completion_ids: Tensor,
                            g: int | Tensor, temperature: float, with_entropy: bool, kept: Tensor | None = None):
    """completion_logprobs through ``KVSampler.teacher_forced_logits``: the rows of a prompt share one prompt
    pass (``prompts``/``masks`` hold each prompt once; ``g`` the group size or each row's prompt index);
    ``compiled``: that function under torch.compile (train.compile), built once per process."""
    global _compiled_teacher_forced_logits
    forward = _teacher_forced_logits
    if compiled:
        if _compiled_teacher_forced_logits is None:
            _compiled_teacher_forced_logits = torch.compile(_teacher_forced_logits)
        forward = _compiled_teacher_forced_logits
    first, rest = forward(model, prompts, masks, completion_ids, g)
    per_position = token_logprobs_and_entropy if with_entropy else token_logprobs
    parts = [per_position(first[:, None], completion_ids[:, :1], temperature,
                          kept_BT=None if kept is None else kept[:, :1])]
    if rest is not None:
        parts.append(per_position(rest, completion_ids[:, 1:], temperature,
                                  kept_BT=None if kept is None else kept[:, 1:]))
    if not with_entropy:
        return torch.cat(parts, dim=1), None
    return torch.cat([lp for lp, _ in parts], dim=1), torch.cat([ent for _, ent in parts], dim=1)
