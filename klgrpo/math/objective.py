"""The GRPO objective of one micro-batch, composed from the pieces in this package.

    A_it   = A_i                                          (KL in the loss)
           = A_i - beta * sum_{t'>=t} k(l_old)_it'        (KL in the reward, kl.reward_mode reward_to_go:
                                                           detached, at the ROLLOUT policy's log-probs, gamma 1)
    A_i    = normalise(R_i - beta * sum_t k(l_old)_it)    (kl.reward_mode sequence_score: done before this
                                                           function, by the caller's advantages; see advantages.py)
    pg_it  = -min(rho_it A_it, clip(rho_it, 1 - eps_low, 1 + eps_high) A_it)   (+ delta, dual_clip: policy_loss.py)
    kl_it  = w_it * shape(k(l_it))                        (KL in the loss; w per kl.is_correction; tokens with
                                                           |l_it| > kl.clamp keep the value, get zero gradient)
           = w_it * shape(KL_it)                          (kl.estimator full: the exact KL over the vocabulary
                                                           at prefix t, math/full_kl.py; no clamp needed)
    loss   = aggregate(pg + beta * kl, mask, mode, global normaliser)

:func:`kl_penalty_terms` (the loss term) and :func:`reward_kl` (the reward value) are the ONLY implementation
of the KL term: the trainer reaches them through :func:`grpo_objective`, and ``klgrpo verify-kl`` calls
:func:`grpo_objective` itself (klgrpo.verify.penalty), so what verify-kl proves is what training runs.

Returns the scalar loss plus per-micro-batch SUMS of the quantities to log, so the caller adds them over
micro-batches and divides once per step by global counts; nothing here syncs with the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from klgrpo.math.advantages import KL_REWARD_MODES, apply_kl_penalty
from klgrpo.math.aggregation import Normalizer, aggregate
from klgrpo.math.full_kl import FULL_KL
from klgrpo.math.kl import ESTIMATORS, kl_estimate, log_ratio
from klgrpo.math.kl_shaping import clip_fraction, shape_kl
from klgrpo.math.policy_loss import POLICY_LOSSES, importance_weight


@dataclass(frozen=True)
class KLTerm:
    """How the KL enters (see docs/kl_math.md); coef is beta at this step."""

    coef: float = 0.0
    estimator: str = "k3_st"
    placement: str = "loss"           # loss | reward | both
    is_correction: str = "detached"   # in_graph | detached | none
    shaping: str = "none"
    clip_threshold: float = 1.0
    shaping_target: float = 0.1
    clamp: float | None = 20.0
    reward_mode: str = "reward_to_go"  # reward_to_go (here) | sequence_score (in the advantages, before)

    @property
    def in_loss(self) -> bool:
        return self.placement in ("loss", "both")

    @property
    def in_reward(self) -> bool:
        return self.placement in ("reward", "both")

    @property
    def reward_to_go(self) -> bool:
        """The reward KL enters here, per token; sequence_score already sits in the caller's advantages."""
        if self.reward_mode not in KL_REWARD_MODES:
            raise KeyError(f"unknown kl reward_mode {self.reward_mode!r}; choose one of: {', '.join(KL_REWARD_MODES)}")
        return self.in_reward and self.reward_mode == "reward_to_go"


@dataclass
class KLPenalty:
    """The per-token KL of one micro-batch, [B, T] each."""

    log_ratio_BT: Tensor   # l = log pi - log ref (float32 or wider)
    raw_BT: Tensor         # k(l), in the graph
    adapted_BT: Tensor     # shape(k(l)), in the graph
    loss_term_BT: Tensor   # w * shape(k(l)) with the clamp guard: what beta multiplies in the loss


