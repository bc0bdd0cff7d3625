"""The metrics of one update: this rank's sums reduced across ranks, then turned into floats once."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from klgrpo.core.batch import StepBatch
from klgrpo.math.kl import DEFAULT_LOG_RATIO_CLAMP
from klgrpo.math.kl_control import KLObservation
from klgrpo.math.objective import ObjectiveSums
from klgrpo.math.sampler_correction import SamplerCorrection, mismatch_per_token, sampler_factors
from klgrpo.train import metric_names as m
from klgrpo.train.distributed import Distributed
from klgrpo.train.metric_names import (
    ENTROPY_QUANTILE_NAMES,
    ENTROPY_QUANTILES,
    PERCENTILE_NAMES,
    PERCENTILES,
)


@dataclass
class StepSums:
    """What one rank's micro-batches of an update add up to (trainer.accumulate_gradients)."""

    loss: Tensor                                 # the backpropagated loss, summed over micro-batches
    entropy: Tensor | None                       # per-token entropy summed over the completion tokens (None: off)
    objective: ObjectiveSums                     # the built-in objective's sums (it runs beside a custom loss too)
    custom: dict[str, Tensor] = field(default_factory=dict)  # a custom loss's metrics, summed over micro-batches
    token_kl: Tensor | None = None               # [2, B, T]: l and k3 per token, for the percentiles
    logp_policy: Tensor | None = None            # the policy's log-probs summed over the loss-mask tokens
    token_entropy: Tensor | None = None          # [B, T]: per-token entropy, 0 off the completion mask


@dataclass
class _Reduced:
    """The step's sums over every rank, as floats (one host sync)."""

    objective: ObjectiveSums
    step: dict[str, float]
    rewards: dict[str, float]
    peaks: dict[str, float]
    kl_percentiles: dict[str, float]
    entropy_spread: dict[str, float]


def step_metrics(batch: StepBatch, sums: StepSums, grad_norm, beta: float, lr: float, timings: dict[str, float],
                 dist: Distributed, device) -> tuple[dict[str, float], KLObservation]:
    """Reduce this rank's sums across ranks, then one host sync turns every metric into a float.

    Returns the metrics by name and the KL controller's observation (the same numbers, typed).

    Means over tokens divide by the step's (global) loss-mask tokens, means over completions by its (global)
    sequence count: the numbers do not depend on the micro-batch size or the process count.
    """
    r = _reduce(batch, sums, dist, device)
    obj_f, st, g = r.objective, r.step, batch.rollout.group_size
    n_seq, n_tok = float(batch.normalizer.num_sequences), float(batch.normalizer.num_tokens)
    n_tok_safe = max(n_tok, 1.0)
    metrics = {
        m.LOSS: st["loss"], m.POLICY_LOSS: obj_f.policy_loss,
        m.REWARD: st["reward"] / n_seq, m.REWARD_STD: st["reward_group_std"] / (n_seq / g),
        m.ADVANTAGE_ABS: st["advantage_abs"] / n_seq,
        m.MEAN_LENGTH: st["completion_tokens"] / n_seq, m.MAX_LENGTH: r.peaks["length"],
        m.TRUNCATED_RATIO: st["truncated"] / n_seq,
        m.CLIP_RATIO_LOW: obj_f.clip_low / n_tok_safe, m.CLIP_RATIO_HIGH: obj_f.clip_high / n_tok_safe,
        m.CLIP_RATIO: (obj_f.clip_low + obj_f.clip_high) / n_tok_safe,
        m.GRAD_NORM: float(grad_norm),
    }
    if "entropy" in st:
        metrics[m.ENTROPY] = st["entropy"] / max(st["completion_tokens"], 1.0)
        metrics.update(r.entropy_spread)
    metrics.update(_entropy_and_mask_metrics(obj_f, n_seq, n_tok_safe))
    metrics.update({m.reward_metric(name): v / n_seq for name, v in r.rewards.items()})
    if "logp_policy" in st:
        metrics[m.LOGP_POLICY_MEAN] = st["logp_policy"] / n_tok_safe
    has_kl = batch.ref_logp is not None
    if has_kl:
        metrics.update(_kl_metrics(r, n_seq, n_tok_safe))
    metrics[m.BETA] = beta
    metrics[m.LR] = lr
    metrics.update(timings)
    # Without a reference the controller sees no KL (0): beta stays where the controller's rule puts it.
    observation = KLObservation(token_mean=obj_f.raw_kl / n_tok_safe if has_kl else 0.0,
                                sequence_sum=obj_f.k1 / n_seq if has_kl else 0.0, n_sequences=batch.rollout.size,
                                reward=st["reward"] / n_seq,
                                entropy=(obj_f.acted_entropy / max(obj_f.acted_tokens, 1.0)
                                         if obj_f.acted_entropy is not None else None))
    return metrics, observation


