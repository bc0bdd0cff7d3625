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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from klgrpo.math.kl import DEFAULT_LOG_RATIO_CLAMP

#: rollout.sampler_correction's values; "none" first (the default).
SAMPLER_CORRECTIONS = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@dataclass(frozen=True)
class SamplerCorrection:
    """How the sampler's mismatch is corrected: ``mode`` (SAMPLER_CORRECTIONS) and the bounds [clip_min,
    clip_max] of the ratio (None: unbounded on that side; TRL 1.16's defaults: clip_min None, clip_max 3.0)."""

    mode: str = "none"
    clip_min: float | None = None
    clip_max: float | None = 3.0

    def __post_init__(self):
        if self.mode not in SAMPLER_CORRECTIONS:
            raise KeyError(f"unknown sampler correction {self.mode!r}; choose one of: {', '.join(SAMPLER_CORRECTIONS)}")

    @property
    def on(self) -> bool:
        return self.mode != "none"

    @property
    def sequence_level(self) -> bool:
        return self.mode.startswith("sequence")


@torch.no_grad()
def sampler_weight(old_logp_BT: Tensor, sampler_logp_BT: Tensor, mask_BT: Tensor,
                   correction: SamplerCorrection) -> Tensor:
    """The detached weight of the module docstring: [B, T] for the token modes, [B, 1] for the sequence modes
    (1 everywhere for "none"). Computed in the dtype of ``old_logp_BT`` promoted to at least float32."""
    dtype = torch.promote_types(old_logp_BT.dtype, torch.float32)
    if not correction.on:
        return torch.ones_like(old_logp_BT, dtype=dtype)
    diff = torch.nan_to_num((old_logp_BT.to(dtype) - sampler_logp_BT.to(dtype)) * mask_BT.to(dtype), nan=0.0)
    if correction.sequence_level:
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if correction.mode.endswith("truncate"):
        return torch.clamp(ratio, min=correction.clip_min, max=correction.clip_max)
    low = -math.inf if correction.clip_min is None else correction.clip_min
    high = math.inf if correction.clip_max is None else correction.clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


@torch.no_grad()
def mismatch_per_token(old_logp_BT: Tensor, sampler_logp_BT: Tensor) -> tuple[Tensor, Tensor]:
    """(|log pi_old - log mu|, k3 of KL(mu || pi_old)) per token, float32 or wider. The second is
    r - 1 - log r with r = pi_old / mu: an unbiased, non-negative estimate of KL(mu || pi_old) at that prefix
    from a sample of mu (the samples come from the sampler, so this is the KL they can estimate)."""
    dtype = torch.promote_types(old_logp_BT.dtype, torch.float32)
    log_r = torch.nan_to_num(old_logp_BT.to(dtype) - sampler_logp_BT.to(dtype), nan=0.0)
    bounded = log_r.clamp(-DEFAULT_LOG_RATIO_CLAMP, DEFAULT_LOG_RATIO_CLAMP)  # exp stays finite, as k3's guard
    return log_r.abs(), torch.expm1(bounded) - bounded