def reward_kl(old_logp_BT: Tensor, ref_logp_BT: Tensor, kl: KLTerm) -> Tensor:
    """The KL value that enters the reward: k at the ROLLOUT (sampling) policy's log-probs, detached.

    Training uses old_logp here, never the current policy's log-probs, so the penalty is a fixed reward of the
    sampled sequence during every PPO epoch; both reward modes (reward_to_go, sequence_score) read it."""
    return kl_estimate(old_logp_BT.detach(), ref_logp_BT, kl.estimator, clamp=kl.clamp).detach()


def kl_penalty_terms(logp_BT: Tensor, old_logp_BT: Tensor, ref_logp_BT: Tensor, mask_BT: Tensor, kl: KLTerm,
                     ratio_BT: Tensor | None = None, full_kl_BT: Tensor | None = None) -> KLPenalty:
    """The KL loss term per token: w * shape(k(l)), w = pi / pi_old per ``kl.is_correction``.

    ``ratio_BT`` is the surrogate's pi / pi_old (reused as the detached weight). Clamp guard: a token with
    |l| > kl.clamp keeps its (clamped) value but gets ZERO gradient from the KL term, for every estimator and
    correction: there the in-graph weight would multiply k3's clamped constant (e^clamp - clamp - 1) and push
    the policy the wrong way, and no estimator's gradient is trustworthy that far from the reference.

    ``kl.estimator`` "full" takes the exact per-position KL ``full_kl_BT`` (in the graph) as k: nothing
    exponentiates the log-ratio and its gradient is exact at any distance, so the clamp guard does not apply.
    """
    l_BT = log_ratio(logp_BT, ref_logp_BT)  # once: the KL term, its weight and the monitors all read it
    full = kl.estimator == FULL_KL
    if full:
        if full_kl_BT is None:
            raise ValueError("kl.estimator full needs full_kl_BT, the exact per-position KL (math.full_kl)")
        raw_BT = full_kl_BT
    else:
        raw_BT = ESTIMATORS[kl.estimator].fn(l_BT, kl.clamp)  # = kl_estimate(logp, ref_logp, kl.estimator)
    adapted_BT = shape_kl(raw_BT, mask_BT, kl.shaping, kl_clip_threshold=kl.clip_threshold,
                          kl_target=kl.shaping_target)
    if kl.is_correction == "detached" and ratio_BT is not None:
        w = ratio_BT.detach()  # the surrogate's ratio itself (the same exp(logp - old_logp))
    else:
        w = importance_weight(logp_BT, old_logp_BT, kl.is_correction)
    term_BT = w * adapted_BT
    if kl.clamp and not full:
        term_BT = torch.where(l_BT.detach().abs() > kl.clamp, term_BT.detach(), term_BT)
    return KLPenalty(log_ratio_BT=l_BT, raw_BT=raw_BT, adapted_BT=adapted_BT, loss_term_BT=term_BT)


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
    policy_loss: str = "ppo_clip",
    *,
    delta: float | None = None,
    dual_clip: float | None = None,
    row_weights_B: Tensor | None = None,
    metrics: bool = True,
    full_kl_BT: Tensor | None = None,
) -> ObjectiveOut:
    """Loss of one micro-batch (module docstring). ``ref_logp_BT`` is None when no reference exists.

    ``delta`` / ``dual_clip``: TRL's two-sided and verl's dual ratio clip (policy_loss.clipped_surrogate; None:
    off). ``row_weights_B`` multiplies each sequence's per-token loss before the aggregation (None: 1); the exact
    oracles of verify-kl pass the sequences' probabilities there to take expectations by enumeration.
    ``metrics=False`` leaves ``sums`` and ``maxes`` empty (callers that need only the loss). ``full_kl_BT``:
    the exact per-position KL of math.full_kl, required by (and only read for) ``kl.estimator`` "full", which
    enters the loss only."""
    if kl.estimator == FULL_KL and kl.in_reward:
        raise ValueError(f"kl.estimator full enters the loss only, not kl.placement {kl.placement}")
    mask = mask_BT.to(torch.float32)
    sums: dict[str, Tensor] = {}
    maxes: dict[str, Tensor] = {}
    token_kl = None
    advantages = advantages_B
    if ref_logp_BT is not None and kl.in_reward and kl.coef > 0:
        reward_kl_BT = reward_kl(old_logp_BT, ref_logp_BT, kl)
        if kl.reward_to_go:  # sequence_score: already in advantages_B
            advantages = apply_kl_penalty(advantages_B, reward_kl_BT, mask, kl.coef)
        if metrics:
            sums["reward_kl_penalty"] = kl.coef * (reward_kl_BT * mask).sum()
    guards = {name: value for name, value in (("delta", delta), ("dual_clip", dual_clip)) if value is not None}
    pg = POLICY_LOSSES[policy_loss](logp_BT, old_logp_BT, advantages, mask, eps_low, eps_high, **guards)
    per_token = pg.loss_BT
    if metrics:
        sums["policy_loss"] = aggregate(pg.loss_BT.detach(), mask, aggregation, normalizer)
        sums["clip_low"] = (pg.clipped_low_BT.float() * mask).sum()
        sums["clip_high"] = (pg.clipped_high_BT.float() * mask).sum()
        sums["policy_abs"] = aggregate(pg.loss_BT.detach().abs(), mask, aggregation, normalizer)  # kl/loss_share

    if ref_logp_BT is not None and (metrics or (kl.in_loss and kl.coef > 0)):
        penalty = kl_penalty_terms(logp_BT, old_logp_BT, ref_logp_BT, mask, kl, ratio_BT=pg.ratio_BT,
                                   full_kl_BT=full_kl_BT)
        if kl.in_loss and kl.coef > 0:
            per_token = per_token + kl.coef * penalty.loss_term_BT
            if metrics:
                sums["loss_kl_penalty"] = kl.coef * aggregate(penalty.loss_term_BT.detach(), mask, aggregation,
                                                              normalizer)
        if metrics:
            token_kl = _record_kl_monitors(sums, maxes, penalty, mask, kl)
    if row_weights_B is not None:
        per_token = per_token * row_weights_B.detach().unsqueeze(-1)
    loss = aggregate(per_token, mask, aggregation, normalizer)
    return ObjectiveOut(loss=loss, sums=sums if metrics else {}, maxes=maxes, token_kl=token_kl)


