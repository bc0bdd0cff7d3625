"""Group-relative advantages and the KL-in-reward penalty.

Rewards are laid out group after group: ``rewards_N`` has N = num_groups * G entries and entries
[g*G, (g+1)*G) are the G completions of prompt g.

    group  A_i = (r_i - mean_g) / (std_g + eps)     GRPO / DeepSeekMath
    batch  A_i = (r_i - mean_g) / (std_batch + eps) TRL's scale_rewards="batch" (std of all rewards)
    none   A_i =  r_i - mean_g                      Dr. GRPO

std uses ``ddof`` (1: the unbiased sample std, torch's default and TRL's; 0: the population std). A group
whose rewards are all equal gets A = 0 exactly.

KL in the reward (docs/kl_math.md): the per-token k1 penalty enters as a reward-to-go with gamma = 1 and no length
normalisation, A_it = A_i - beta * sum_{t' >= t} kl_it'. It is added AFTER the group normalisation so beta is not
rescaled by 1/std; with k1 this gives exactly beta * grad KL(pi || ref) of the sequence, on-policy.

The two ``kl.reward_mode`` values (KL_REWARD_MODES):

    reward_to_go     the above (klgrpo's default; :func:`apply_kl_penalty`, applied inside the objective)
    sequence_score   R_i - beta * sum_t kl_it BEFORE the group normalisation (:func:`kl_penalized_scores`):
                     verl's and OpenRLHF's KL-in-reward for GRPO. Same expected gradient as reward_to_go before
                     normalising (the past tokens' KL is uncorrelated with the later scores), but the group std
                     divides beta too, and the penalty's variance is higher.

In both modes kl_it is the estimator's value at the ROLLOUT policy's log-probs (objective.reward_kl).
"""

from __future__ import annotations

import torch
from torch import Tensor

ADVANTAGE_SCALES = ("group", "batch", "none")
KL_REWARD_MODES = ("reward_to_go", "sequence_score")

#: Added to the std before dividing (TRL uses 1e-4).
DEFAULT_STD_EPS = 1e-4


def group_advantages(
    rewards: Tensor,
    group_size: int,
    scale: str = "group",
    eps: float = DEFAULT_STD_EPS,
    ddof: int = 1,
) -> Tensor:
    """Advantages [N*G] from rewards [N*G] laid out group after group (module docstring)."""
    if scale not in ADVANTAGE_SCALES:
        raise KeyError(f"unknown advantage scale {scale!r}; choose one of: {', '.join(ADVANTAGE_SCALES)}")
    if not hasattr(group_size, "__index__") or group_size < 1:
        raise ValueError(f"group_size must be a positive integer (completions per prompt), got {group_size!r}")
    group_size = int(group_size)
    if rewards.dim() != 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"rewards must be 1-D with a length divisible by group_size={group_size}, "
                         f"got shape {tuple(rewards.shape)}")
    rewards_NG = rewards.reshape(-1, group_size)
    centred_NG = rewards_NG - rewards_NG.mean(dim=1, keepdim=True)
    # The rounded mean of equal values need not equal them (7 x 0.1 in float32 is off by 7e-9, which
    # 1 / (std + eps) then blows up to 7e-5): force the promised exact zero for all-equal groups.
    constant_N1 = rewards_NG.amax(dim=1, keepdim=True) == rewards_NG.amin(dim=1, keepdim=True)
    centred_NG = centred_NG.masked_fill(constant_N1, 0.0)
    if scale == "none":
        return centred_NG.reshape(-1)
    if scale == "group":
        std = _std(rewards_NG, dim=1, ddof=ddof)
    else:
        std = _std(rewards_NG.reshape(-1), dim=0, ddof=ddof)
    # masked_fill again: with eps = 0 an all-equal group would otherwise give 0 / 0 = nan.
    return (centred_NG / (std + eps)).masked_fill(constant_N1, 0.0).reshape(-1)


def _std(x: Tensor, dim: int, ddof: int) -> Tensor:
    n = x.shape[dim]
    if n - ddof <= 0:
        return torch.zeros_like(x.mean(dim=dim, keepdim=True))
    var = ((x - x.mean(dim=dim, keepdim=True)) ** 2).sum(dim=dim, keepdim=True) / (n - ddof)
    return var.sqrt()


def reward_to_go(values_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """sum_{t' >= t} values_it' over masked tokens (gamma = 1); zero on masked-out positions."""
    m = mask_BT.to(values_BT.dtype)
    v = values_BT * m
    return torch.flip(torch.cumsum(torch.flip(v, dims=[-1]), dim=-1), dims=[-1]) * m


def apply_kl_penalty(advantages_B: Tensor, kl_BT: Tensor, mask_BT: Tensor, coef: float) -> Tensor:
    """Per-token advantages A_it = A_i - coef * reward_to_go(kl)_it, with ``kl_BT`` detached."""
    return (advantages_B.unsqueeze(-1) - coef * reward_to_go(kl_BT.detach(), mask_BT)) * mask_BT.to(kl_BT.dtype)


def kl_penalized_scores(rewards_B: Tensor, kl_BT: Tensor, mask_BT: Tensor, coef: float) -> Tensor:
    """Scores R_i - coef * sum_t kl_it (``kl_BT`` detached): the sequence_score mode, before group_advantages."""
    seq_kl_B = (kl_BT.detach() * mask_BT.to(kl_BT.dtype)).sum(dim=-1)
    return rewards_B - coef * seq_kl_B.to(rewards_B.dtype)