def _reduce(batch: StepBatch, sums: StepSums, dist: Distributed, device) -> _Reduced:
    """This rank's sums, maxima and percentiles reduced across ranks and read back in one host sync."""
    rollout, g = batch.rollout, batch.rollout.group_size
    lengths = rollout.completion_mask.sum(-1).float()
    max_len = int(batch.normalizer.max_len)
    quantiles = (kl_percentiles(sums.token_kl, batch.loss_mask, max_len, dist)
                 if sums.token_kl is not None else torch.zeros(0, device=device))
    if sums.token_entropy is not None:  # the entropy's spread, over the completion tokens (as the entropy's mean)
        quantiles = torch.cat([quantiles, token_percentiles(sums.token_entropy[None], rollout.completion_mask,
                                                            max_len, dist, ENTROPY_QUANTILES).to(quantiles.device)])
    objective = sums.objective.present()
    peaks = {"length": lengths.max(), **{k: objective.pop(k) for k in ObjectiveSums.MAXIMA if k in objective}}
    step = {"loss": sums.loss, "completion_tokens": lengths.sum(),
            "truncated": rollout.truncated.float().sum(), "reward": batch.rewards.sum(),
            "reward_group_std": batch.rewards.view(-1, g).std(dim=1).sum(),
            "advantage_abs": batch.advantages.abs().sum()}
    if sums.logp_policy is not None:
        step["logp_policy"] = sums.logp_policy
    if sums.entropy is not None:
        step["entropy"] = sums.entropy
    if batch.ref_logp is not None:  # logp/reference_mean
        step["logp_reference"] = (batch.ref_logp.float() * batch.loss_mask).sum()
    rewards = {name: values.to(device).float().sum() for name, values in batch.reward_columns.items()}
    summed = [*objective.values(), *step.values(), *rewards.values()]
    total = dist.sum(torch.stack([torch.as_tensor(v, dtype=torch.float32, device=device).reshape(())
                                  for v in summed]))
    peak = dist.max(torch.stack([v.float().reshape(()) for v in peaks.values()]))
    floats = iter(torch.cat([total, peak, quantiles.to(total.device, torch.float32)]).tolist())  # the one sync
    obj_f = ObjectiveSums(**{k: next(floats) for k in objective})
    st = {k: next(floats) for k in step}
    reward_f = {k: next(floats) for k in rewards}
    peak_f = {k: next(floats) for k in peaks}
    obj_f.k3_max, obj_f.negated_raw_kl_max = peak_f.get("k3_max"), peak_f.get("negated_raw_kl_max")
    percentiles = dict(zip(PERCENTILE_NAMES if sums.token_kl is not None else (), floats))
    entropy_spread = dict(zip(ENTROPY_QUANTILE_NAMES if sums.token_entropy is not None else (), floats))
    return _Reduced(obj_f, st, reward_f, peak_f, percentiles, entropy_spread)


