"""The metrics of one update: this rank's sums reduced across ranks, then turned into floats once."""

from __future__ import annotations

import torch
from torch import Tensor

from klgrpo.train.distributed import Distributed
from klgrpo.math.kl_control import KLObservation
from klgrpo.core.batch import StepBatch


def step_metrics(batch: StepBatch, sums: dict, maxes: dict, entropy_sum: Tensor, grad_norm, beta: float, lr: float,
                 timings: dict[str, float], dist: Distributed, device) -> tuple[dict[str, float], KLObservation]:
    """Reduce this rank's sums across ranks, then one host sync turns every metric into a float.

    Returns the metrics by name and the KL controller's observation (the same numbers, typed).

    Means over tokens divide by the step's (global) loss-mask tokens, means over completions by its (global)
    sequence count: the numbers do not depend on the micro-batch size or the process count.
    """
    rollout, g = batch.rollout, batch.rollout.group_size
    lengths = rollout.completion_mask.sum(-1).float()
    local = dict(sums)
    local.update({
        "entropy": entropy_sum, "completion_tokens": lengths.sum(), "truncated": rollout.truncated.float().sum(),
        "reward": batch.rewards.sum(), "reward_group_std": batch.rewards.view(-1, g).std(dim=1).sum(),
        "advantage_abs": batch.advantages.abs().sum(),
    })
    for name, values in batch.reward_columns.items():
        local[f"rewards/{name}"] = values.to(device).float().sum()
    local_max = dict(maxes, length=lengths.max())
    keys, max_keys = sorted(local), sorted(local_max)
    total = dist.sum(torch.stack([torch.as_tensor(local[k], dtype=torch.float32, device=device)
                                       .reshape(()) for k in keys]))
    peak = dist.max(torch.stack([local_max[k].float().reshape(()) for k in max_keys]))
    values = dict(zip(keys, total.tolist()))
    values.update({f"max/{k}": v for k, v in zip(max_keys, peak.tolist())})
    n_seq, n_tok = float(batch.normalizer.num_sequences), float(batch.normalizer.num_tokens)
    n_tok_safe = max(n_tok, 1.0)
    metrics = {
        "train/loss": values["loss"], "train/policy_loss": values["policy_loss"],
        "train/reward": values["reward"] / n_seq, "train/reward_std": values["reward_group_std"] / (n_seq / g),
        "train/advantage_abs": values["advantage_abs"] / n_seq,
        "completions/mean_length": values["completion_tokens"] / n_seq, "completions/max_length": values["max/length"],
        "completions/clipped_ratio": values["truncated"] / n_seq,
        "clip_ratio/low": values["clip_low"] / n_tok_safe, "clip_ratio/high": values["clip_high"] / n_tok_safe,
        "clip_ratio": (values["clip_low"] + values["clip_high"]) / n_tok_safe,
        "entropy": values["entropy"] / max(values["completion_tokens"], 1.0), "grad_norm": float(grad_norm),
    }
    metrics.update({k: v / n_seq for k, v in values.items() if k.startswith("rewards/")})
    if batch.ref_logp is not None:
        metrics.update({
            "train/kl_penalty": values.get("loss_kl_penalty", 0.0) + values.get("reward_kl_penalty", 0.0) / n_seq,
            "adaptive_kl/raw_kl": values["raw_kl"] / n_tok_safe,
            "adaptive_kl/adapted_kl": values["adapted_kl"] / n_tok_safe,
            "kl/k1": values["k1"] / n_tok_safe, "kl/k2": values["k2"] / n_tok_safe, "kl/k3": values["k3"] / n_tok_safe,
            "kl/max": values["max/k3"], "kl/clamp_frac": values["clamp"] / n_tok_safe,
            "kl/sequence_sum": values["k1"] / n_seq,
        })
        if "shaping_clip" in values:
            metrics["kl/shaping_clip_frac"] = values["shaping_clip"] / n_tok_safe
    metrics["adaptive_kl/current_beta"] = beta
    metrics["lr"] = lr
    metrics.update(timings)
    observation = KLObservation(token_mean=values.get("raw_kl", 0.0) / n_tok_safe,
                                sequence_sum=values.get("k1", 0.0) / n_seq, n_sequences=rollout.size,
                                reward=values["reward"] / n_seq)
    return metrics, observation
