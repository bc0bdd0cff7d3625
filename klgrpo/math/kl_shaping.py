"""Shaping the KL value before beta multiplies it (`kl.shaping`; docs/kl_math.md).

Each function takes the per-token KL ``kl_BT`` (float, in the autograd graph when it is a loss term) and
the completion mask, and returns the adapted per-token tensor; the raw tensor is the input itself, so a
caller logs both (``adaptive_kl/raw_kl`` and ``adaptive_kl/adapted_kl``).

    none               adapted = kl                                              per token
    clip               adapted = min(kl, kl_clip_threshold)                      per token; zero gradient above
    sigmoid            adapted = sigmoid(kl - kl_target) * kl                    per token
    length_normalized  adapted = kl / n_i  (n_i = completion length of row i)    per sequence: summed over the
                       sequence it gives the sequence KL over its length
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from klgrpo.math.registry import Registry

SHAPINGS: Registry[Callable[..., Tensor]] = Registry("KL shaping")


@SHAPINGS.register("none")
def shape_none(kl_BT: Tensor, mask_BT: Tensor, **_: float) -> Tensor:
    return kl_BT


@SHAPINGS.register("clip")
def shape_clip(kl_BT: Tensor, mask_BT: Tensor, *, kl_clip_threshold: float = 1.0, **_: float) -> Tensor:
    """min(kl, threshold) per token. Tokens above the threshold contribute no gradient (count them)."""
    return torch.clamp(kl_BT, max=kl_clip_threshold)


@SHAPINGS.register("sigmoid")
def shape_sigmoid(kl_BT: Tensor, mask_BT: Tensor, *, kl_target: float = 0.1, **_: float) -> Tensor:
    """sigmoid(kl - target) * kl per token: a soft gate, about kl/2 near the target, ~kl far above it."""
    return torch.sigmoid(kl_BT - kl_target) * kl_BT


@SHAPINGS.register("length_normalized")
def shape_length_normalized(kl_BT: Tensor, mask_BT: Tensor, **_: float) -> Tensor:
    """kl / n_i for every token of row i, so the row's sum is its sequence KL divided by its length."""
    lengths_B1 = mask_BT.to(kl_BT.dtype).sum(dim=-1, keepdim=True).clamp(min=1.0)
    return kl_BT / lengths_B1


def shape_kl(kl_BT: Tensor, mask_BT: Tensor, shaping: str = "none", **params: float) -> Tensor:
    """Apply the named shaping (see module docstring); ``params`` are its named thresholds."""
    return SHAPINGS[shaping](kl_BT, mask_BT, **params)


def clip_fraction(kl_BT: Tensor, mask_BT: Tensor, kl_clip_threshold: float) -> Tensor:
    """Fraction of masked tokens where the clip shaping fires (their KL gradient is zero)."""
    m = mask_BT.to(torch.float32)
    return ((kl_BT.detach() > kl_clip_threshold).float() * m).sum() / m.sum().clamp(min=1.0)
