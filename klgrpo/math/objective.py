"""The GRPO objective of one micro-batch, composed from the pieces in this package.

    A_it   = A_i                                          (KL in the loss)
           = A_i - beta * sum_{t'>=t} k(l_old)_it'        (KL in the reward: detached, reward-to-go, gamma 1)
    pg_it  = -min(rho_it A_it, clip(rho_it, 1 - eps_low, 1 + eps_high) A_it)
    kl_it  = w_it * shape(k(l_it))                        (KL in the loss; w per kl.is_correction)
    loss   = aggregate(pg + beta * kl, mask, mode, global normaliser)

Returns the scalar loss plus per-micro-batch SUMS of the quantities to log, so the caller adds them over
micro-batches and divides once per step by global counts; nothing here syncs with the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from klgrpo.math.advantages import apply_kl_penalty
from klgrpo.math.aggregation import Normalizer, aggregate
from klgrpo.math.kl import ESTIMATORS, kl_estimate, log_ratio
from klgrpo.math.kl_shaping import clip_fraction, shape_kl
from klgrpo.math.policy_loss import clipped_surrogate, importance_weight


@dataclass(frozen=True)
class KLTerm:
    """How the KL enters (see KL_MATH.md); coef is beta at this step."""

    coef: float = 0.0
    estimator: str = "k3_st"
    placement: str = "loss"           # loss | reward | both
    is_correction: str = "detached"   # in_graph | detached | none
    shaping: str = "none"
    clip_threshold: float = 1.0
    shaping_target: float = 0.1
    clamp: float | None = 20.0

    @property
    def in_loss(self) -> bool:
        return self.placement in ("loss", "both")

    @property
    def in_reward(self) -> bool:
        return self.placement in ("reward", "both")


@dataclass
class ObjectiveOut:
    loss: Tensor                # scalar, this micro-batch's share of the step loss
    sums: dict[str, Tensor]     # detached sums over masked tokens / sequences, for metrics
    maxes: dict[str, Tensor]    # detached maxima, for metrics
    token_kl: Tensor | None = None  # detached [2, B, T]: the log-ratio l and k3(l) per token, 0 off the mask


def grpo_objective(
    logp_BT: Tensor,
    old_logp_BT: Tensor,
    ref_logp_BT: Tensor | None,
    advantages_B: Tensor,
    mask_BT: Tensor,
    kl: KLTerm,
    aggregation: str,
    normalizer: Normalizer,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
) -> ObjectiveOut:
    """Loss of one micro-batch (module docstring). ``ref_logp_BT`` is None when no reference exists."""
    mask = mask_BT.to(torch.float32)
    sums: dict[str, Tensor] = {}
    maxes: dict[str, Tensor] = {}
    advantages = advantages_B
    if ref_logp_BT is not None and kl.in_reward and kl.coef > 0:
        reward_kl_BT = kl_estimate(old_logp_BT.detach(), ref_logp_BT, kl.estimator, clamp=kl.clamp)
        advantages = apply_kl_penalty(advantages_B, reward_kl_BT, mask, kl.coef)
        sums["reward_kl_penalty"] = kl.coef * (reward_kl_BT * mask).sum()
    pg = clipped_surrogate(logp_BT, old_logp_BT, advantages, eps_low, eps_high)
    per_token = pg.loss_BT
    sums["policy_loss"] = aggregate(pg.loss_BT.detach(), mask, aggregation, normalizer)
    sums["clip_low"] = (pg.clipped_low_BT.float() * mask).sum()
    sums["clip_high"] = (pg.clipped_high_BT.float() * mask).sum()
    sums["policy_abs"] = aggregate(pg.loss_BT.detach().abs(), mask, aggregation, normalizer)  # for kl/loss_share

    if ref_logp_BT is not None:
        l_BT = log_ratio(logp_BT, ref_logp_BT)  # once: the KL term, its weight and the monitors all read it
        kl_BT = ESTIMATORS[kl.estimator].fn(l_BT, kl.clamp)  # = kl_estimate(logp, ref_logp, kl.estimator)
        adapted_BT = shape_kl(kl_BT, mask, kl.shaping, kl_clip_threshold=kl.clip_threshold,
                              kl_target=kl.shaping_target)
        if kl.in_loss and kl.coef > 0:
            # the detached weight is the surrogate's ratio itself (the same exp(logp - old_logp))
            w = (pg.ratio_BT.detach() if kl.is_correction == "detached"
                 else importance_weight(logp_BT, old_logp_BT, kl.is_correction))
            per_token = per_token + kl.coef * w * adapted_BT
            sums["loss_kl_penalty"] = kl.coef * aggregate((w * adapted_BT).detach(), mask, aggregation, normalizer)
        with torch.no_grad():
            ratio_BT = l_BT.detach()
            # raw, adapted and the monitors k1 (= l), k2, k3 of the same log-ratio: masked and summed at once
            monitors = [ESTIMATORS[name].fn(ratio_BT, kl.clamp) for name in ("k2", "k3")]
            masked = torch.stack([kl_BT.detach(), adapted_BT.detach(), ratio_BT, *monitors]) * mask
            for name, value in zip(("raw_kl", "adapted_kl", "k1", "k2", "k3"), masked.sum(dim=(1, 2)).unbind()):
                sums[name] = value
            maxes["k3"] = masked[4].max()  # the heavy-tailed estimator's spikes
            token_kl = torch.stack((masked[2], masked[4]))  # for the step's percentiles (train/step_metrics.py)
            sums["clamp"] = ((ratio_BT.abs() > kl.clamp).float() * mask).sum() if kl.clamp else torch.zeros(())
            if kl.shaping == "clip":
                sums["shaping_clip"] = clip_fraction(kl_BT, mask, kl.clip_threshold) * mask.sum()
    loss = aggregate(per_token, mask, aggregation, normalizer)
    return ObjectiveOut(loss=loss, sums=sums, maxes=maxes, token_kl=token_kl if ref_logp_BT is not None else None)
