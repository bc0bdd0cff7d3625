"""The metrics of one update: this rank's sums reduced across ranks, then turned into floats once."""

from __future__ import annotations

import math

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
    token_kl = local.pop("token_kl", None)
    quantiles = (kl_percentiles(token_kl, batch.loss_mask, int(batch.normalizer.max_len), dist)
                 if token_kl is not None else torch.zeros(0, device=device))
    local.update({
        "entropy": entropy_sum, "completion_tokens": lengths.sum(), "truncated": rollout.truncated.float().sum(),
        "reward": batch.rewards.sum(), "reward_group_std": batch.rewards.view(-1, g).std(dim=1).sum(),
        "advantage_abs": batch.advantages.abs().sum(),
    })
    if batch.ref_logp is not None:  # logp/reference_mean; the policy's sum comes with the micro-batches' sums
        local["logp_reference"] = (batch.ref_logp.float() * batch.loss_mask).sum()
    for name, values in batch.reward_columns.items():
        local[f"rewards/{name}"] = values.to(device).float().sum()
    local_max = dict(maxes, length=lengths.max())
    keys, max_keys = sorted(local), sorted(local_max)
    total = dist.sum(torch.stack([torch.as_tensor(local[k], dtype=torch.float32, device=device)
                                       .reshape(()) for k in keys]))
    peak = dist.max(torch.stack([local_max[k].float().reshape(()) for k in max_keys]))
    floats = torch.cat([total, peak, quantiles.to(total.device, torch.float32)]).tolist()  # the one host sync
    values = dict(zip(keys, floats))
    values.update({f"max/{k}": v for k, v in zip(max_keys, floats[len(keys):])})
    percentiles = dict(zip(PERCENTILE_NAMES, floats[len(keys) + len(max_keys):]))
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
    if "logp_policy" in values:
        metrics["logp/policy_mean"] = values["logp_policy"] / n_tok_safe
    if batch.ref_logp is not None:
        metrics.update({
            "train/kl_penalty": values.get("loss_kl_penalty", 0.0) + values.get("reward_kl_penalty", 0.0) / n_seq,
            "adaptive_kl/raw_kl": values["raw_kl"] / n_tok_safe,
            "adaptive_kl/adapted_kl": values["adapted_kl"] / n_tok_safe,
            "kl/k1": values["k1"] / n_tok_safe, "kl/k2": values["k2"] / n_tok_safe, "kl/k3": values["k3"] / n_tok_safe,
            "kl/max": values["max/k3"], "kl/clamp_frac": values["clamp"] / n_tok_safe,
            "kl/min": -values["max/negated_raw_kl"] if math.isfinite(values["max/negated_raw_kl"]) else 0.0,
            "logp/reference_mean": values["logp_reference"] / n_tok_safe,
            "kl/sequence_sum": values["k1"] / n_seq,
        })
        metrics.update(percentiles)
        if "loss_kl_penalty" in values:
            metrics["kl/loss_share"] = loss_share(values["loss_kl_penalty"], values["policy_abs"])
        if "shaping_clip" in values:
            metrics["kl/shaping_clip_frac"] = values["shaping_clip"] / n_tok_safe
    metrics["adaptive_kl/current_beta"] = beta
    metrics["lr"] = lr
    metrics.update(timings)
    observation = KLObservation(token_mean=values.get("raw_kl", 0.0) / n_tok_safe,
                                sequence_sum=values.get("k1", 0.0) / n_seq, n_sequences=rollout.size,
                                reward=values["reward"] / n_seq)
    return metrics, observation


#: The per-token KL percentiles logged each step (p50 / p90 / p99 of l and of k3 over the loss-mask tokens).
PERCENTILES = (0.5, 0.9, 0.99)
PERCENTILE_NAMES = tuple(f"kl/{what}_p{round(100 * q)}" for what in ("log_ratio", "k3") for q in PERCENTILES)


def masked_quantiles(values_KNT: Tensor, mask_NT: Tensor, qs: tuple[float, ...]) -> Tensor:
    """[K, len(qs)]: quantiles of each of the K rows over the masked positions, with torch.quantile's linear
    interpolation, without a host sync (one sort; masked-out positions sort last as +inf). NaN when no position
    is masked in."""
    flat = values_KNT.flatten(1).float()
    keep = mask_NT.flatten().bool()
    ordered = torch.where(keep, flat, torch.full_like(flat, float("inf"))).sort(dim=1).values
    n = keep.sum()
    pos = torch.tensor(qs, dtype=torch.float32, device=flat.device) * (n - 1).clamp(min=0)
    lo, hi = pos.floor().long(), pos.ceil().long()
    low, high = ordered[:, lo], ordered[:, hi]
    out = torch.lerp(low, torch.where(hi > lo, high, low), (pos - lo).expand_as(low))
    return torch.where(n > 0, out, torch.full_like(out, float("nan")))


def kl_percentiles(token_kl_2BT: Tensor, mask_BT: Tensor, max_len: int, dist: Distributed) -> Tensor:
    """The values of PERCENTILE_NAMES (flattened [2 x 3]) over every process's tokens: each rank pads its [B, T]
    to max_len and all ranks gather, so a 2-process run logs the same percentiles as one process."""
    t = token_kl_2BT.shape[-1]
    width = max(max_len, t)
    padded = torch.nn.functional.pad(token_kl_2BT.float(), (0, width - t))
    mask = torch.nn.functional.pad(mask_BT[:, :t].to(torch.bool), (0, width - t))
    if dist.enabled:
        padded = dist.gather(padded.transpose(0, 1).contiguous()).transpose(0, 1)
        mask = dist.gather(mask.to(torch.uint8)).bool()
    return masked_quantiles(padded, mask, PERCENTILES).flatten()


def loss_share(kl_term: float, policy_abs: float) -> float:
    """|beta * KL term| / (policy_abs + |beta * KL term|), in [0, 1] (0 when both are 0): how much of the loss's
    magnitude the KL is. ``policy_abs`` aggregates the per-token |policy loss| like the loss: the policy loss's
    value cancels between positive and negative advantages (exactly 0 on-policy under token_mean with equal
    lengths, which made the share 1 at every step), its per-token magnitude does not."""
    total = abs(kl_term) + abs(policy_abs)
    return abs(kl_term) / total if total > 0 else 0.0
