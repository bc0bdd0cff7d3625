"""The policy's forward for ``kl.estimator: full``: per-token log-probs, entropy and the exact KL over the
vocabulary against the reference at every completion position (klgrpo.math.full_kl), one micro-batch at a time.

The reference runs once more per micro-batch, inside the update, and hands over only the input of its output
layer ([b, T, H]): its logits are rebuilt block by block inside the KL's forward and backward, so no [B, T, V]
reference tensor is ever stored. Cost: one reference forward (without its output layer) per micro-batch and
update, plus the reference output layer twice over the completion tokens (forward and backward).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from klgrpo.core.forward import position_ids_from_mask
from klgrpo.errors import ConfigError
from klgrpo.math.full_kl import token_logprobs_and_full_kl

if TYPE_CHECKING:
    from klgrpo.core.rollout import RolloutBatch

#: Largest mean |log pi_ref(y) from the output layer - the reference's own log pi_ref(y)| over the completion
#: tokens. Rounding gives ~1e-6 in float32 and ~1e-2 in bfloat16 (another kernel order); a logit soft-cap or
#: scale applied after the output layer gives far more.
REF_LOGP_TOLERANCE = 0.05


class _HeadInput(Exception):
    def __init__(self, hidden: Tensor):
        self.hidden = hidden


@torch.no_grad()
def capture_head_inputs(model, input_ids: Tensor, attention_mask: Tensor, keep: int):
    """(hidden [b, keep, H], output layer) of ``model``'s forward: the input its output layer receives at the
    last ``keep`` positions. The forward stops right there, so the [b, keep, V] logits are never built."""
    head = model.get_output_embeddings()

    def stop(_module, args):
        raise _HeadInput(args[0])

    handle = head.register_forward_pre_hook(stop)
    try:
        model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_from_mask(attention_mask),
              use_cache=False, logits_to_keep=keep)
    except _HeadInput as captured:
        return captured.hidden[:, -keep:], head
    finally:
        handle.remove()
    raise RuntimeError("the model's forward never called its output layer (get_output_embeddings())")


def completion_logprobs_and_full_kl(model, reference, batch: "RolloutBatch", temperature: float, rows: slice,
                                    ref_logp_BT: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(log pi(y_t), entropy_t, KL_t) for the completion tokens of ``batch[rows]``, each [b, T]; log pi and KL
    are differentiable. ``ref_logp_BT``: the reference's log-probs of those tokens; when given, the ones rebuilt
    from its output layer must match them (else ConfigError: the model does more after that layer)."""
    input_ids, attention_mask = batch.input_ids[rows], batch.attention_mask[rows]
    completion_ids = batch.completion_ids[rows]
    t = completion_ids.shape[1]
    ref_hidden, ref_head = reference.head_inputs(input_ids, attention_mask, t + 1)
    out = model(input_ids=input_ids, attention_mask=attention_mask,
                position_ids=position_ids_from_mask(attention_mask), use_cache=False, logits_to_keep=t + 1)
    kept = None if batch.kept_count is None else batch.kept_count[rows]  # truncated sampling: over the kept sets
    logp, kl, entropy, rebuilt_ref_logp = token_logprobs_and_full_kl(out.logits[:, :-1], completion_ids,
                                                                     ref_hidden[:, :-1], ref_head, temperature,
                                                                     kept_BT=kept)
    if ref_logp_BT is not None:
        _check_reference_head(rebuilt_ref_logp, ref_logp_BT, batch.completion_mask[rows])
    return logp, entropy, kl


def _check_reference_head(rebuilt: Tensor, ref_logp: Tensor, mask: Tensor) -> None:
    mask = mask.to(torch.float32)
    gap = float(((rebuilt.float() - ref_logp.float()).abs() * mask).sum() / mask.sum().clamp(min=1.0))
    if not gap <= REF_LOGP_TOLERANCE:
        raise ConfigError(f"kl.estimator=full: the reference's output layer does not reproduce its log-probs (mean "
                          f"|difference| {gap:.3g} > {REF_LOGP_TOLERANCE}): this model transforms its logits after "
                          f"that layer (e.g. a soft-cap); use a per-token estimator such as kl.estimator k3_st")
