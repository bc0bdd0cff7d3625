"""The sampler's mismatch: the tokens come from the sampler's distribution mu (vLLM's kernels, another precision,
prefix caching), while the objective is written for samples of pi_old, the trainer's own log-probs of the
rollout policy. Per token, with d_t = log pi_old(y_t) - log mu(y_t) over the loss-mask tokens:

    mode                weight (detached)                              as TRL 1.16's vllm_importance_sampling_mode
    none                1
    token_truncate      clamp(exp(d_t), c_min, c_max)                  token_truncate
    token_mask          exp(d_t), 0 where outside [c_min, c_max]       token_mask
    sequence_truncate   clamp(exp(sum_t d_t), c_min, c_max), per row   sequence_truncate
    sequence_mask       exp(sum_t d_t), 0 where outside the bounds     sequence_mask

(a NaN d_t, a token the sampler gave no log-prob for, counts as 0: weight 1). The weight multiplies the whole
per-token loss, the policy term AND the KL term (objective.grpo_objective); TRL weights the policy term only.

Why the KL term too (docs/kl_guide.md, "A sampler that is not the policy"): every KL setting's expected
gradient is derived for samples of pi_old, E_pi_old[g(y)]. With samples of mu, E_mu[W(y) g(y)] = E_pi_old[g(y)]
exactly when W(y) = pi_old(y) / mu(y) for the whole sequence y = prod_t exp(d_t): the sequence ratio, which
also corrects the prefix distribution of every token. At one position (T = 1) the token and sequence ratios
coincide; on longer sequences a per-token ratio leaves the prefixes sampled from mu, so only the sequence modes
are exact there, and only while the bounds do not bind (a truncated or masked weight is a biased one).
``klgrpo verify-kl`` checks this by enumeration (verify/sampler_mismatch.py).

Divergence masks (``rollout.divergence_mask``, verl's rollout_rs names) reject tokens or whole sequences whose
divergence between the sampler and the trainer is too large, beside (or instead of) the weight above. With
log r_t = d_t and the per-token divergences k1 = -d_t, k2 = d_t^2 / 2, k3 = exp(d_t) - 1 - d_t (k3 estimates
KL(mu || pi_old) from a sample of mu):

    token_k1                  reject the token when r_t is outside [low, high]             (two-sided token mask)
    token_k2, token_k3        reject the token when its k2 / k3 is above high
    seq_sum_k1                reject the sequence when prod_t r_t is outside [low, high]
    seq_mean_k1               ... when the geometric mean exp(mean_t d_t) is outside [low, high]
                                                                                            (geometric-mean mask)
    seq_sum_k2, seq_sum_k3    reject the sequence when the sum over its tokens of k2 / k3 is above high
    seq_mean_k2, seq_mean_k3  ... when their mean is above high
    seq_max_k2, seq_max_k3    ... when their maximum is above high

Several masks reject what any of them rejects. A rejected token keeps its place in the loss's normaliser (its
terms count as 0, as a masked weight of the modes above does), so the loss's scale does not jump when a mask
fires; whether a rejected token's KL term still counts is ``kl.masked_tokens`` (math/objective.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from klgrpo.math.kl import DEFAULT_LOG_RATIO_CLAMP

#: rollout.sampler_correction's values; "none" first (the default).
SAMPLER_CORRECTIONS = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


#: rollout.divergence_mask's names: (where, which divergence) as verl's rollout_rs options.
DIVERGENCE_MASKS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
                    "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")


@dataclass(frozen=True)
class DivergenceMask:
    """One divergence mask (module docstring): ``name`` a DIVERGENCE_MASKS name; for k1 the ratio bounds [low,
    high] (None: unbounded on that side), for k2 and k3 the upper bound ``high`` (``low`` unused)."""

    name: str
    low: float | None = None
    high: float | None = None

    def __post_init__(self):
        if self.name not in DIVERGENCE_MASKS:
            raise KeyError(f"unknown divergence mask {self.name!r}; choose from: {', '.join(DIVERGENCE_MASKS)}")
        if self.low is None and self.high is None:
            raise ValueError(f"divergence mask {self.name} needs a bound")
        if not self.ratio_bounds and self.low is not None:
            raise ValueError(f"divergence mask {self.name} takes an upper bound only")

    @property
    def level(self) -> str:
        """token, or how the sequence's tokens combine: sum, mean, max."""
        return "token" if self.name.startswith("token") else self.name.split("_")[1]

    @property
    def divergence(self) -> str:
        return self.name.rsplit("_", 1)[1]

    @property
    def ratio_bounds(self) -> bool:
        """k1's bounds are on the ratio (exp of the combined log-ratio), the others' on the divergence."""
        return self.divergence == "k1"