def _kl_metrics(r: _Reduced, n_seq: float, n_tok: float) -> dict[str, float]:
    """The KL's metrics (only with a reference): per token over the loss-mask tokens, per completion for the sum."""
    obj_f = r.objective
    metrics = {
        m.KL_PENALTY: (obj_f.loss_kl_penalty or 0.0) + (obj_f.reward_kl_penalty or 0.0) / n_seq,
        m.RAW_KL: obj_f.raw_kl / n_tok, m.ADAPTED_KL: obj_f.adapted_kl / n_tok,
        m.KL_K1: obj_f.k1 / n_tok, m.KL_K2: obj_f.k2 / n_tok, m.KL_K3: obj_f.k3 / n_tok,
        m.KL_MAX: obj_f.k3_max, m.KL_CLAMP_FRAC: obj_f.clamped / n_tok,
        m.KL_MIN: (-obj_f.negated_raw_kl_max if obj_f.negated_raw_kl_max is not None
                   and math.isfinite(obj_f.negated_raw_kl_max) else 0.0),
        m.LOGP_REFERENCE_MEAN: r.step["logp_reference"] / n_tok,
        m.KL_SEQUENCE_SUM: obj_f.k1 / n_seq,
        **r.kl_percentiles,
    }
    if obj_f.loss_kl_penalty is not None:
        metrics[m.KL_LOSS_SHARE] = loss_share(obj_f.loss_kl_penalty, obj_f.policy_abs)
    if obj_f.shaping_clip is not None:
        metrics[m.KL_SHAPING_CLIP_FRAC] = obj_f.shaping_clip / n_tok
    return metrics


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


def _entropy_and_mask_metrics(obj_f: ObjectiveSums, n_seq: float, n_tok: float) -> dict[str, float]:
    """The entropy bonus and the off-policy mask's metrics, where they are on."""
    out = {}
    if obj_f.entropy_bonus is not None:
        out[m.ENTROPY_BONUS] = obj_f.entropy_bonus
    if obj_f.off_policy_masked is not None:
        out[m.OFF_POLICY_MASKED] = obj_f.off_policy_masked / n_tok
        out[m.OFF_POLICY_KL] = obj_f.off_policy_kl / n_seq
    return out


def kl_percentiles(token_kl_2BT: Tensor, mask_BT: Tensor, max_len: int, dist: Distributed) -> Tensor:
    """The values of PERCENTILE_NAMES (flattened [2 x 3]) over every process's tokens."""
    return token_percentiles(token_kl_2BT, mask_BT, max_len, dist, PERCENTILES)


def token_percentiles(values_KBT: Tensor, mask_BT: Tensor, max_len: int, dist: Distributed,
                      qs: tuple[float, ...]) -> Tensor:
    """Quantiles ``qs`` of each of the K rows over every process's masked tokens, flattened [K x len(qs)]: each
    rank pads its [B, T] to max_len and all ranks gather, so a 2-process run logs the same numbers as one."""
    token_kl_2BT = values_KBT
    t = token_kl_2BT.shape[-1]
    width = max(max_len, t)
    padded = torch.nn.functional.pad(token_kl_2BT.float(), (0, width - t))
    mask = torch.nn.functional.pad(mask_BT[:, :t].to(torch.bool), (0, width - t))
    if dist.enabled:
        padded = dist.gather(padded.transpose(0, 1).contiguous()).transpose(0, 1)
        mask = dist.gather(mask.to(torch.uint8)).bool()
    return masked_quantiles(padded, mask, qs).flatten()


