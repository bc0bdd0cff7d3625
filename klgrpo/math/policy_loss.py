"""The PPO-clipped policy surrogate and the importance-corrected KL loss term, per token.

Clipped surrogate with ratio rho_t = pi(y_t) / pi_old(y_t) and advantages A (per sequence or per token):

    loss_t = -min(rho_t A_t, clip(rho_t, 1 - eps_low, 1 + eps_high) A_t)

eps_high > eps_low is DAPO's clip-higher. Two optional guards for stale samples (None: off):

    delta      rho_t in the unclipped branch is capped at delta (TRL's two-sided clip, ``GRPOConfig.delta``)
    dual_clip  where A_t < 0, loss_t = min(loss_t, -dual_clip * A_t) (verl's ``clip_ratio_c``)

The KL term with samples from pi_old (KL_MATH.md; built in objective.kl_penalty_terms):

    is_correction  term                           expected gradient (k3)
    in_graph       w_t * k(l_t), w = pi/pi_old    reverse KL (DeepSeek-V3.2, TRL use_bias_correction_kl)
    detached       sg(w_t) * k(l_t)               same as on-policy: forward KL for k3, reverse for k2
    none           k(l_t)                         biased off-policy

On-policy (pi_old == pi numerically) w = 1 in value and all three agree in value; in_graph adds E_pi[k s] to
the gradient, which is what turns k3's forward gradient into the reverse one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

IS_CORRECTIONS = ("in_graph", "detached", "none")


@dataclass
class SurrogateOut:
    """Per-token results of the clipped surrogate, all [B, T]."""

    loss_BT: Tensor
    ratio_BT: Tensor
    clipped_low_BT: Tensor   # bool: the lower clip bound was active (A < 0 and rho < 1 - eps_low)
    clipped_high_BT: Tensor  # bool: the upper clip bound was active (A > 0 and rho > 1 + eps_high)


def _compute_dtype(x: Tensor) -> torch.dtype:
    """float32, or float64 for float64 inputs (the exact tests need the full precision)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _ratio(logp_BT: Tensor, old_logp_BT: Tensor) -> Tensor:
    """pi / pi_old = exp(logp - sg(old_logp)) in at least float32; the gradient flows through ``logp_BT``."""
    dtype = torch.promote_types(_compute_dtype(logp_BT), _compute_dtype(old_logp_BT))
    return torch.exp(logp_BT.to(dtype) - old_logp_BT.to(dtype).detach())


def clipped_surrogate(
    logp_BT: Tensor,
    old_logp_BT: Tensor,
    advantages: Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    *,
    delta: float | None = None,
    dual_clip: float | None = None,
) -> SurrogateOut:
    """Per-token PPO loss; ``advantages`` is [B] (broadcast over tokens) or [B, T]. ``ratio_BT`` is the
    uncapped rho (``delta`` caps only the surrogate's unclipped branch)."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    ratio = _ratio(logp_BT, old_logp_BT)
    advantages = advantages.to(ratio.dtype)
    unclipped = (ratio if delta is None else ratio.clamp(max=delta)) * advantages
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    if dual_clip is not None:
        loss = torch.where(advantages < 0, torch.minimum(loss, -dual_clip * advantages), loss)
    with torch.no_grad():
        low = (ratio < 1.0 - eps_low) & (advantages < 0)
        high = (ratio > 1.0 + eps_high) & (advantages > 0)
    return SurrogateOut(loss_BT=loss, ratio_BT=ratio, clipped_low_BT=low, clipped_high_BT=high)


def importance_weight(logp_BT: Tensor, old_logp_BT: Tensor, is_correction: str) -> Tensor:
    """w = pi / pi_old per token, in the graph, detached, or 1 (see module docstring)."""
    if is_correction not in IS_CORRECTIONS:
        raise KeyError(f"unknown is_correction {is_correction!r}; choose one of: {', '.join(IS_CORRECTIONS)}")
    if is_correction == "none":
        return torch.ones_like(logp_BT, dtype=_compute_dtype(logp_BT))
    w = _ratio(logp_BT, old_logp_BT)
    return w.detach() if is_correction == "detached" else w
