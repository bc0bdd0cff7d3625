"""Masks and the KL: what the KL term of a masked token does under each ``kl.masked_tokens`` rule, for every mask
klgrpo applies, checked against the rule written out from its definition (docs/algorithm.md, "Masked tokens").

On the sequence toy (31 sequences, exact sums) with a sampler mu that is not the policy (pi_old = pi, the first
update of a batch), every mask: the sampler correction's token_mask and sequence_mask, each divergence mask
(rollout.divergence_mask), the off-policy sequence mask and the top-entropy mask (the policy's own selection
masks). Thresholds are set where each mask rejects some tokens and keeps others. For each mask, rule (auto, drop,
keep) and estimator (k1, k2, k3, k3_st, full) the trainer's objective (``grpo_objective``, the KL in the loss)
gives the KL term's part of the expected loss, E_mu[sum_t u_t k_t] (the loss at beta 1 less the loss at beta 0),
and its gradient; the oracle builds the keep of every token, the weight and u from the definitions alone (plain
Python over each sequence's tokens, not the trainer's mask code), then sums. Both must agree to 1e-10.

With the KL in the reward the KL rides in the policy term's advantage: the reward rows check that each mask's
loss and gradient are the same under all three rules. Planted bugs (a rule ignored, a rejected token given its
ratio, k3 of the other direction, a sequence mean over the padded length) must each fail some row.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

from klgrpo.math import objective as objective_module
from klgrpo.math import sampler_correction as correction_module
from klgrpo.math.aggregation import Normalizer
from klgrpo.math.full_kl import FULL_KL
from klgrpo.math.kl import ESTIMATORS
from klgrpo.math.objective import (
    KL_MASKED_TOKENS,
    EntropyTerm,
    KLTerm,
    ObjectiveInputs,
    ObjectiveTerms,
    PolicyTerm,
    grpo_objective,
)
from klgrpo.math.sampler_correction import DivergenceMask, SamplerCorrection
from klgrpo.verify import sequence_toy
from klgrpo.verify.penalty import WIDE_CLIP

#: value and gradient agree with the oracle to this relative error (float64 sums of at most 124 terms).
RTOL = 1e-10
ESTIMATOR_NAMES = ("k1", "k2", "k3", "k3_st", FULL_KL)
#: the off-policy mask's delta (mean_t log mu - log pi of a sequence above it, with A < 0, is masked) and the
#: top-entropy mask's quantile: both split the toy's tokens.
OFF_POLICY_DELTA = 0.0
TOP_ENTROPY = 0.5


@dataclass(frozen=True)
class Mask:
    """One mask under test: a sampler correction (mode, bounds, divergence masks) or a policy mask."""

    name: str
    correction: SamplerCorrection = SamplerCorrection()
    off_policy: bool = False
    top_entropy: bool = False


def _divergence(name: str, low: float | None, high: float) -> Mask:
    return Mask(name, SamplerCorrection(masks=(DivergenceMask(name, low, high),)))


#: Thresholds chosen from the toy's divergences (quartiles), so each mask rejects some tokens and keeps others.
MASKS = (
    Mask("token_mask [0.8, 1.25]", SamplerCorrection("token_mask", 0.8, 1.25)),
    Mask("sequence_mask [0.7, 1.8]", SamplerCorrection("sequence_mask", 0.7, 1.8)),
    _divergence("token_k1", 0.8, 1.25), _divergence("token_k2", None, 0.03), _divergence("token_k3", None, 0.03),
    _divergence("seq_sum_k1", 0.7, 1.8), _divergence("seq_sum_k2", None, 0.1), _divergence("seq_sum_k3", None, 0.1),
    _divergence("seq_mean_k1", 0.9, 1.2), _divergence("seq_mean_k2", None, 0.03),
    _divergence("seq_mean_k3", None, 0.03), _divergence("seq_max_k2", None, 0.07),
    _divergence("seq_max_k3", None, 0.07),
    Mask("off-policy sequence mask", off_policy=True),
    Mask("top-entropy mask", top_entropy=True),
)

BUG_RULE_IGNORED = "kl.masked_tokens ignored (always keep)"
BUG_ALWAYS_DROP = "masked tokens' KL always dropped"
BUG_KEEP_AT_RATIO = "keep gives a rejected token its ratio"
BUG_K3_REVERSED = "k3 masks read KL(pi_old || mu)"
BUG_PADDED_MEAN = "sequence masks count the padding"
BUGS = (BUG_RULE_IGNORED, BUG_ALWAYS_DROP, BUG_KEEP_AT_RATIO, BUG_K3_REVERSED, BUG_PADDED_MEAN)


@dataclass
class MaskedKLRow:
    mask: str
    rule: str
    estimator: str
    placement: str
    value: float
    expected: float
    grad_rel_err: float
    rejected_frac: float | None  # of the completion tokens, by the oracle (0 < frac < 1: not vacuous); reward: None
    bug: str = ""
    passed: bool = False


@dataclass
class MaskedKLBug:
    bug: str
    failed: int
    rows: int

    @property
    def passed(self) -> bool:  # a planted bug passes when the rows catch it
        return self.failed > 0


# ------------------------------------------------------------------------------------------- the toy
@dataclass
class Toy:
    theta: Tensor
    ref_logp: Tensor       # [S, T], 0 on padding
    mu_logp: Tensor
    mu_weights: Tensor     # the sampler's sequence probabilities, [S]
    mask: Tensor           # [S, T] float64
    lengths: list[int]

    def logp(self, theta: Tensor) -> Tensor:
        return sequence_toy.TOY.logp_BT(theta)

    def entropy(self, theta: Tensor) -> Tensor:
        """The policy's entropy at each position's prefix, [S, T] (0 on padding)."""
        logp_PV = torch.log_softmax(theta, dim=-1)
        h_P = -(logp_PV.exp() * logp_PV).sum(-1)
        return torch.where(sequence_toy.TOY.mask_BT, h_P[sequence_toy.TOY.prefix_BT], torch.zeros(()))

    def full_kl(self, theta: Tensor, ref_theta: Tensor) -> Tensor:
        """KL(pi || ref) over the vocabulary at each position's prefix, [S, T], in the graph of theta."""
        logp_PV, ref_PV = torch.log_softmax(theta, dim=-1), torch.log_softmax(ref_theta, dim=-1)
        kl_P = (logp_PV.exp() * (logp_PV - ref_PV)).sum(-1)
        return torch.where(sequence_toy.TOY.mask_BT, kl_P[sequence_toy.TOY.prefix_BT], torch.zeros(()))