def sampler_metrics(old_logp_BT: Tensor, sampler_logp_BT: Tensor, mask_BT: Tensor, max_len: int,
                    dist: Distributed, correction: SamplerCorrection | None = None) -> dict[str, float]:
    """The sampler-to-trainer panel over every process's completion tokens (docs/metrics.md, "sampler/"), with
    r_t = pi_old(y_t) / mu(y_t) per token of the sampler mu and R = prod_t r_t per sequence: |log r| (mean, p99,
    max) and its signed mean; KL(mu || pi_old) by k1 and k3; chi-square per token and per sequence; the normalised
    effective sample size of the sequence weights R; the perplexity ratio; r's quantiles before any correction; and
    with ``correction`` on, the tokens and sequences it truncated or masked."""
    diff_BT, kl_BT = mismatch_per_token(old_logp_BT.detach(), sampler_logp_BT)
    dtype = diff_BT.dtype
    mask = mask_BT[:, :diff_BT.shape[-1]].to(dtype)
    log_r = torch.nan_to_num(old_logp_BT.detach().to(dtype) - sampler_logp_BT.to(dtype), nan=0.0) * mask
    r = log_r.clamp(max=DEFAULT_LOG_RATIO_CLAMP).exp()
    rows = (mask.sum(-1) > 0).to(dtype)  # the sequences with a completion token
    seq_log_r = log_r.sum(-1).clamp(max=DEFAULT_LOG_RATIO_CLAMP)  # R's log, bounded so exp stays finite
    big_r = seq_log_r.exp() * rows
    ppl = (-log_r.sum(-1) / mask.sum(-1).clamp(min=1)).exp() * rows  # PPL_trainer / PPL_sampler per sequence
    changed = torch.zeros_like(mask)
    if correction is not None and correction.on:  # truncated (the weight is not the raw ratio) or rejected
        factors = sampler_factors(old_logp_BT.detach(), sampler_logp_BT, mask_BT[:, :mask.shape[-1]], correction)
        raw = (log_r.sum(-1, keepdim=True) if correction.sequence_level else log_r).exp()
        truncated = (factors.weight != raw) if correction.mode != "none" else torch.zeros_like(raw, dtype=torch.bool)
        changed = (truncated | (factors.keep == 0)).expand_as(mask).to(dtype) * mask
    total = dist.sum(torch.stack([
        (diff_BT * mask).sum(), (kl_BT * mask).sum(), log_r.sum(), mask.sum(), (((r - 1) ** 2) * mask).sum(),
        ((big_r - 1) ** 2 * rows).sum(), big_r.sum(), (big_r ** 2).sum(), rows.sum(), ppl.sum(), changed.sum(),
        ((changed.sum(-1) > 0).to(dtype) * rows).sum()]).float())
    peaks = dist.max(torch.stack([torch.where(mask > 0, diff_BT, torch.zeros_like(diff_BT)).max(),
                                  torch.where(mask > 0, r, torch.zeros_like(r)).max()]).float())
    quantiles = torch.cat([token_percentiles(diff_BT[None], mask, max_len, dist, (0.99,)),
                           token_percentiles(r[None], mask, max_len, dist, (0.01, 0.50, 0.99))])
    (diff_sum, kl_sum, signed_sum, tokens, chi2_sum, chi2_seq_sum, r_sum, r2_sum, seqs, ppl_sum, changed_tokens,
     changed_seqs) = total.tolist()
    peak_f, r_max = peaks.tolist()
    p99_f, r01, r50, r99 = quantiles.tolist()
    tokens, seqs = max(tokens, 1.0), max(seqs, 1.0)
    by_length = _sampler_by_length(mask, kl_BT, r, big_r, rows, changed, dist)
    return {**by_length, m.SAMPLER_LOGP_DIFF_MEAN: diff_sum / tokens, m.SAMPLER_LOGP_DIFF_P99: p99_f,
            m.SAMPLER_LOGP_DIFF_MAX: peak_f, m.SAMPLER_KL: kl_sum / tokens,
            m.SAMPLER_LOGP_DIFF_SIGNED: signed_sum / tokens,
            m.SAMPLER_KL_K1: -signed_sum / tokens, m.SAMPLER_KL_K3: kl_sum / tokens,
            m.SAMPLER_CHI2_TOKEN: chi2_sum / tokens, m.SAMPLER_CHI2_SEQ: chi2_seq_sum / seqs,
            m.SAMPLER_ESS: normalised_ess(r_sum, r2_sum, seqs),
            m.SAMPLER_PPL_RATIO: ppl_sum / seqs, m.SAMPLER_RATIO_P01: r01, m.SAMPLER_RATIO_P50: r50,
            m.SAMPLER_RATIO_P99: r99, m.SAMPLER_RATIO_MAX: r_max,
            m.SAMPLER_MASKED_TOKEN_FRAC: changed_tokens / tokens, m.SAMPLER_MASKED_SEQ_FRAC: changed_seqs / seqs}


def normalised_ess(r_sum: float, r2_sum: float, sequences: float) -> float:
    """(sum R)^2 / (N sum R^2) of N sequence weights R: 1 when they are equal (and with no weights at all)."""
    return r_sum ** 2 / (sequences * r2_sum) if r2_sum > 0 and sequences > 0 else 1.0