def token_divergence(log_r_BT: Tensor, divergence: str) -> Tensor:
    """k1, k2 or k3 per token of the log-ratio d_t = log pi_old - log mu (module docstring)."""
    if divergence == "k1":
        return -log_r_BT
    if divergence == "k2":
        return 0.5 * log_r_BT ** 2
    bounded = log_r_BT.clamp(-DEFAULT_LOG_RATIO_CLAMP, DEFAULT_LOG_RATIO_CLAMP)  # exp stays finite
    return torch.expm1(bounded) - bounded


def _outside(value: Tensor, low: float | None, high: float | None) -> Tensor:
    out = torch.zeros_like(value, dtype=torch.bool)
    if low is not None:
        out |= value < low
    if high is not None:
        out |= value > high
    return out


@torch.no_grad()
def divergence_keep(log_r_BT: Tensor, mask_BT: Tensor, masks: tuple[DivergenceMask, ...]) -> Tensor:
    """1 where every mask keeps the token, 0 where one rejects it: [B, T] with a token mask among ``masks``, else
    [B, 1] (the loss mask's dtype promoted to at least float32). A sequence without a completion token is kept."""
    dtype = torch.promote_types(log_r_BT.dtype, torch.float32)
    log_r, mask = log_r_BT.to(dtype) * mask_BT.to(dtype), mask_BT.to(dtype)
    keep = torch.ones(log_r.shape[0], 1, dtype=dtype, device=log_r.device)
    tokens = mask.sum(-1, keepdim=True)
    for m in masks:
        if m.ratio_bounds:  # on the ratio: exp of the token's, the sum's or the mean's log-ratio
            if m.level == "token":
                combined = log_r
            else:
                combined = log_r.sum(-1, keepdim=True)
                combined = combined / tokens.clamp(min=1) if m.level == "mean" else combined
            rejected = _outside(combined.clamp(max=DEFAULT_LOG_RATIO_CLAMP).exp(), m.low, m.high)
        else:
            k_BT = token_divergence(log_r, m.divergence) * mask
            if m.level == "token":
                combined = k_BT
            elif m.level == "max":
                combined = k_BT.amax(-1, keepdim=True)
            else:
                combined = k_BT.sum(-1, keepdim=True)
                combined = combined / tokens.clamp(min=1) if m.level == "mean" else combined
            rejected = _outside(combined, None, m.high)
        keep = keep * (~rejected).to(dtype)
    if keep.shape[-1] > 1:
        keep = torch.where(mask > 0, keep, torch.ones_like(keep))  # only completion tokens are ever rejected
    return torch.where(tokens > 0, keep, torch.ones_like(keep))


@dataclass(frozen=True)
class SamplerCorrection:
    """How the sampler's mismatch is corrected: ``mode`` (SAMPLER_CORRECTIONS) and the bounds [clip_min,
    clip_max] of the ratio (None: unbounded on that side; TRL 1.16's defaults: clip_min None, clip_max 3.0)."""

    mode: str = "none"
    clip_min: float | None = None
    clip_max: float | None = 3.0
    masks: tuple[DivergenceMask, ...] = ()  # the divergence masks (rollout.divergence_mask), () off

    def __post_init__(self):
        if self.mode not in SAMPLER_CORRECTIONS:
            raise KeyError(f"unknown sampler correction {self.mode!r}; choose one of: {', '.join(SAMPLER_CORRECTIONS)}")

    @property
    def on(self) -> bool:
        """The mismatch changes the loss: a weight mode, a divergence mask, or both."""
        return self.mode != "none" or bool(self.masks)

    @property
    def rejects(self) -> bool:
        """Some tokens may get the factor 0: a mask mode or a divergence mask."""
        return self.mode.endswith("mask") or bool(self.masks)

    @property
    def sequence_level(self) -> bool:
        return self.mode.startswith("sequence")