def make_toy() -> tuple[Toy, sequence_toy.ToyProblem]:
    problem = sequence_toy.make_toy()
    t = sequence_toy.TOY
    mu_logp = t.logp_BT(problem.mu_theta)
    return Toy(theta=problem.theta, ref_logp=t.logp_BT(problem.ref_theta), mu_logp=mu_logp,
               mu_weights=mu_logp.sum(-1).exp(), mask=t.mask_BT.to(torch.float64),
               lengths=[int(n) for n in t.lengths_B.tolist()]), problem


# ------------------------------------------------------------------------------------------- the oracle
def _divergences(d: float) -> dict[str, float]:
    return {"k1": -d, "k2": d * d / 2, "k3": math.exp(d) - 1 - d}


def _rejected_by(m: DivergenceMask, ds: list[float]) -> list[bool]:
    """Which of one sequence's tokens the divergence mask rejects, from the mask's definition."""
    kind, level = m.name.rsplit("_", 1)[1], ("token" if m.name.startswith("token") else m.name.split("_")[1])
    if kind == "k1":
        def outside(ratio: float) -> bool:
            return (m.low is not None and ratio < m.low) or (m.high is not None and ratio > m.high)
        if level == "token":
            return [outside(math.exp(d)) for d in ds]
        total = sum(ds) if level == "sum" else sum(ds) / len(ds)
        return [outside(math.exp(total))] * len(ds)
    ks = [_divergences(d)[kind] for d in ds]
    if level == "token":
        return [k > m.high for k in ks]
    combined = {"sum": sum(ks), "mean": sum(ks) / len(ks), "max": max(ks)}[level]
    return [combined > m.high] * len(ds)


def _quantile(values: list[float], q: float) -> float:
    """The top-entropy mask's threshold as documented: torch.quantile's linear interpolation in float32 (as TRL
    computes it; a float64 entropy equal to the float32 cut may fall just below it)."""
    return torch.quantile(torch.tensor(values, dtype=torch.float32), q).item()


def oracle_factors(toy: Toy, mask: Mask, rule: str, logp: Tensor, entropy: Tensor) -> tuple[Tensor, float]:
    """(u per token [S, T], the share of completion tokens rejected by the mask) from the definitions."""
    S, T = toy.mask.shape
    d = (logp.detach() - toy.mu_logp).tolist()
    c = mask.correction
    h_flat = [entropy[s][t].item() for s in range(S) for t in range(toy.lengths[s])]
    cut = _quantile(h_flat, 1.0 - TOP_ENTROPY) if mask.top_entropy else None
    u = [[0.0] * T for _ in range(S)]
    rejected_tokens = 0
    for s in range(S):
        n = toy.lengths[s]
        ds = d[s][:n]
        weight, keep = [1.0] * n, [True] * n
        if c.mode != "none":
            ratios = [math.exp(sum(ds))] * n if c.mode.startswith("sequence") else [math.exp(x) for x in ds]
            weight = ratios
            keep = [(c.clip_min is None or r >= c.clip_min) and (c.clip_max is None or r <= c.clip_max)
                    for r in ratios]
        for m in c.masks:
            keep = [k and not r for k, r in zip(keep, _rejected_by(m, ds))]
        select = [True] * n
        if mask.off_policy:  # every advantage is -1 here: the sequence goes when its mean log mu - log pi > delta
            select = [(-sum(ds) / n) <= OFF_POLICY_DELTA] * n
        if mask.top_entropy:
            select = [entropy[s][t].item() >= cut for t in range(n)]
        for t in range(n):
            v = weight[t] * keep[t]
            if rule == "keep":
                u[s][t] = v + (0.0 if keep[t] else 1.0)
            elif rule == "drop":
                u[s][t] = v * select[t]
            else:
                u[s][t] = v
            rejected_tokens += (not keep[t]) or (not select[t])
    return torch.tensor(u, dtype=torch.float64), rejected_tokens / sum(toy.lengths)


