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

Built-in losses by name, as hosted APIs offer them beside the custom route:

    loss, metrics = forward_backward(model, data, loss_fn="ppo",
                                     loss_fn_config={"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})

``"ppo"`` is the trainer's clipped surrogate and ``"ppo_kl"`` adds its KL term (``kl_coef`` times the
configured estimator, importance-corrected as the trainer does); both are the trainer's own ``grpo_objective``
run on the datums, SUMMED over every datum's tokens (the datum convention: the trainer's objective with
``loss.aggregation: seq_mean_token_sum`` times the number of datums). :func:`builtin_loss` returns either as a
datum-shaped function, which also runs through ``forward_backward_custom`` or the trainer's ``loss_fn``.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from klgrpo.core.batch import StepBatch
from klgrpo.core.forward import completion_logprobs
from klgrpo.core.loss_api import Datum, LossInput, build_datums
from klgrpo.errors import ConfigError, DataError
from klgrpo.math.aggregation import Normalizer
from klgrpo.math.logprobs import token_logprobs
from klgrpo.math.objective import KLTerm, ObjectiveInputs, ObjectiveTerms, PolicyTerm, grpo_objective

__all__ = ["BUILTIN_LOSSES", "Datum", "LossInput", "builtin_loss", "datum_logprobs", "datums_from_batch",
           "forward_backward", "forward_backward_custom"]

#: forward_backward's loss_fn names -> their loss_fn_config keys and defaults. The thresholds bound the ratio
#: pi / pi_old (1 - loss.eps_low and 1 + loss.eps_high of the trainer); the kl_* keys are the trainer's kl.* fields.
BUILTIN_LOSSES: dict[str, dict[str, float | str]] = {
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "ppo_kl": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2, "kl_coef": 0.04, "kl_estimator": "k3_st",
               "kl_is_correction": "detached", "kl_log_ratio_clamp": 20.0},
}


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


def builtin_loss(loss_fn: str, loss_fn_config: dict | None = None) -> Callable:
    """The built-in loss ``loss_fn`` (:data:`BUILTIN_LOSSES`) as a datum-shaped function
    ``(data, logprobs_list) -> (loss, metrics)``: the trainer's objective on the datums, summed over their tokens.
    Per-token advantages are taken as they are (a datum may vary them along its tokens)."""
    if loss_fn not in BUILTIN_LOSSES:
        raise ConfigError(f"unknown loss_fn {loss_fn!r}; the built-in losses are {', '.join(BUILTIN_LOSSES)}, or pass "
                          f"a function (data, logprobs_list) -> (loss, metrics)")
    settings = dict(BUILTIN_LOSSES[loss_fn])
    unknown = sorted(set(loss_fn_config or {}) - set(settings))
    if unknown:
        raise ConfigError(f"loss_fn_config key {unknown[0]!r} is not a setting of loss_fn {loss_fn!r}; its keys are "
                          f"{', '.join(settings)}")
    settings.update(loss_fn_config or {})
    low, high = float(settings["clip_low_threshold"]), float(settings["clip_high_threshold"])
    if not 0 <= low <= 1 <= high:
        raise ConfigError("loss_fn_config needs 0 <= clip_low_threshold <= 1 <= clip_high_threshold, "
                          f"got {low}, {high}")
    with_kl = loss_fn == "ppo_kl"
    kl = KLTerm(coef=float(settings["kl_coef"]), estimator=str(settings["kl_estimator"]),
                is_correction=str(settings["kl_is_correction"]),
                clamp=float(settings["kl_log_ratio_clamp"]) or None) if with_kl else KLTerm(coef=0.0)
    terms = ObjectiveTerms(kl=kl, aggregation="seq_mean_token_sum",
                           policy=PolicyTerm(eps_low=1.0 - low, eps_high=high - 1.0))

    def loss(data: list[Datum], logprobs_list: list[Tensor]):
        logp, mask = _padded(logprobs_list)
        old = _padded([_field(d, "logprobs", i) for i, d in enumerate(data)], logp)[0]
        advantages = _padded([_field(d, "advantages", i) for i, d in enumerate(data)], logp)[0]
        ref = _padded([_field(d, "ref_logprobs", i) for i, d in enumerate(data)], logp)[0] if with_kl else None
        mask = mask & (_padded([_field(d, "mask", i).float() for i, d in enumerate(data)])[0] > 0)
        out = grpo_objective(ObjectiveInputs(logp, old.detach(), ref, advantages, mask), terms,
                             Normalizer(num_sequences=1.0, num_tokens=mask.sum(), max_len=float(mask.shape[1])))
        tokens = mask.sum().clamp(min=1)
        metrics = {"clip_fraction": (out.sums.clip_low + out.sums.clip_high) / tokens}
        if with_kl:
            metrics["kl"] = out.sums.raw_kl / tokens
        return out.loss, metrics

    loss.__name__ = loss_fn
    return loss


def forward_backward(model, data: list[Datum], loss_fn: str | Callable = "ppo", loss_fn_config: dict | None = None,
                     temperature: float = 1.0):
    """A built-in loss by name (``loss_fn="ppo"`` with ``loss_fn_config``, :data:`BUILTIN_LOSSES`), or a
    datum-shaped function, on ``data``: the loss is back-propagated into ``model``; returns (loss, metrics)."""
    fn = builtin_loss(loss_fn, loss_fn_config) if isinstance(loss_fn, str) else loss_fn
    if not isinstance(loss_fn, str) and loss_fn_config:
        raise ConfigError("loss_fn_config configures a built-in loss_fn (a name); pass a function's settings "
                          "through the function itself")
    return forward_backward_custom(model, data, fn, temperature)


def _field(datum: Datum, name: str, index: int) -> Tensor:
    value = datum.loss_fn_inputs.get(name)
    if value is None:
        raise DataError(f"datum {index} has no loss_fn_inputs[{name!r}]; the built-in losses read target_tokens, "
                        f"advantages, logprobs, mask (and ref_logprobs for ppo_kl)")
    return value


def _padded(rows: list[Tensor], like: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """([B, T] right-padded with zeros, [B, T] bool mask of the real entries); on ``like``'s device and dtype
    (floating rows), the rows' own otherwise. The padding keeps the rows' autograd graph."""
    width = max(len(r) for r in rows)
    device = like.device if like is not None else rows[0].device
    out = torch.stack([torch.nn.functional.pad(r.to(device, like.dtype if like is not None and r.is_floating_point()
                                                    else r.dtype), (0, width - len(r))) for r in rows])
    mask = torch.stack([torch.arange(width, device=device) < len(r) for r in rows])
    return out, mask


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
