"""The policy losses (surrogates) and the importance-corrected KL loss term, per token.

Clipped surrogate with ratio rho_t = pi(y_t) / pi_old(y_t) and advantages A (per sequence or per token):

    loss_t = -min(rho_t A_t, clip(rho_t, 1 - eps_low, 1 + eps_high) A_t)

eps_high > eps_low is DAPO's clip-higher. Two optional guards for stale samples (None: off):

    delta      rho_t in the unclipped branch is capped at delta (TRL's two-sided clip, ``GRPOConfig.delta``)
    dual_clip  where A_t < 0, loss_t = min(loss_t, -dual_clip * A_t) (verl's ``clip_ratio_c``)

The registry ``POLICY_LOSSES`` names the surrogates a config can pick (``loss.policy_loss``); the guards apply
to ppo_clip only:

    ppo_clip  the clipped surrogate above (default)
    gspo      sequence ratio s_i = exp(mean_t (log pi - log pi_old)) over the sequence's tokens, clipped at
              sequence level (Zheng et al. 2025, "Group Sequence Policy Optimization"). Written in the paper's
              GSPO-token form: rho_it = sg(s_i) pi(y_t) / sg(pi(y_t)) has value s_i and gradient s_i grad log pi(y_t),
              so per-token advantages (KL in the reward) work too; with per-sequence advantages every
              aggregation's gradient equals the sequence form's, whose grad s_i = s_i mean_t grad log pi(y_t).
    cispo     loss_t = -sg(clip(rho_t, 1 - eps_low, 1 + eps_high)) A_t log pi(y_t): the clipped importance
              weight is detached and multiplies the log-prob, so clipped tokens still get a gradient
              (MiniMax-M1, 2025). The clip applies whatever the sign of A.
    sapo      loss_t = -(4 / tau) sigmoid(tau (rho_t - 1)) A_t, tau = temperature_pos where A_t > 0, else
              temperature_neg: a soft gate instead of the clip (Soft Adaptive Policy Optimization, 2025); its
              gradient rho_t sigmoid'(..) 4 A_t grad log pi is the PPO one at rho = 1 and fades away from it.
    vespo     loss_t = -sg(phi(w_i)) A_t log pi(y_t), w_i = exp(sum_t clamp(log rho_t, -20, 20)) the sequence's
              ratio (log w clamped to [log 1e-8, 20]), phi(w) = exp(lambda + k log w - lambda w) (phi(1) = 1),
              (k, lambda) = (k_pos, lambda_pos) where A_t >= 0 else (k_neg, lambda_neg): a Gamma-shaped weight
              that fades sequences whose ratio is far from 1 (VESPO). The eps_low / eps_high clip is unused.

The off-policy sequence mask (:func:`off_policy_mask`, DeepSeek-V3.2 eq. 9) drops the policy term of a
sequence whose advantage is negative and whose mean per-token KL(pi_sampling || pi), estimated by
mean_t (log pi_sampling - log pi), exceeds a threshold delta.

Every surrogate reports the per-token ratio pi / pi_old in ``ratio_BT`` (the KL term's importance weight
reads it), not GSPO's sequence ratio.

The KL term with samples from pi_old (docs/kl_math.md; built in objective.kl_penalty_terms):

    is_correction  term                           expected gradient (k3)
    in_graph       w_t * k(l_t), w = pi/pi_old    reverse KL (DeepSeek-V3.2, TRL use_bias_correction_kl)
    detached       sg(w_t) * k(l_t)               same as on-policy: forward KL for k3, reverse for k2
    none           k(l_t)                         biased off-policy

On-policy (pi_old == pi numerically) w = 1 in value and all three agree in value; in_graph adds E_pi[k s] to
the gradient, which is what turns k3's forward gradient into the reverse one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from klgrpo.math.policy_params import SapoParams, VespoParams
from klgrpo.math.registry import Registry

IS_CORRECTIONS = ("in_graph", "detached", "none")

#: ``loss.policy_loss`` name -> surrogate ``fn(logp_BT, old_logp_BT, advantages, mask_BT, eps_low, eps_high,
#: **guards, params=settings) -> SurrogateOut``; the guards (delta, dual_clip) reach only a surrogate that takes
#: them (ppo_clip), a loss's own settings (``register(name, params=...)``) reach it as ONE keyword, ``params``, an
#: instance of the dataclass it registered (a loss without settings gets no ``params``).
#: Registration order is the order the config lists them in; ppo_clip, the default, first.
POLICY_LOSSES: Registry = Registry("policy loss")


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


def _per_token(advantages: Tensor) -> Tensor:
    """Advantages [B] broadcast over the tokens as [B, 1]; per-token advantages [B, T] as they are."""
    return advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages


def clipped_surrogate(logp_BT: Tensor, old_logp_BT: Tensor, advantages: Tensor, eps_low: float = 0.2,
                      eps_high: float = 0.2, *, delta: float | None = None,
                      dual_clip: float | None = None) -> SurrogateOut:
    """Per-token PPO loss; ``advantages`` is [B] (broadcast over tokens) or [B, T]. ``ratio_BT`` is the
    uncapped rho (``delta`` caps only the surrogate's unclipped branch)."""
    ratio = _ratio(logp_BT, old_logp_BT)
    return _pessimistic_clip(ratio, ratio, _per_token(advantages).to(ratio.dtype), eps_low, eps_high, delta,
                             dual_clip)


@POLICY_LOSSES.register("ppo_clip")
def _ppo_clip(logp_BT: Tensor, old_logp_BT: Tensor, advantages: Tensor, mask_BT: Tensor, eps_low: float = 0.2,
              eps_high: float = 0.2, *, delta: float | None = None, dual_clip: float | None = None) -> SurrogateOut:
    """The registry's form of :func:`clipped_surrogate` (the mask is not needed per token)."""
    return clipped_surrogate(logp_BT, old_logp_BT, advantages, eps_low, eps_high, delta=delta, dual_clip=dual_clip)


def _pessimistic_clip(ratio: Tensor, token_ratio: Tensor, advantages: Tensor, eps_low: float, eps_high: float,
                      delta: float | None = None, dual_clip: float | None = None) -> SurrogateOut:
    """-min(rho A, clip(rho) A) with the optional delta cap and dual clip; ``token_ratio`` is what the
    SurrogateOut reports as the per-token pi / pi_old (GSPO clips a sequence ratio but reports the token's)."""
    unclipped = (ratio if delta is None else ratio.clamp(max=delta)) * advantages
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    if dual_clip is not None:
        loss = torch.where(advantages < 0, torch.minimum(loss, -dual_clip * advantages), loss)
    with torch.no_grad():
        low = (ratio < 1.0 - eps_low) & (advantages < 0)
        high = (ratio > 1.0 + eps_high) & (advantages > 0)
    return SurrogateOut(loss_BT=loss, ratio_BT=token_ratio, clipped_low_BT=low, clipped_high_BT=high)


@POLICY_LOSSES.register("gspo")
def gspo_surrogate(logp_BT: Tensor, old_logp_BT: Tensor, advantages: Tensor, mask_BT: Tensor,
                   eps_low: float = 0.2, eps_high: float = 0.2) -> SurrogateOut:
    """GSPO-token (module docstring): the PPO clip applied to the sequence ratio s_i, broadcast over tokens."""
    dtype = torch.promote_types(_compute_dtype(logp_BT), _compute_dtype(old_logp_BT))
    log_token_ratio = logp_BT.to(dtype) - old_logp_BT.to(dtype).detach()
    mask = mask_BT.to(dtype)
    seq_log_ratio_B1 = (log_token_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    # value s_i, gradient s_i * grad log pi(y_t): exp(sg(log s_i) + log pi - sg(log pi))
    ratio = torch.exp(seq_log_ratio_B1.detach() + log_token_ratio - log_token_ratio.detach())
    return _pessimistic_clip(ratio, torch.exp(log_token_ratio), _per_token(advantages).to(ratio.dtype), eps_low,
                             eps_high)


@POLICY_LOSSES.register("cispo")
def cispo_surrogate(logp_BT: Tensor, old_logp_BT: Tensor, advantages: Tensor, mask_BT: Tensor,
                    eps_low: float = 0.2, eps_high: float = 0.2) -> SurrogateOut:
    """CISPO (module docstring): -sg(clip(rho)) A log pi per token."""
    ratio = _ratio(logp_BT, old_logp_BT)
    weight = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high).detach()
    loss = -weight * _per_token(advantages).to(ratio.dtype) * logp_BT.to(ratio.dtype)
    with torch.no_grad():
        low, high = ratio < 1.0 - eps_low, ratio > 1.0 + eps_high
    return SurrogateOut(loss_BT=loss, ratio_BT=ratio, clipped_low_BT=low, clipped_high_BT=high)


@POLICY_LOSSES.register("sapo", params=SapoParams)
def sapo_surrogate(logp_BT: Tensor, old_logp_BT: Tensor, advantages: Tensor, mask_BT: Tensor,
                   eps_low: float = 0.2, eps_high: float = 0.2, *, params: SapoParams = SapoParams()) -> SurrogateOut:
    """SAPO (module docstring): -(4 / tau) sigmoid(tau (rho - 1)) A per token; nothing is clipped."""
    ratio = _ratio(logp_BT, old_logp_BT)
    adv = _per_token(advantages).to(ratio.dtype)
    tau = torch.where(adv > 0, params.temperature_pos, params.temperature_neg).to(ratio.dtype)
    loss = -torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau * adv
    none = torch.zeros_like(loss, dtype=torch.bool)
    return SurrogateOut(loss_BT=loss, ratio_BT=ratio, clipped_low_BT=none, clipped_high_BT=none)


#: log w is clamped to [VESPO_LOG_W_MIN, VESPO_LOG_W_MAX] (w >= 1e-8), each token's log-ratio to +-20.
VESPO_LOG_W_MIN, VESPO_LOG_W_MAX = math.log(1e-8), 20.0


@torch.no_grad()
def vespo_weight(log_ratio_BT: Tensor, advantages: Tensor, mask_BT: Tensor, params: VespoParams) -> Tensor:
    """phi(w_i) of VESPO (module docstring), detached: [B, 1] for per-sequence advantages, else [B, T];
    a non-finite phi becomes 0."""
    mask = mask_BT.to(log_ratio_BT.dtype)
    log_w = (log_ratio_BT.clamp(-20.0, 20.0) * mask).sum(-1, keepdim=True).clamp(VESPO_LOG_W_MIN, VESPO_LOG_W_MAX)
    nonneg = _per_token(advantages) >= 0
    k = torch.where(nonneg, params.k_pos, params.k_neg).to(log_w.dtype)
    lam = torch.where(nonneg, params.lambda_pos, params.lambda_neg).to(log_w.dtype).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


@POLICY_LOSSES.register("vespo", params=VespoParams)
def vespo_surrogate(logp_BT: Tensor, old_logp_BT: Tensor, advantages: Tensor, mask_BT: Tensor,
                    eps_low: float = 0.2, eps_high: float = 0.2, *,
                    params: VespoParams = VespoParams()) -> SurrogateOut:
    """VESPO (module docstring): -sg(phi(w_i)) A log pi per token."""
    dtype = torch.promote_types(_compute_dtype(logp_BT), _compute_dtype(old_logp_BT))
    log_ratio = logp_BT.to(dtype) - old_logp_BT.to(dtype).detach()
    phi = vespo_weight(log_ratio.detach(), advantages, mask_BT, params)
    loss = -phi * _per_token(advantages).to(dtype) * logp_BT.to(dtype)
    none = torch.zeros_like(loss, dtype=torch.bool)
    return SurrogateOut(loss_BT=loss, ratio_BT=torch.exp(log_ratio), clipped_low_BT=none, clipped_high_BT=none)


@torch.no_grad()
def off_policy_mask(advantages: Tensor, logp_BT: Tensor, sampling_logp_BT: Tensor, mask_BT: Tensor,
                    threshold: float) -> tuple[Tensor, Tensor]:
    """(keep, kl): keep is 1 where the policy term stays, 0 for a sequence with A < 0 whose mean per-token
    KL estimate mean_t (log pi_sampling - log pi) exceeds ``threshold`` ([B, 1] for per-sequence advantages,
    else [B, T]); kl is that per-sequence mean, [B, 1]. A NaN sampling log-prob counts as no evidence (0)."""
    mask = mask_BT.to(logp_BT.dtype)
    kl = torch.nan_to_num(sampling_logp_BT - logp_BT.detach(), nan=0.0)
    seq_kl = (kl * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    keep = (_per_token(advantages) >= 0) | (seq_kl <= threshold)
    return keep.to(mask.dtype), seq_kl


def importance_weight(logp_BT: Tensor, old_logp_BT: Tensor, is_correction: str) -> Tensor:
    """w = pi / pi_old per token, in the graph, detached, or 1 (see module docstring)."""
    if is_correction not in IS_CORRECTIONS:
        raise KeyError(f"unknown is_correction {is_correction!r}; choose one of: {', '.join(IS_CORRECTIONS)}")
    if is_correction == "none":
        return torch.ones_like(logp_BT, dtype=_compute_dtype(logp_BT))
    w = _ratio(logp_BT, old_logp_BT)
    return w.detach() if is_correction == "detached" else w
