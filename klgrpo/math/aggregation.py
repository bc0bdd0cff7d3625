"""Masked reductions of per-token loss terms into one scalar (docs/kl_math.md, "Aggregation and length").

For G sequences with completion lengths n_i and per-token values x_it:

    token_mean            sum_i sum_t x_it / sum_i n_i          DAPO; TRL's default
    seq_mean_token_mean   (1/G) sum_i (1/n_i) sum_t x_it         original GRPO (regularises long sequences less)
    seq_mean_token_sum    (1/G) sum_i sum_t x_it                 textbook sequence objective
    constant              (1/G) sum_i sum_t x_it / L_max         Dr. GRPO

The denominators (G, sum_i n_i) are arguments so that a batch split into micro-batches, each reduced with
the GLOBAL counts, sums to exactly the full-batch loss and gradient (gradient accumulation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from klgrpo.math.registry import Registry


@dataclass(frozen=True)
class Normalizer:
    """Global counts for one optimizer step: sequences G, completion tokens sum_i n_i, L_max."""

    num_sequences: float
    num_tokens: Tensor | float  # a 0-d tensor avoids a host sync
    max_len: float

    @classmethod
    def of(cls, mask_BT: Tensor, max_len: int | None = None) -> "Normalizer":
        return cls(
            num_sequences=float(mask_BT.shape[0]),
            num_tokens=mask_BT.sum().to(torch.float32),
            max_len=float(max_len if max_len is not None else mask_BT.shape[-1]),
        )


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    x = x * mask.to(x.dtype)
    return x.sum() if dim is None else x.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean over masked entries; 0 where a row has no entries."""
    m = mask.to(x.dtype)
    return masked_sum(x, m, dim) / (m.sum() if dim is None else m.sum(dim=dim)).clamp(min=1.0)


#: ``loss.aggregation`` name -> ``fn(row_sums_B, lengths_B, normalizer) -> scalar``: how the per-row sums of the
#: masked per-token values (and the rows' lengths n_i) become the loss, with the step's global counts.
AGGREGATIONS: Registry[Callable[[Tensor, Tensor, Normalizer], Tensor]] = Registry("aggregation")


@AGGREGATIONS.register("token_mean")
def _token_mean(row_sums_B: Tensor, lengths_B: Tensor, norm: Normalizer) -> Tensor:
    return row_sums_B.sum() / torch.as_tensor(norm.num_tokens, dtype=row_sums_B.dtype).clamp(min=1.0)


@AGGREGATIONS.register("seq_mean_token_mean")
def _seq_mean_token_mean(row_sums_B: Tensor, lengths_B: Tensor, norm: Normalizer) -> Tensor:
    return (row_sums_B / lengths_B.clamp(min=1.0)).sum() / norm.num_sequences


@AGGREGATIONS.register("seq_mean_token_sum")
def _seq_mean_token_sum(row_sums_B: Tensor, lengths_B: Tensor, norm: Normalizer) -> Tensor:
    return row_sums_B.sum() / norm.num_sequences


@AGGREGATIONS.register("constant")
def _constant(row_sums_B: Tensor, lengths_B: Tensor, norm: Normalizer) -> Tensor:
    return row_sums_B.sum() / (norm.num_sequences * norm.max_len)


def aggregate(values_BT: Tensor, mask_BT: Tensor, mode: str = "token_mean",
              normalizer: Normalizer | None = None) -> Tensor:
    """Reduce per-token ``values_BT`` to a scalar with ``mode`` (module docstring).

    ``normalizer`` carries the global counts of the whole optimizer-step batch; by default the counts of
    this batch. Rows with n_i = 0 contribute nothing (seq_mean_token_mean divides by max(n_i, 1)).
    """
    reduce = AGGREGATIONS[mode]
    norm = normalizer or Normalizer.of(mask_BT)
    m = mask_BT.to(values_BT.dtype)
    return reduce((values_BT * m).sum(dim=-1), m.sum(dim=-1), norm)