def length_quartiles(lengths_B: Tensor, dist: Distributed) -> Tensor | None:
    """Each local completion's completion-length quartile, 0..3, ranked over every process's completions (ties
    in rank order, so each quartile holds a quarter); None with fewer than 4 completions."""
    everyone = dist.gather(lengths_B)
    n = everyone.numel()
    if n < 4:
        return None
    order = torch.argsort(everyone, stable=True)
    position = torch.empty_like(order)
    position[order] = torch.arange(n, device=order.device)
    return (position * 4 // n)[dist.local_slice(n)]


def _sampler_by_length(mask: Tensor, kl_BT: Tensor, r: Tensor, big_r: Tensor, rows: Tensor, changed: Tensor,
                       dist: Distributed) -> dict[str, float]:
    """sampler/q<1-4>/kl_k3, chi2_token, ess, masked_token_frac: the panel over each completion-length quartile."""
    quartile = length_quartiles(mask.sum(-1), dist)
    if quartile is None:
        return {}
    per_sequence = torch.stack([(kl_BT * mask).sum(-1), (((r - 1) ** 2) * mask).sum(-1), mask.sum(-1), big_r,
                                big_r ** 2, rows, changed.sum(-1)], dim=-1)  # [B, 7]
    one_hot = torch.nn.functional.one_hot(quartile, 4).to(per_sequence.dtype)  # [B, 4]
    totals = dist.sum((one_hot.T @ per_sequence).float()).tolist()  # [4, 7]
    out = {}
    for q, (kl, chi2, tokens, r_sum, r2_sum, seqs, changed_tokens) in enumerate(totals, start=1):
        tokens = max(tokens, 1.0)
        out[m.sampler_quartile(q, "kl_k3")] = kl / tokens
        out[m.sampler_quartile(q, "chi2_token")] = chi2 / tokens
        out[m.sampler_quartile(q, "ess")] = normalised_ess(r_sum, r2_sum, seqs)
        out[m.sampler_quartile(q, "masked_token_frac")] = changed_tokens / tokens
    return out


def kept_set_metrics(log_kept_mass_BT: Tensor, mismatch_BT: Tensor, mask_BT: Tensor, max_len: int,
                     dist: Distributed) -> dict[str, float]:
    """Truncated sampling's panel over every process's completion tokens: the kept mass pi_old(S_t) (mean, p10,
    min) and the share of positions whose kept set the trainer rebuilt differently (core/kept_sets.py)."""
    mass_BT = log_kept_mass_BT.float().exp()
    mask = mask_BT.to(torch.float32)
    total = dist.sum(torch.stack([(mass_BT * mask).sum(), (mismatch_BT.float() * mask).sum(), mask.sum()]))
    low = -dist.max((-torch.where(mask > 0, mass_BT, torch.ones_like(mass_BT))).max().reshape(1))
    p10 = token_percentiles(mass_BT[None], mask, max_len, dist, (0.10,))
    mass_sum, mismatched, tokens, low_f, p10_f = torch.cat([total, low, p10.to(total.device)]).tolist()
    tokens = max(tokens, 1.0)
    return {m.SAMPLER_KEPT_MASS: mass_sum / tokens, m.SAMPLER_KEPT_MASS_P10: p10_f, m.SAMPLER_KEPT_MASS_MIN: low_f,
            m.SAMPLER_KEPT_SET_MISMATCH: mismatched / tokens}


def loss_share(kl_term: float, policy_abs: float) -> float:
    """|beta * KL term| / (policy_abs + |beta * KL term|), in [0, 1] (0 when both are 0): how much of the loss's
    magnitude the KL is. ``policy_abs`` aggregates the per-token |policy loss| like the loss: the policy loss's
    value cancels between positive and negative advantages (exactly 0 on-policy under token_mean with equal
    lengths, which made the share 1 at every step), its per-token magnitude does not."""
    total = abs(kl_term) + abs(policy_abs)
    return abs(kl_term) / total if total > 0 else 0.0