def oracle_kl_part(toy: Toy, problem, mask: Mask, rule: str, estimator: str, theta: Tensor) -> tuple[Tensor, float]:
    """E_mu[sum_t u_t k_t] in the graph of theta (seq_mean_token_sum over one expected sequence), and the share
    of tokens the mask rejects."""
    logp = toy.logp(theta)
    u, frac = oracle_factors(toy, mask, rule, logp, toy.entropy(theta.detach()))
    if estimator == FULL_KL:
        k = toy.full_kl(theta, problem.ref_theta)
    else:
        k = ESTIMATORS[estimator].fn(logp - toy.ref_logp, 20.0)
    return (toy.mu_weights[:, None] * toy.mask * u * k).sum(), frac


# ------------------------------------------------------------------------------------------- the trainer
def trainer_loss(toy: Toy, problem, mask: Mask, rule: str, estimator: str, placement: str, theta: Tensor,
                 coef: float) -> Tensor:
    """The trainer's expected loss at beta ``coef`` (every advantage -1, wide clip): grpo_objective over the 31
    sequences weighted by mu's probabilities."""
    logp = toy.logp(theta)
    norm = Normalizer(num_sequences=1.0, num_tokens=(toy.mu_weights * toy.mask.sum(-1)).sum(),
                      max_len=float(toy.mask.shape[-1]))
    kl = KLTerm(coef=coef, estimator=estimator, placement=placement, is_correction="detached",
                masked_tokens=rule)
    inputs = ObjectiveInputs(
        logp, logp.detach(), toy.ref_logp, -torch.ones(toy.mask.shape[0], dtype=torch.float64), toy.mask,
        full_kl_BT=toy.full_kl(theta, problem.ref_theta) if estimator == FULL_KL else None,
        entropy_BT=toy.entropy(theta) if mask.top_entropy else None,
        sampling_logp_BT=toy.mu_logp if mask.off_policy else None, sampler_logp_BT=toy.mu_logp,
        row_weights_B=toy.mu_weights)
    terms = ObjectiveTerms(
        kl=kl, aggregation="seq_mean_token_sum",
        policy=PolicyTerm(eps_low=WIDE_CLIP, eps_high=WIDE_CLIP,
                          off_policy_mask=OFF_POLICY_DELTA if mask.off_policy else None),
        entropy=EntropyTerm(top_quantile=TOP_ENTROPY if mask.top_entropy else 1.0),
        sampler_correction=mask.correction)
    out = grpo_objective(inputs, terms, norm, metrics=False)
    return out.loss


def _grad(value: Tensor, theta: Tensor) -> Tensor:
    (g,) = torch.autograd.grad(value, theta)
    return g.flatten()


def _rel(a: Tensor, b: Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-300))


def loss_rows(toy: Toy, problem, bug: str = "") -> list[MaskedKLRow]:
    rows = []
    for mask in MASKS:
        for rule in KL_MASKED_TOKENS:
            for estimator in ESTIMATOR_NAMES:
                theta = problem.params()
                part = (trainer_loss(toy, problem, mask, rule, estimator, "loss", theta, 1.0)
                        - trainer_loss(toy, problem, mask, rule, estimator, "loss", theta, 0.0))
                g = _grad(part, theta)
                theta_o = problem.params()
                want, frac = oracle_kl_part(toy, problem, mask, rule, estimator, theta_o)
                g_want = _grad(want, theta_o)
                err = _rel(g, g_want)
                value_err = abs(part.item() - want.item()) / max(abs(want.item()), 1e-300)
                rows.append(MaskedKLRow(mask.name, rule, estimator, "loss", part.item(), want.item(), err, frac,
                                        bug, bool(value_err < RTOL and err < RTOL and 0.0 < frac < 1.0)))
    return rows


