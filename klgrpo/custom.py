"""Losses in the datum shape of hosted training APIs, run on a local transformers model.

    data = datums_from_batch(trainer.model, batch, temperature)      # a klgrpo StepBatch -> datums
    loss, metrics = forward_backward_custom(model, data, loss_fn)      # loss_fn(data, logprobs_list)

A :class:`Datum` holds ``model_input`` (the prompt's and the completion's token ids, [L]) and ``loss_fn_inputs``,
per-token tensors over the completion's n tokens, the last n of ``model_input``:

    target_tokens  [n] the completion tokens
    advantages     [n] the sequence's advantage on every token
    logprobs       [n] the sampling policy's log-probs
    ref_logprobs   [n] the reference's log-probs
    mask           [n] ones (the tokens that enter the loss)

``forward_backward_custom`` computes each datum's per-token log-probs of ``target_tokens`` under ``model`` (with
gradient), calls ``loss_fn(data, logprobs_list)``, back-propagates the loss and returns what the function
returned. The typed signature of the trainer is :class:`klgrpo.core.loss_api.LossInput` (docs/custom_loss.md).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from klgrpo.core.batch import StepBatch
from klgrpo.core.forward import completion_logprobs
from klgrpo.core.loss_api import Datum, LossInput, build_datums
from klgrpo.errors import DataError
from klgrpo.math.logprobs import token_logprobs

__all__ = ["Datum", "LossInput", "datum_logprobs", "datums_from_batch", "forward_backward_custom"]


def datum_logprobs(model, data: list[Datum], temperature: float = 1.0) -> list[Tensor]:
    """log pi(target_t | prefix) of every datum's targets ([n_i] each, in the graph): one right-padded forward."""
    device = next(model.parameters()).device
    lengths = [len(d.model_input) for d in data]
    n_targets = [_num_targets(d, i) for i, d in enumerate(data)]
    input_ids = torch.zeros(len(data), max(lengths), dtype=torch.long, device=device)
    attention_mask = torch.zeros_like(input_ids)
    for i, d in enumerate(data):
        input_ids[i, : lengths[i]] = d.model_input.to(device)
        attention_mask[i, : lengths[i]] = 1
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    out = []
    for i, (length, n) in enumerate(zip(lengths, n_targets)):
        # the logits at positions L-n-1 .. L-2 predict the last n tokens
        row_logits = logits[i : i + 1, length - n - 1 : length - 1]
        out.append(token_logprobs(row_logits, input_ids[i : i + 1, length - n : length], temperature)[0])
    return out


def forward_backward_custom(model, data: list[Datum], loss_fn: Callable, temperature: float = 1.0):
    """Call ``loss_fn(data, logprobs_list)`` with the current policy's log-probs, back-propagate its loss (the
    first element when it returns a tuple) into ``model``'s ``.grad`` and return its result unchanged."""
    if not data:
        raise DataError("forward_backward_custom got no datums; pass at least one")
    result = loss_fn(data, datum_logprobs(model, data, temperature))
    loss = result[0] if isinstance(result, tuple) else result
    if not isinstance(loss, Tensor) or loss.numel() != 1 or not loss.requires_grad:
        raise DataError(f"loss_fn must return (loss, metrics) with loss a scalar tensor that depends on "
                        f"logprobs_list, got {type(loss).__name__}")
    loss.backward()
    return result


@torch.no_grad()
def datums_from_batch(model, batch: StepBatch, temperature: float = 1.0) -> list[Datum]:
    """One datum per completion of ``batch`` with tokens in the loss (klgrpo.core.loss_api.build_datums: rows
    masked out entirely are skipped; the trainer's datum route builds the same datums).

    ``logprobs`` are the batch's sampling-policy log-probs (``batch.old_logp``; when the batch has not been
    trained on yet, ``model``'s log-probs now, which are the sampling policy's), ``ref_logprobs`` the reference's
    computed for the batch."""
    if batch.ref_logp is None:
        raise DataError("the batch has no reference log-probs: build it with a reference (kl.coef > 0 or "
                        "kl.monitor: true)")
    rollout = batch.rollout
    old = batch.old_logp
    if old is None:  # the model's own forward, as the datums' forward runs it: the first ratio is exactly 1
        old, _ = completion_logprobs(model, rollout, temperature, fast_path=False)
    data, _ = build_datums(rollout.completion_ids, batch.loss_mask, batch.advantages, old, batch.ref_logp,
                           rollout.input_ids[:, : rollout.prompt_len], rollout.attention_mask[:, : rollout.prompt_len])
    return data


def _num_targets(datum: Datum, index: int) -> int:
    targets = datum.loss_fn_inputs.get("target_tokens")
    if targets is None:
        raise DataError(f"datum {index} has no loss_fn_inputs['target_tokens']; add the completion's token ids")
    n, length = len(targets), len(datum.model_input)
    if not 0 < n < length or not torch.equal(datum.model_input[length - n:].cpu(), targets.cpu().long()):
        raise DataError(f"datum {index}: target_tokens must be the last {n} tokens of model_input (after at least "
                        f"one prompt token); got {n} targets for {length} input tokens")
    return n