@torch.no_grad()
def _record_kl_monitors(sums: dict[str, Tensor], maxes: dict[str, Tensor], penalty: KLPenalty, mask: Tensor,
                        kl: KLTerm) -> Tensor:
    """raw, adapted and the monitors k1 (= l), k2, k3 of the same log-ratio: masked and summed at once. Returns the
    masked per-token l and k3, stacked [2, B, T], for the step's percentiles (train/step_metrics.py)."""
    ratio_BT = penalty.log_ratio_BT.detach()
    monitors = [ESTIMATORS[name].fn(ratio_BT, kl.clamp) for name in ("k2", "k3")]
    masked = torch.stack([penalty.raw_BT.detach(), penalty.adapted_BT.detach(), ratio_BT, *monitors]) * mask
    for name, value in zip(("raw_kl", "adapted_kl", "k1", "k2", "k3"), masked.sum(dim=(1, 2)).unbind()):
        sums[name] = value
    maxes["k3"] = masked[4].max()  # the heavy-tailed estimator's spikes
    # kl/min: the smallest per-token KL the loss uses (negative for k1; for k2, k3 a negative value is a bug)
    maxes["negated_raw_kl"] = torch.where(mask > 0, -penalty.raw_BT.detach(), float("-inf")).max()
    sums["clamp"] = ((ratio_BT.abs() > kl.clamp).float() * mask).sum() if kl.clamp else torch.zeros(())
    if kl.shaping == "clip":
        sums["shaping_clip"] = clip_fraction(penalty.raw_BT, mask, kl.clip_threshold) * mask.sum()
    return torch.stack((masked[2], masked[4]))