def reward_rows(toy: Toy, problem, bug: str = "") -> list[MaskedKLRow]:
    """The KL in the reward (k1, reward-to-go): each mask's loss and gradient the same under every rule."""
    rows = []
    for mask in MASKS:
        theta = problem.params()
        base = trainer_loss(toy, problem, mask, "auto", "k1", "reward", theta, 1.0)
        g_base = _grad(base, theta)
        for rule in KL_MASKED_TOKENS[1:]:
            theta = problem.params()
            loss = trainer_loss(toy, problem, mask, rule, "k1", "reward", theta, 1.0)
            err = _rel(_grad(loss, theta), g_base)
            value_err = abs(loss.item() - base.item()) / max(abs(base.item()), 1e-300)
            rows.append(MaskedKLRow(mask.name, rule, "k1", "reward", loss.item(), base.item(), err, None,
                                    bug, bool(value_err < RTOL and err < RTOL)))
    return rows


@contextmanager
def planted(bug: str):
    """The trainer's code with one bug put in for the duration (module attributes swapped back after)."""
    saved = []

    def swap(module, name, value):
        saved.append((module, name, getattr(module, name)))
        setattr(module, name, value)

    kl_factor, token_divergence, divergence_keep = (objective_module.kl_factor, correction_module.token_divergence,
                                                    correction_module.divergence_keep)
    if bug == BUG_RULE_IGNORED:
        swap(objective_module, "kl_factor", lambda rule, factors, keep: kl_factor("keep", factors, keep))
    elif bug == BUG_ALWAYS_DROP:
        swap(objective_module, "kl_factor", lambda rule, factors, keep: kl_factor("drop", factors, keep))
    elif bug == BUG_KEEP_AT_RATIO:
        swap(objective_module, "kl_factor", lambda rule, factors, keep: (
            factors.weight if rule == "keep" and factors is not None else kl_factor(rule, factors, keep)))
    elif bug == BUG_K3_REVERSED:
        swap(correction_module, "token_divergence",
             lambda log_r, divergence: token_divergence(-log_r if divergence == "k3" else log_r, divergence))
    elif bug == BUG_PADDED_MEAN:
        swap(correction_module, "divergence_keep",
             lambda log_r, mask, masks: divergence_keep(log_r, torch.ones_like(mask), masks))
    try:
        yield
    finally:
        for module, name, value in reversed(saved):
            setattr(module, name, value)


def masked_kl_rows() -> tuple[list[MaskedKLRow], list[MaskedKLBug]]:
    """(every row, the planted bugs with how many rows each failed)."""
    toy, problem = make_toy()
    rows = loss_rows(toy, problem) + reward_rows(toy, problem)
    bugs = []
    for bug in BUGS:
        with planted(bug):
            bug_rows = loss_rows(toy, problem, bug)
        bugs.append(MaskedKLBug(bug, sum(not r.passed for r in bug_rows), len(bug_rows)))
    return rows, bugs


def format_masked_kl(rows: list[MaskedKLRow], bugs: list[MaskedKLBug]) -> str:
    """One line per mask (every row is in --json), then the planted bugs."""
    title = ("Masks and the KL (kl.masked_tokens auto / drop / keep): the KL term's part of the expected loss and its "
             "gradient against the rule built from the masks' definitions, for every mask x rule x estimator "
             "(k1, k2, k3, k3_st, full) on the sequence toy with a sampler that is not the policy; reward rows: "
             "the KL in the reward is the same under every rule")
    head = f"{'mask':<28} {'rejected':>8} {'auto':>6} {'drop':>6} {'keep':>6} {'reward':>7} {'max rel err':>11}  ok"
    lines = []
    for name in dict.fromkeys(r.mask for r in rows):
        mine = [r for r in rows if r.mask == name]
        loss = [r for r in mine if r.placement == "loss"]
        cells = []
        for rule in KL_MASKED_TOKENS:
            of_rule = [r for r in loss if r.rule == rule]
            cells.append(f"{sum(r.passed for r in of_rule)}/{len(of_rule)}")
        reward = [r for r in mine if r.placement == "reward"]
        worst = max(r.grad_rel_err for r in mine)
        lines.append(f"{name:<28} {loss[0].rejected_frac:8.2f} {cells[0]:>6} {cells[1]:>6} {cells[2]:>6} "
                     f"{sum(r.passed for r in reward)}/{len(reward):<5} {worst:11.1e}  "
                     f"{'ok' if all(r.passed for r in mine) else 'FAIL'}")
    bug_head = f"{'planted bug':<48} {'rows failing':>12}  caught"
    bug_lines = [f"{b.bug:<48} {b.failed:>5}/{b.rows:<6}  {'ok' if b.passed else 'FAIL (not caught)'}" for b in bugs]
    return "\n".join([title, head, "-" * len(head), *lines, "", bug_head, "-" * len(bug_head), *bug_lines])
