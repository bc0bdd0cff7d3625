"""Per-token KL estimators against a frozen reference, and the exact full-vocabulary KL.

Notation (docs/kl_math.md): for a sampled token y ~ pi,

    l = log pi(y) - log pi_ref(y)        the log-ratio
    r = pi_ref(y) / pi(y) = exp(-l)
    s = grad log pi(y)                   the score

Every sampled estimator here estimates the REVERSE KL, KL(pi || pi_ref) = E_pi[l], because the samples
come from pi. What a value estimator's *gradient* does is a separate question: the registry entry of each
estimator declares both (value unbiased? which KL does its expected gradient follow, for each placement
and sampling scheme?), and the test suite and ``klgrpo verify-kl`` check every declaration against exact
answers.

    name    value                      E_pi[value]          grad as a loss term (on-policy)
    k1      l                          KL (unbiased)        0 in expectation: noise only
    k2      l^2 / 2                    biased, >= 0         grad KL(pi || ref)   (reverse)
    k3      exp(-l) + l - 1            KL (unbiased), >= 0  grad KL(ref || pi)   (FORWARD)
    k1_st   value of k1, gradient of k2 (straight-through)  grad KL(pi || ref)
    k3_st   value of k3, gradient of k2 (verl's "k3+")      grad KL(pi || ref)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from klgrpo.math.registry import Registry

#: Default guard for the exponential in k3: the log-ratio is clamped to [-20, 20] before exp(-l).
#: exp(20) = 4.9e8 is finite in float32, bfloat16 and float16; exp(100) is not (float32 overflows at 88.7).
#: The estimators here only clamp the value (k3_st's straight-through gradient is that of the UNclamped k2);
#: the objective (objective.kl_penalty_terms) gives every token with |l| > clamp zero KL-term gradient, for
#: every estimator and importance correction. Count those tokens with :func:`clamp_fraction`.
DEFAULT_LOG_RATIO_CLAMP = 20.0

#: Where the KL penalty enters the objective.
PLACEMENTS = ("loss", "reward", "both")
#: How samples relate to the policy being differentiated, and how the KL term is importance-corrected.
#: ``off_policy_in_graph``: w = pi / pi_old kept in the autograd graph (DeepSeek-V3.2; TRL's
#: ``use_bias_correction_kl``); ``off_policy_detached``: w detached (the classic bug for k3);
#: ``off_policy_none``: no weight at all.
SAMPLINGS = ("on_policy", "off_policy_in_graph", "off_policy_detached", "off_policy_none")
#: The first PPO epoch of a trainer that applies ``is_correction`` (pi_old == pi numerically, w = 1 in value):
#: token level only; loss rows equal the off-policy rows, reward rows the on-policy ones, "both" is declared.
FIRST_EPOCH_SAMPLINGS = ("first_epoch_in_graph", "first_epoch_detached")
#: What an expected gradient equals.
GRADIENT_TARGETS = ("reverse", "forward", "zero", "neither")


def log_ratio(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """l = log pi(y) - log pi_ref(y), computed in at least float32."""
    if logp.dtype in (torch.float16, torch.bfloat16):
        logp = logp.float()
    if ref_logp.dtype in (torch.float16, torch.bfloat16):
        ref_logp = ref_logp.float()
    return logp - ref_logp


@dataclass(frozen=True)
class Estimator:
    """A per-token KL estimator and what it promises.

    ``gradients`` maps (level, placement, sampling) to the KL that the expected gradient of
    ``beta * penalty`` follows (one of GRADIENT_TARGETS). level "token" is one categorical draw
    (one position); level "sequence" sums per-token terms over a sequence (loss: sum over tokens;
    reward: reward-to-go with gamma 1, no length normalisation) and compares with the gradient of the
    sequence-level KL. Off-policy sequences use per-token importance weights, which cannot correct
    the prefix distribution, so no off-policy sequence row follows either KL exactly.

    ``score_factor`` is f with grad k(y) = f(l) s, derived BY HAND from the formula (docs/kl_math.md,
    "Gradients"), never from ``fn``: klgrpo.verify.categorical checks ``fn``'s autograd against it per outcome.
    """

    name: str
    fn: Callable[..., Tensor]
    value_unbiased: bool
    nonnegative: bool
    uses_clamp: bool
    gradients: dict[tuple[str, str, str], str] = field(repr=False)
    score_factor: Callable[[Tensor], Tensor] = field(repr=False)
    summary: str = ""

    def gradient_target(self, placement: str, sampling: str = "on_policy", level: str = "token") -> str:
        return self.gradients[(level, placement, sampling)]


def _table(token: dict[tuple[str, str], str], sequence: dict[tuple[str, str], str],
           first_epoch_both: dict[str, str] | None = None) -> dict:
    """Fill the full (level, placement, sampling) table; unspecified entries are "neither".

    ``first_epoch_both`` maps a correction ("in_graph", "detached") to the token-level "both" target on the
    first epoch (mu = pi: the reward part is on-policy, the loss part off-policy; their sum is declared)."""
    table = {}
    for level, given in (("token", token), ("sequence", sequence)):
        for placement in PLACEMENTS:
            for sampling in SAMPLINGS:
                table[(level, placement, sampling)] = given.get((placement, sampling), "neither")
    for correction in ("in_graph", "detached"):
        first = f"first_epoch_{correction}"
        table[("token", "loss", first)] = table[("token", "loss", f"off_policy_{correction}")]
        table[("token", "reward", first)] = table[("token", "reward", "on_policy")]
        table[("token", "both", first)] = (first_epoch_both or {}).get(correction, "neither")
    return table


# The declarations below follow from E_pi[grad penalty] = E_pi[f(l) s] with f read off each formula:
# f = l -> reverse; f = 1 - exp(-l) -> forward; f constant -> zero (E_pi[s] = 0). With w = pi/mu in the
# graph, E_mu[grad(w k)] = E_pi[(k + k') s]; detached w gives E_pi[k' s]; no weight gives E_mu[k' s].
# A reward-placed value contributes E_pi[k(l_mu) s]: the trainer evaluates it at the ROLLOUT policy mu (a fixed
# reward of the sampled sequence; the PPO ratio is the importance weight). On-policy (and on the first epoch)
# mu = pi and it is E_pi[k s]; off-policy it is neither KL's gradient (for k1: grad KL(pi||ref) - grad KL(pi||mu)).
ESTIMATORS: Registry[Estimator] = Registry("KL estimator")


def estimator(name: str, *, value_unbiased: bool, nonnegative: bool, uses_clamp: bool, gradients: dict,
              score_factor: Callable[[Tensor], Tensor], summary: str) -> Callable:
    """Register the decorated ``fn(l, clamp) -> Tensor`` in ESTIMATORS as ``name``, with what it promises."""

    def add(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
        ESTIMATORS.register(name, Estimator(name=name, fn=fn, value_unbiased=value_unbiased, nonnegative=nonnegative,
                                            uses_clamp=uses_clamp, gradients=gradients, score_factor=score_factor,
                                            summary=summary))
        return fn

    return add


# Per-sample gradient factors f (grad k = f(l) s), derived by hand: grad k1 = s, grad k2 = l s,
# grad k3 = (1 - r) s with r = exp(-l); a straight-through "<base>_st" has the gradient of k2.
def _k2_factor(l: Tensor) -> Tensor:
    return l


def _k3_factor(l: Tensor) -> Tensor:
    return 1.0 - torch.exp(-l)


def _reward_rows(target: str) -> dict:
    return {("reward", "on_policy"): target}


def _clamped(l: Tensor, clamp: float | None) -> Tensor:
    return l if clamp is None else l.clamp(-clamp, clamp)


@estimator("k1", value_unbiased=True, nonnegative=False, uses_clamp=False,
           gradients=_table(
               token={("loss", "on_policy"): "zero", ("loss", "off_policy_detached"): "zero",
                      ("loss", "off_policy_in_graph"): "reverse", **_reward_rows("reverse"),
                      ("both", "on_policy"): "reverse"},
               sequence={("loss", "on_policy"): "zero", ("loss", "off_policy_detached"): "zero",
                         ("reward", "on_policy"): "reverse", ("both", "on_policy"): "reverse"},
               first_epoch_both={"detached": "reverse"},   # 0 (k1 loss, sg(w)) + E[l s] (reward)
           ),
           score_factor=torch.ones_like,
           summary="log-ratio; unbiased value, high variance; as a loss its gradient is pure noise")
def k1(l: Tensor, clamp: float | None = None) -> Tensor:
    """k1 = l. Unbiased for KL(pi||ref); either sign; grad = s (zero in expectation)."""
    return l


@estimator("k2", value_unbiased=False, nonnegative=True, uses_clamp=False,
           gradients=_table(token={("loss", "on_policy"): "reverse", ("loss", "off_policy_detached"): "reverse"},
                            sequence={}),
           score_factor=_k2_factor,
           summary="half squared log-ratio; biased value; per-token reverse-KL gradient as a loss")
def k2(l: Tensor, clamp: float | None = None) -> Tensor:
    """k2 = l^2 / 2. Biased, >= 0; grad = l s, whose expectation is grad KL(pi||ref)."""
    return 0.5 * l * l


@estimator("k3", value_unbiased=True, nonnegative=True, uses_clamp=True,
           gradients=_table(
               token={("loss", "on_policy"): "forward", ("loss", "off_policy_detached"): "forward",
                      ("loss", "off_policy_in_graph"): "reverse",
                      ("both", "on_policy"): "reverse"},
               sequence={("both", "on_policy"): "reverse"},
               first_epoch_both={"detached": "reverse"},   # E[(1 - r) s] (loss, sg(w)) + E[k3 s] (reward) = E[l s]
           ),
           score_factor=_k3_factor,
           summary="exp(-l)+l-1 (TRL/GRPO's formula); unbiased low-variance value; FORWARD-KL gradient as a loss")
def k3(l: Tensor, clamp: float | None = DEFAULT_LOG_RATIO_CLAMP) -> Tensor:
    """k3 = exp(-l) + l - 1 = (r - 1) - log r. Unbiased for KL(pi||ref), >= 0.

    grad = (1 - r) s, whose expectation is grad KL(ref||pi): the FORWARD KL. l is clamped to
    [-clamp, clamp] first so exp(-l) stays finite (``clamp=None`` disables the guard).
    """
    lc = _clamped(l, clamp)
    # expm1 keeps precision near l = 0, where k3 ~ l^2/2 is tiny.
    return torch.expm1(-lc) + lc


def _straight_through(value: Tensor, grad_source: Tensor) -> Tensor:
    """Forward value of ``value``, gradient of ``grad_source``."""
    return value.detach() + (grad_source - grad_source.detach())


@estimator("k1_st", value_unbiased=True, nonnegative=False, uses_clamp=False,
           gradients=_table(
               token={("loss", "on_policy"): "reverse", ("loss", "off_policy_detached"): "reverse",
                      **_reward_rows("reverse")},
               sequence={("reward", "on_policy"): "reverse"},
           ),
           score_factor=_k2_factor, summary="value of k1, gradient of k2 (straight-through)")
def k1_st(l: Tensor, clamp: float | None = None) -> Tensor:
    """Value of k1 (= l), gradient of k2 (= l s): an unbiased value with the reverse-KL gradient."""
    return _straight_through(k1(l), k2(l))


@estimator("k3_st", value_unbiased=True, nonnegative=True, uses_clamp=True,
           gradients=_table(token={("loss", "on_policy"): "reverse", ("loss", "off_policy_detached"): "reverse"},
                            sequence={}),
           score_factor=_k2_factor, summary="value of k3, gradient of k2 (straight-through, verl's k3+)")
def k3_st(l: Tensor, clamp: float | None = DEFAULT_LOG_RATIO_CLAMP) -> Tensor:
    """Value of k3, gradient of k2 (verl's ``k3+``): logs the low-variance k3, follows the reverse KL.

    Beyond the clamp the value is clamped but this function's gradient is still l (that of the unclamped k2);
    the objective zeroes the KL gradient of such tokens (objective.kl_penalty_terms)."""
    return _straight_through(k3(l, clamp), k2(l))


def kl_estimate(logp: Tensor, ref_logp: Tensor, estimator: str = "k3", *,
                clamp: float | None = DEFAULT_LOG_RATIO_CLAMP) -> Tensor:
    """Per-token KL(pi || pi_ref) estimate, same shape as ``logp``.

    logp = log pi(y_t), ref_logp = log pi_ref(y_t) for tokens y_t sampled from pi. Gradients flow
    through ``logp`` (and ``ref_logp`` if it requires grad, which a frozen reference never does).
    ``clamp`` bounds |l| for the estimators that exponentiate it (k3, k3_st); see
    :data:`DEFAULT_LOG_RATIO_CLAMP`. The result is float32 or wider.
    """
    est = ESTIMATORS[estimator]
    return est.fn(log_ratio(logp, ref_logp), clamp)


def clamp_fraction(logp: Tensor, ref_logp: Tensor, mask: Tensor | None = None,
                   clamp: float | None = DEFAULT_LOG_RATIO_CLAMP) -> Tensor:
    """Fraction of (masked) tokens whose |log-ratio| exceeds ``clamp`` (the ``kl/clamp_frac`` metric)."""
    if clamp is None:
        return torch.zeros((), device=logp.device)
    hit = (log_ratio(logp, ref_logp).detach().abs() > clamp).float()
    if mask is None:
        return hit.mean()
    mask = mask.to(hit.dtype)
    return (hit * mask).sum() / mask.sum().clamp(min=1.0)


def exact_kl(logits: Tensor, ref_logits: Tensor) -> Tensor:
    """KL(softmax(logits) || softmax(ref_logits)) along the last dim, over the leading dims.

    sum_v pi(v) (log pi(v) - log ref(v)), computed from log-softmax in float32 (or float64 when the
    inputs are float64), so it is finite and >= 0 up to rounding even for extreme logits.
    """
    dtype = torch.float64 if torch.float64 in (logits.dtype, ref_logits.dtype) else torch.float32
    logp = torch.log_softmax(logits.to(dtype), dim=-1)
    ref_logp = torch.log_softmax(ref_logits.to(dtype), dim=-1)
    # xlogy-style: where pi(v) == 0 the term is 0 even if ref(v) == 0 as well.
    p = logp.exp()
    terms = torch.where(p > 0, p * (logp - ref_logp), torch.zeros_like(p))
    return terms.sum(dim=-1)
