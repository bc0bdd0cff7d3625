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
    pg_it  = m_i * e_it * pg_it                          (m: the off-policy sequence mask, 1 off; e: the
                                                           top-entropy token mask, 1 off; policy_loss.py)
    loss   = aggregate(v * pg + beta * u * kl, mask, mode, global normaliser)
                                                          (v: the sampler correction's factor, its weight times
                                                           its keep, 1 unless rollout.sampler_correction or
                                                           rollout.divergence_mask; math/sampler_correction.py;
                                                           u: the KL term's factor, kl.masked_tokens below)
           - c * (B_mb / G) * sum_it e_it H_it / sum_it e_it  (the entropy bonus, c = loss.entropy_coef at this step:
                                                           the micro-batch's mean per-token entropy over the tokens
                                                           the policy term acts on, weighted by its share of the
                                                           step's G sequences: TRL's bonus, whatever the aggregation)

:func:`kl_penalty_terms` (the loss term) and :func:`reward_kl` (the reward value) are the ONLY implementation
of the KL term: the trainer reaches them through :func:`grpo_objective`, and ``klgrpo verify-kl`` calls
:func:`grpo_objective` itself (klgrpo.verify.penalty), so what verify-kl proves is what training runs.

kl.masked_tokens, the KL term of a token that a mask rejects (v's keep 0: a mask mode or a divergence mask; m or
e 0: the off-policy sequence mask or the top-entropy mask):

    auto   u = v                 rejected samples drop their KL (the sampler's masks), the policy masks keep it
    drop   u = v * m * e         every mask drops the token's KL with its policy term
    keep   u = v + (1 - keep)    every loss-mask token's KL counts; a token a sampler mask rejected at weight 1

auto is the default: a sample the sampler's mismatch rejects estimates no KL either (k3 at a ratio of 1e4 is
noise), while the off-policy and top-entropy masks only choose where the policy gradient acts (DeepSeek-V3.2 and
the top-entropy paper regularise every token). With the KL in the reward, the KL rides in the policy term's
advantage and goes where the policy term goes, whatever kl.masked_tokens says.

Returns the scalar loss plus per-micro-batch SUMS of the quantities to log, so the caller adds them over
micro-batches and divides once per step by global counts; nothing here syncs with the host.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

from klgrpo.math.advantages import KL_REWARD_MODES, apply_kl_penalty
from klgrpo.math.aggregation import Normalizer, aggregate
from klgrpo.math.full_kl import FULL_KL
from klgrpo.math.kl import ESTIMATORS, kl_estimate, log_ratio
from klgrpo.math.kl_shaping import clip_fraction, shape_kl
from klgrpo.math.policy_loss import POLICY_LOSSES, importance_weight, off_policy_mask
from klgrpo.math.sampler_correction import SamplerCorrection, SamplerFactors, sampler_factors

#: kl.masked_tokens's values (module docstring); auto first (the default).
KL_MASKED_TOKENS = ("auto", "drop", "keep")


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
    masked_tokens: str = "auto"        # KL_MASKED_TOKENS: whether a masked token's KL loss term counts

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


@dataclass(frozen=True)
class PolicyTerm:
    """The policy (surrogate) part of the loss: which registered surrogate and its clip settings.

    ``name`` is a POLICY_LOSSES name; ``delta`` (TRL's two-sided clip) and ``dual_clip`` (verl's clip_ratio_c)
    guard ppo_clip only, None: off (policy_loss.clipped_surrogate). ``params``: the loss's own settings, an
    instance of the dataclass it registered (``POLICY_LOSSES.params(name)``); None: that dataclass's defaults."""

    name: str = "ppo_clip"
    eps_low: float = 0.2
    eps_high: float = 0.2
    delta: float | None = None
    dual_clip: float | None = None
    off_policy_mask: float | None = None  # DeepSeek-V3.2's delta (policy_loss.off_policy_mask); None: off
    params: Any = None

    def _settings(self) -> dict:
        """The keywords of this surrogate beyond the clip: ppo_clip's guards, and ``params``, the loss's own
        settings (an instance of its registered dataclass), for a loss that declared some."""
        guards = {k: v for k, v in (("delta", self.delta), ("dual_clip", self.dual_clip)) if v is not None}
        declared = POLICY_LOSSES.params(self.name)
        params = self.params if self.params is not None else (declared() if declared is not None else None)
        return guards if params is None else {**guards, "params": params}

    def surrogate(self, logp_BT: Tensor, old_logp_BT: Tensor, advantages: Tensor, mask_BT: Tensor):
        return POLICY_LOSSES[self.name](logp_BT, old_logp_BT, advantages, mask_BT, self.eps_low, self.eps_high,
                                        **self._settings())


@dataclass(frozen=True)
class EntropyTerm:
    """How the policy's per-token entropy enters: ``coef`` is the bonus's coefficient at this step (the entropy
    controller's applied value; 0: no bonus), ``top_quantile`` rho keeps the policy term (and the bonus) on the
    top-rho fraction of the loss-mask tokens by entropy (1: every token; "Beyond the 80/20 rule")."""

    coef: float = 0.0
    top_quantile: float = 1.0

    @property
    def needs_entropy(self) -> bool:
        return self.coef != 0.0 or self.top_quantile < 1.0


def entropy_threshold(entropy_BT: Tensor, mask_BT: Tensor, top_quantile: float) -> Tensor:
    """The entropy at quantile 1 - rho of the loss-mask tokens (torch.quantile's linear interpolation, in float32
    as TRL computes it); a caller pools the tokens of several processes by passing them all."""
    values = entropy_BT.detach()[mask_BT.bool()].float()
    if values.numel() == 0:
        return torch.tensor(float("inf"), device=entropy_BT.device)
    return torch.quantile(values, 1.0 - top_quantile)


def top_entropy_mask(entropy_BT: Tensor, mask_BT: Tensor, threshold: Tensor) -> Tensor:
    """1 on the loss-mask tokens whose entropy is at least ``threshold``, else 0 (dtype of the mask's float)."""
    keep = ((entropy_BT.detach() * mask_BT.to(entropy_BT.dtype)) >= threshold) & mask_BT.bool()
    return keep.to(torch.promote_types(entropy_BT.dtype, torch.float32))


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
class ObjectiveSums:
    """Detached sums of one micro-batch for the step metrics (train/step_metrics.py turns them into means).

    Token counts and per-token values are summed over the loss-mask tokens; ``policy_loss``, ``policy_abs``
    and ``loss_kl_penalty`` are aggregated like the loss (their micro-batch sum is the step's value).
    The KL fields are None without a reference, ``loss_kl_penalty`` / ``reward_kl_penalty`` None when the KL
    does not enter there, ``shaping_clip`` None unless kl.shaping is clip. ``k3_max`` is a maximum, not a sum.
    Micro-batches combine with ``+``."""

    policy_loss: Tensor                      # the surrogate, aggregated as the loss
    policy_abs: Tensor                       # |surrogate| per token, aggregated as the loss (kl/loss_share)
    clip_low: Tensor                         # tokens where the lower clip bound was active
    clip_high: Tensor                        # tokens where the upper clip bound was active
    reward_kl_penalty: Tensor | None = None  # beta * sum of the reward KL over tokens
    loss_kl_penalty: Tensor | None = None    # beta * KL loss term, aggregated as the loss
    raw_kl: Tensor | None = None             # sum of the configured estimator's k over tokens (before shaping)
    adapted_kl: Tensor | None = None         # sum of the shaped k
    k1: Tensor | None = None                 # sums of the monitors k1 = l, k2, k3 of the same log-ratio
    k2: Tensor | None = None
    k3: Tensor | None = None
    clamped: Tensor | None = None            # tokens with |l| > kl.clamp
    shaping_clip: Tensor | None = None       # tokens where the clip shaping fires
    k3_max: Tensor | None = None             # max over tokens of k3
    negated_raw_kl_max: Tensor | None = None  # max over tokens of -k (the configured estimator's): kl/min
    acted_entropy: Tensor | None = None      # entropy summed over the tokens the policy term acts on (entropy given)
    acted_tokens: Tensor | None = None       # those tokens (the adaptive entropy controller's mean divides by it)
    entropy_bonus: Tensor | None = None      # coef * the bonus subtracted from the loss
    off_policy_masked: Tensor | None = None  # loss-mask tokens whose policy term the off-policy mask dropped
    off_policy_kl: Tensor | None = None      # sum over sequences of the mask's per-sequence mean KL estimate

    MAXIMA = ("k3_max", "negated_raw_kl_max")

    def __add__(self, other: "ObjectiveSums") -> "ObjectiveSums":
        combined = {}
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if a is None or b is None:
                combined[f.name] = a if b is None else b
            else:
                combined[f.name] = torch.maximum(a, b) if f.name in self.MAXIMA else a + b
        return ObjectiveSums(**combined)

    def present(self) -> dict[str, Tensor]:
        """The fields that hold a value, by name (the step metrics reduce them across processes)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


@dataclass
class ObjectiveOut:
    loss: Tensor                      # scalar, this micro-batch's share of the step loss
    sums: ObjectiveSums | None        # detached sums for the metrics; None with metrics=False
    token_kl: Tensor | None = None    # detached [2, B, T]: the log-ratio l and k3(l) per token, 0 off the mask


def kl_factor(masked_tokens: str, factors: SamplerFactors | None, policy_keep_BT: Tensor | None) -> Tensor | None:
    """u, the KL loss term's factor per kl.masked_tokens (module docstring); None: 1."""
    if masked_tokens not in KL_MASKED_TOKENS:
        raise KeyError(f"unknown kl.masked_tokens {masked_tokens!r}; choose one of: {', '.join(KL_MASKED_TOKENS)}")
    if masked_tokens == "keep":
        return None if factors is None else factors.product + (1.0 - factors.keep)
    sampler = None if factors is None else factors.product
    if masked_tokens == "auto" or policy_keep_BT is None:
        return sampler
    return policy_keep_BT if sampler is None else sampler * policy_keep_BT


@dataclass(frozen=True, eq=False)  # tensors: == between two micro-batches means nothing
class ObjectiveInputs:
    """The tensors of one micro-batch that :func:`grpo_objective` reads, [B, T] per token and [B] per sequence.

    ``ref_logp_BT`` is None when no reference exists. ``full_kl_BT``: math.full_kl's exact per-position KL, read
    only for ``kl.estimator`` "full" (loss only). ``entropy_BT``: the policy's per-token entropy, in the graph
    (when the EntropyTerm needs it). ``sampling_logp_BT``: the sampling policy's log-probs for the off-policy mask
    (None: ``old_logp_BT``). ``sampler_logp_BT``: the sampler's own log-probs mu of the tokens, which the
    SamplerCorrection (when on) turns into the factor v on the policy term and u on the KL term (None: no sampler
    log-probs, no factor). ``row_weights_B`` multiplies each sequence's per-token loss (None: 1; verify-kl's oracles
    pass the sequences' probabilities to take expectations by enumeration)."""

    logp_BT: Tensor
    old_logp_BT: Tensor
    ref_logp_BT: Tensor | None
    advantages_B: Tensor
    mask_BT: Tensor
    full_kl_BT: Tensor | None = None
    entropy_BT: Tensor | None = None
    sampling_logp_BT: Tensor | None = None
    sampler_logp_BT: Tensor | None = None
    row_weights_B: Tensor | None = None


@dataclass(frozen=True)
class ObjectiveTerms:
    """The plan's terms of the objective, at this step: ``kl`` how the KL enters (beta included), ``aggregation``
    (an AGGREGATIONS name) how per-token terms become the loss, ``policy`` the surrogate and its clip, ``entropy``
    the bonus and the top-entropy mask, ``sampler_correction`` the factor from the sampler's log-probs."""

    kl: KLTerm
    aggregation: str
    policy: PolicyTerm = PolicyTerm()
    entropy: EntropyTerm = EntropyTerm()
    sampler_correction: SamplerCorrection = SamplerCorrection()


def grpo_objective(inputs: ObjectiveInputs, terms: ObjectiveTerms, normalizer: Normalizer, *, metrics: bool = True,
                   entropy_cut: Tensor | None = None) -> ObjectiveOut:
    """Loss of one micro-batch (module docstring): ``inputs`` its tensors, ``terms`` the plan's terms,
    ``normalizer`` the step's global counts the aggregation divides by. ``metrics=False`` leaves ``sums`` None.
    ``entropy_cut``: the top-entropy threshold when the caller pools more tokens (None: :func:`entropy_threshold`
    of these)."""
    kl, aggregation, logp_BT, old_logp_BT = terms.kl, terms.aggregation, inputs.logp_BT, inputs.old_logp_BT
    if kl.estimator == FULL_KL and kl.in_reward:
        raise ValueError(f"kl.estimator full enters the loss only, not kl.placement {kl.placement}")
    mask = inputs.mask_BT.to(torch.float32)
    advantages, reward_kl_penalty = _kl_in_reward(old_logp_BT, inputs.ref_logp_BT, inputs.advantages_B, mask, kl)
    pg = terms.policy.surrogate(logp_BT, old_logp_BT, advantages, mask)
    sampling_logp_BT = old_logp_BT if inputs.sampling_logp_BT is None else inputs.sampling_logp_BT
    masks = _policy_masks(logp_BT, sampling_logp_BT, inputs.advantages_B, mask, terms.policy, inputs.entropy_BT,
                          terms.entropy, entropy_cut)
    policy_BT = pg.loss_BT * masks.keep_BT if masks.keep_BT is not None else pg.loss_BT
    factors = (sampler_factors(old_logp_BT, inputs.sampler_logp_BT, mask, terms.sampler_correction)
               if inputs.sampler_logp_BT is not None and terms.sampler_correction.on else None)
    per_token = policy_BT if factors is None else policy_BT * factors.product
    loss_kl_penalty, kl_sums, token_kl = None, None, None
    if inputs.ref_logp_BT is not None and (metrics or (kl.in_loss and kl.coef > 0)):
        penalty = kl_penalty_terms(logp_BT, old_logp_BT, inputs.ref_logp_BT, mask, kl, ratio_BT=pg.ratio_BT,
                                   full_kl_BT=inputs.full_kl_BT)
        u = kl_factor(kl.masked_tokens, factors, masks.keep_BT)
        per_token, loss_kl_penalty = _kl_in_loss(per_token, penalty, u, mask, kl, aggregation, normalizer, metrics)
        kl_sums, token_kl = _kl_monitors(penalty, mask, kl) if metrics else (None, None)
    if inputs.row_weights_B is not None:
        per_token = per_token * inputs.row_weights_B.detach().unsqueeze(-1)
    loss = aggregate(per_token, mask, aggregation, normalizer)
    bonus = None
    if terms.entropy.coef != 0.0:
        bonus = entropy_bonus(inputs.entropy_BT, masks.acted_BT, inputs.row_weights_B, normalizer)
        loss = loss - terms.entropy.coef * bonus
    if not metrics:
        return ObjectiveOut(loss=loss, sums=None)
    sums = ObjectiveSums(
        policy_loss=aggregate(policy_BT.detach(), mask, aggregation, normalizer),
        policy_abs=aggregate(policy_BT.detach().abs(), mask, aggregation, normalizer),
        clip_low=(pg.clipped_low_BT.float() * mask).sum(), clip_high=(pg.clipped_high_BT.float() * mask).sum(),
        reward_kl_penalty=reward_kl_penalty, loss_kl_penalty=loss_kl_penalty, **(kl_sums or {}),
        **_entropy_sums(inputs.entropy_BT, masks, mask, terms.entropy, bonus))
    return ObjectiveOut(loss=loss, sums=sums, token_kl=token_kl)


def _kl_in_loss(per_token: Tensor, penalty, u_BT: Tensor | None, mask: Tensor, kl: KLTerm, aggregation: str,
                normalizer: Normalizer, metrics: bool) -> tuple[Tensor, Tensor | None]:
    """(the per-token loss with beta times u times the KL's loss term added when the KL enters the loss, that term
    aggregated for the metrics or None)."""
    if not (kl.in_loss and kl.coef > 0):
        return per_token, None
    logged = kl.coef * aggregate(penalty.loss_term_BT.detach(), mask, aggregation, normalizer) if metrics else None
    term_BT = penalty.loss_term_BT if u_BT is None else penalty.loss_term_BT * u_BT
    return per_token + kl.coef * term_BT, logged


def _kl_in_reward(old_logp_BT: Tensor, ref_logp_BT: Tensor | None, advantages_B: Tensor, mask: Tensor,
                  kl: KLTerm) -> tuple[Tensor, Tensor | None]:
    """(the advantages the surrogate sees, beta times the rollout's reward KL summed over tokens, or None): with
    the KL in the reward per token (reward_to_go) the advantages become per-token returns; with sequence_score
    the penalty is already in ``advantages_B``."""
    if ref_logp_BT is None or not kl.in_reward or kl.coef <= 0:
        return advantages_B, None
    reward_kl_BT = reward_kl(old_logp_BT, ref_logp_BT, kl)
    advantages = apply_kl_penalty(advantages_B, reward_kl_BT, mask, kl.coef) if kl.reward_to_go else advantages_B
    return advantages, kl.coef * (reward_kl_BT.detach() * mask).sum()


@dataclass
class PolicyMasks:
    """The factors on the policy term of one micro-batch: ``keep_BT`` (the off-policy and top-entropy masks
    multiplied, broadcastable to [B, T]; None: neither is on), ``acted_BT`` (the loss-mask tokens the policy term
    acts on: the bonus averages over them), the off-policy mask's per-sequence KL [B, 1] and its own keep."""

    keep_BT: Tensor | None
    acted_BT: Tensor
    off_policy_kl_B1: Tensor | None = None
    off_policy_keep: Tensor | None = None


def _policy_masks(logp_BT: Tensor, sampling_logp_BT: Tensor, advantages: Tensor, mask: Tensor, policy: PolicyTerm,
                  entropy_BT: Tensor | None, entropy: EntropyTerm, entropy_cut: Tensor | None) -> PolicyMasks:
    keep, acted, seq_kl, opm = None, mask, None, None
    if entropy.needs_entropy and entropy_BT is None:
        raise ValueError("an entropy bonus or top-entropy mask needs entropy_BT, the policy's per-token entropy")
    if policy.off_policy_mask is not None:
        opm, seq_kl = off_policy_mask(advantages, logp_BT, sampling_logp_BT, mask, policy.off_policy_mask)
        keep = opm
    if entropy.top_quantile < 1.0:
        cut = entropy_threshold(entropy_BT, mask, entropy.top_quantile) if entropy_cut is None else entropy_cut
        top = top_entropy_mask(entropy_BT, mask, cut)
        keep = top if keep is None else keep * top
        acted = mask * top
    return PolicyMasks(keep_BT=keep, acted_BT=acted, off_policy_kl_B1=seq_kl, off_policy_keep=opm)


def entropy_bonus(entropy_BT: Tensor, acted_BT: Tensor, row_weights_B: Tensor | None,
                  normalizer: Normalizer) -> Tensor:
    """The bonus of one micro-batch before its coefficient (module docstring): its mean per-token entropy over
    ``acted_BT`` times its share B_mb / G of the step's sequences. With ``row_weights_B`` (the exact oracles'
    sequence probabilities) the weighted mean over the acted tokens, the rows being the whole distribution."""
    acted = acted_BT.to(entropy_BT.dtype)
    if row_weights_B is not None:
        acted = acted * row_weights_B.detach().to(entropy_BT.dtype).unsqueeze(-1)
        return (entropy_BT * acted).sum() / acted.sum().clamp(min=torch.finfo(acted.dtype).tiny)
    share = acted.shape[0] / normalizer.num_sequences
    return (entropy_BT * acted).sum() / acted.sum().clamp(min=1.0) * share


@torch.no_grad()
def _entropy_sums(entropy_BT: Tensor | None, masks: PolicyMasks, mask: Tensor, entropy: EntropyTerm,
                  bonus: Tensor | None) -> dict[str, Tensor]:
    """The ObjectiveSums fields of the entropy term and the off-policy mask (those that are on)."""
    out = {}
    if entropy_BT is not None:
        acted = masks.acted_BT.to(entropy_BT.dtype)
        out.update(acted_entropy=(entropy_BT.detach() * acted).sum(), acted_tokens=acted.sum())
    if bonus is not None:
        out["entropy_bonus"] = entropy.coef * bonus.detach()
    if masks.off_policy_keep is not None:
        dropped = (1.0 - masks.off_policy_keep) * mask
        out.update(off_policy_masked=dropped.sum(), off_policy_kl=masks.off_policy_kl_B1.sum())
    return out


@torch.no_grad()
def _kl_monitors(penalty: KLPenalty, mask: Tensor, kl: KLTerm) -> tuple[dict[str, Tensor], Tensor]:
    """The KL fields of ObjectiveSums: raw, adapted and the monitors k1 (= l), k2, k3 of the same log-ratio,
    masked and summed at once; and the masked per-token l and k3, stacked [2, B, T], for the step's
    percentiles (train/step_metrics.py)."""
    ratio_BT = penalty.log_ratio_BT.detach()
    monitors = [ESTIMATORS[name].fn(ratio_BT, kl.clamp) for name in ("k2", "k3")]
    masked = torch.stack([penalty.raw_BT.detach(), penalty.adapted_BT.detach(), ratio_BT, *monitors]) * mask
    sums = dict(zip(("raw_kl", "adapted_kl", "k1", "k2", "k3"), masked.sum(dim=(1, 2)).unbind()))
    sums["k3_max"] = masked[4].max()  # the heavy-tailed estimator's spikes
    # kl/min: the smallest per-token KL the loss uses (negative for k1; for k2, k3 a negative value is a bug)
    sums["negated_raw_kl_max"] = torch.where(mask > 0, -penalty.raw_BT.detach(), float("-inf")).max()
    sums["clamped"] = ((ratio_BT.abs() > kl.clamp).float() * mask).sum() if kl.clamp else torch.zeros(())
    if kl.shaping == "clip":
        sums["shaping_clip"] = clip_fraction(penalty.raw_BT, mask, kl.clip_threshold) * mask.sum()
    return sums, torch.stack((masked[2], masked[4]))