@dataclass
class SamplerFactors:
    """The correction's factors on one micro-batch's per-token loss, each broadcastable to [B, T]: ``weight`` the
    importance weight (the ratio, or its truncation; 1 where no weight mode is on), ``keep`` 1 where no mask
    rejects the token (a mask mode's bounds, the divergence masks), 0 where one does. Their product is the factor
    v on the policy term."""

    weight: Tensor
    keep: Tensor

    @property
    def product(self) -> Tensor:
        return self.weight * self.keep


@torch.no_grad()
def sampler_factors(old_logp_BT: Tensor, sampler_logp_BT: Tensor, mask_BT: Tensor,
                    correction: SamplerCorrection) -> SamplerFactors:
    """The weight and the keep of the module docstring: [B, T] for the token modes, [B, 1] for the sequence modes
    (1 for "none"), in the dtype of ``old_logp_BT`` promoted to at least float32."""
    dtype = torch.promote_types(old_logp_BT.dtype, torch.float32)
    diff = torch.nan_to_num((old_logp_BT.to(dtype) - sampler_logp_BT.to(dtype)) * mask_BT.to(dtype), nan=0.0)
    one = torch.ones(diff.shape[0], 1, dtype=dtype, device=diff.device)
    weight, keep = one, divergence_keep(diff, mask_BT, correction.masks) if correction.masks else one
    if correction.mode != "none":
        ratio = torch.exp(diff.sum(dim=-1, keepdim=True) if correction.sequence_level else diff)
        if correction.mode.endswith("truncate"):
            weight = torch.clamp(ratio, min=correction.clip_min, max=correction.clip_max)
        else:
            weight = ratio
            keep = keep * (~_outside(ratio, correction.clip_min, correction.clip_max)).to(dtype)
    return SamplerFactors(weight=weight, keep=keep)


@torch.no_grad()
def sampler_weight(old_logp_BT: Tensor, sampler_logp_BT: Tensor, mask_BT: Tensor,
                   correction: SamplerCorrection) -> Tensor:
    """The factor v on the policy term (the weight times the keep): [B, T] for the token modes and masks, [B, 1]
    for the sequence ones (1 everywhere for "none")."""
    if not correction.on:
        return torch.ones_like(old_logp_BT, dtype=torch.promote_types(old_logp_BT.dtype, torch.float32))
    return sampler_factors(old_logp_BT, sampler_logp_BT, mask_BT, correction).product


@torch.no_grad()
def mismatch_per_token(old_logp_BT: Tensor, sampler_logp_BT: Tensor) -> tuple[Tensor, Tensor]:
    """(|log pi_old - log mu|, k3 of KL(mu || pi_old)) per token, float32 or wider. The second is
    r - 1 - log r with r = pi_old / mu: an unbiased, non-negative estimate of KL(mu || pi_old) at that prefix
    from a sample of mu (the samples come from the sampler, so this is the KL they can estimate)."""
    dtype = torch.promote_types(old_logp_BT.dtype, torch.float32)
    log_r = torch.nan_to_num(old_logp_BT.to(dtype) - sampler_logp_BT.to(dtype), nan=0.0)
    bounded = log_r.clamp(-DEFAULT_LOG_RATIO_CLAMP, DEFAULT_LOG_RATIO_CLAMP)  # exp stays finite, as k3's guard
    return log_r.abs(), torch.expm1(bounded) - bounded
