"""Exact checks past the sampler's edge: temperature, top-p, top-k and min-p under ``rollout.truncation policy``.

With a filter on, the sampler draws every token from the truncated distribution pi_S (pi renormalised over the
kept set S of its prefix) and the trainer trains pi_S, with the reference renormalised over the same set
(docs/algorithm.md, "Truncated sampling"). The exact answer is therefore the KL between the two truncated
distributions,

    KL(pi_S || ref_S) = sum over what pi_S can draw of P_S(y) (log P_S(y) - log R_S(y)),

where the kept sets come from the filters' DEFINITIONS written out here position by position (top-k: the k
largest; top-p: a token is kept while the tokens ranked above it hold less than top_p; min-p: p >= min_p * max p),
not from the trainer's code. The trainer's side is the trainer's own code: the kept-set sizes from its filters
(math.truncation), log pi_S from its chunked log-probs, log ref_S from the kept-set pass's renormalisation, the
exact per-position sum of ``kl.estimator full`` from its chunked kernel, all through ``grpo_objective``
(verify.penalty.penalty_objective), with the sampler's log-probs (the definition's pi_S) handed to every
``rollout.sampler_correction`` mode.

Two problems, both enumerated exactly (float64):

    token      one position, K = 8 outcomes
    sequence   the toy of verify.sequence_toy (vocabulary {a, b, EOS}, 31 sequences), a kept set per prefix;
               only the sequences pi_S can draw enter the expectation

Checked per case: the value of every estimator (E_{pi_S}[k] vs KL(pi_S || ref_S): the unbiased ones exact, k2
clearly off) and the expected gradient of every estimator x placement (loss, reward; full: loss) x the trainer's
first-update samplings x every sampler correction, against the declaration the estimator makes for the
untruncated case. Planted bugs: a trainer that scores the whole softmax while the sampler truncates, and one
that truncates with another top_p: each must fail rows of the same checks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from klgrpo.math.full_kl import FULL_KL, FULL_KL_GRADIENTS, token_logprobs_and_full_kl
from klgrpo.math.kl import ESTIMATORS, kl_estimate
from klgrpo.math.logprobs import token_logprobs
from klgrpo.math.sampler_correction import SAMPLER_CORRECTIONS, SamplerCorrection
from klgrpo.math.truncation import kept_counts, reference_over_kept_set, settled_counts, truncate_scores
from klgrpo.verify import sequence_toy
from klgrpo.verify.categorical import BIAS_MIN_REL, VALUE_ATOL, random_pi_ref_mu
from klgrpo.verify.first_epoch import declared_first_epoch
from klgrpo.verify.penalty import GRADIENT_RTOL, GradientCheck, flat_grad, gradient_check, penalty_objective


@dataclass(frozen=True)
class Case:
    """One sampling setting: ``rollout.temperature``, ``top_k``, ``top_p``, ``min_p`` (``min_p_first``: vLLM's
    order of the filters, min-p before top-k and top-p)."""

    name: str
    temperature: float
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    min_p_first: bool = False

    @property
    def filters(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


#: The token problem's cases (K = 8). The combination is one where top-p binds after top-k and vLLM's order
#: (min-p first) keeps another set than transformers'.
TOKEN_CASES = (
    Case("temperature 0.7", 0.7), Case("temperature 1.3", 1.3),
    Case("top_p 0.8", 0.7, top_p=0.8), Case("top_p 0.95", 0.7, top_p=0.95), Case("top_k 5", 0.7, top_k=5),
    Case("min_p 0.1", 0.7, min_p=0.1),
    Case("top_k 7 top_p 0.85 min_p 0.1", 0.7, top_k=7, top_p=0.85, min_p=0.1),
    Case("the same, vLLM's order", 0.7, top_k=7, top_p=0.85, min_p=0.1, min_p_first=True),
)
#: The sequence toy's (vocabulary 3): top-k 2 for top-k 5, and a combination without top-k (with 3 tokens, top-k 2
#: leaves the other two filters nothing to reorder).
SEQUENCE_CASES = (
    *TOKEN_CASES[:4], Case("top_k 2", 0.7, top_k=2), TOKEN_CASES[5],
    Case("top_p 0.85 min_p 0.1", 0.7, top_p=0.85, min_p=0.1),
    Case("the same, vLLM's order", 0.7, top_p=0.85, min_p=0.1, min_p_first=True),
)
#: The trainer's first update of a batch: kl.is_correction none, in_graph, detached (pi_old == pi_S).
SAMPLINGS = ("on_policy", "first_epoch_in_graph", "first_epoch_detached")
PLACEMENTS = ("loss", "reward")
#: The planted bugs: the trainer scores the whole softmax; truncates with top_p 0.95 where the sampler used 0.8;
#: applies the filters in transformers' order where the sampler (vLLM) applied min-p first, or the reverse.
BUG_WHOLE_SOFTMAX = "trainer scores the whole softmax"
BUG_OTHER_TOP_P = "trainer truncates with top_p 0.95"
BUG_OTHER_ORDER = "trainer applies the filters in the other order"


@dataclass
class Problem:
    """Logit tables [P, V] of pi (``theta``) and ref, and the rows a trainer holds: every sequence as [S, T]
    prefix indices, tokens and mask (the token problem: P = 1, each outcome a one-token sequence)."""

    level: str
    theta: Tensor
    ref_theta: Tensor
    prefix_BT: Tensor
    tokens_BT: Tensor
    mask_BT: Tensor


def token_problem(seed: int = 1, num_outcomes: int = 8, scale: float = 1.5) -> Problem:
    pi, ref, _ = random_pi_ref_mu((1, num_outcomes), seed, scale, 0.0)
    return Problem("token", pi, ref, torch.zeros(num_outcomes, 1, dtype=torch.long),
                   torch.arange(num_outcomes).unsqueeze(-1), torch.ones(num_outcomes, 1, dtype=torch.bool))


def sequence_problem(seed: int = 1, scale: float = 1.5) -> Problem:
    toy = sequence_toy.TOY
    pi, ref, _ = random_pi_ref_mu((len(toy.prefixes), len(sequence_toy.TOKEN_NAMES)), seed, scale, 0.0)
    return Problem("sequence", pi, ref, toy.prefix_BT, toy.tokens_BT, toy.mask_BT)


# ------------------------------------------------------------------------------ the definition (the oracle)
def defined_kept_set(scores: list[float], case: Case) -> set[int]:
    """The tokens the filters keep at one position, from their definitions over python floats."""
    keep = set(range(len(scores)))

    def probs() -> dict[int, float]:
        top = max(scores[i] for i in keep)
        weights = {i: float(torch.tensor(scores[i] - top, dtype=torch.float64).exp()) for i in keep}
        total = sum(weights.values())
        return {i: w / total for i, w in weights.items()}

    def min_p() -> None:
        p = probs()
        biggest = max(p.values())
        keep.intersection_update(i for i in p if p[i] >= case.min_p * biggest)

    if case.min_p > 0 and case.min_p_first:
        min_p()
    if case.top_k > 0:
        keep.intersection_update(sorted(keep, key=lambda i: -scores[i])[: case.top_k])
    if case.top_p < 1.0:
        p, above, kept = probs(), 0.0, set()
        for i in sorted(keep, key=lambda i: -scores[i]):  # kept while the tokens above it hold less than top_p
            if above < case.top_p:
                kept.add(i)
            above += p[i]
        keep = kept
    if case.min_p > 0 and not case.min_p_first:
        min_p()
    return keep


def defined_log_probs(theta: Tensor, case: Case, kept: list[set[int]]) -> Tensor:
    """log pi_S per prefix [P, V] (-inf outside the kept set), in the graph of ``theta``."""
    inside = torch.zeros(theta.shape, dtype=torch.bool)
    for prefix, tokens in enumerate(kept):
        inside[prefix, sorted(tokens)] = True
    return torch.where(inside, theta / case.temperature, torch.tensor(float("-inf"), dtype=theta.dtype)).log_softmax(-1)


@dataclass
class Exact:
    """The definition's answer for one problem and case: the sequences pi_S can draw (``rows``), their
    probabilities, the sampler's per-token log-probs, KL(pi_S || ref_S), KL(ref_S || pi_S) and their gradients."""

    kept: list[set[int]]
    rows: Tensor
    weights_B: Tensor
    sampler_logp_BT: Tensor
    kl: dict = field(default_factory=dict)

    @property
    def truncates(self) -> bool:
        return any(len(k) < self.vocabulary for k in self.kept)

    vocabulary: int = 0


def _sequence_log_probs(table_PV: Tensor, problem: Problem, rows: Tensor) -> Tensor:
    mask = problem.mask_BT[rows]
    logp = table_PV[problem.prefix_BT[rows], problem.tokens_BT[rows]]
    return torch.where(mask, logp, torch.zeros((), dtype=logp.dtype))


def exact(problem: Problem, case: Case) -> Exact:
    kept = [defined_kept_set((row / case.temperature).tolist(), case) for row in problem.theta]
    theta = problem.theta.clone().requires_grad_(True)
    logp_PV, ref_PV = defined_log_probs(theta, case, kept), defined_log_probs(problem.ref_theta, case, kept)
    drawable = torch.isfinite(_sequence_log_probs(logp_PV.detach(), problem, torch.arange(len(problem.mask_BT))))
    rows = torch.nonzero(drawable.all(-1)).squeeze(-1)  # the sequences pi_S can draw: every token kept
    seq_logp = _sequence_log_probs(logp_PV, problem, rows).sum(-1)
    seq_ref = _sequence_log_probs(ref_PV, problem, rows).sum(-1)
    reverse = (seq_logp.exp() * (seq_logp - seq_ref)).sum()
    forward = (seq_ref.exp() * (seq_ref - seq_logp)).sum()  # ref_S's support is pi_S's: the same rows
    kl = {"reverse": reverse.item(), "forward": forward.item(),
          "grad_reverse": flat_grad(reverse, theta, retain_graph=True), "grad_forward": flat_grad(forward, theta)}
    return Exact(kept, rows, seq_logp.detach().exp(), _sequence_log_probs(logp_PV.detach(), problem, rows), kl,
                 vocabulary=problem.theta.shape[-1])


# ------------------------------------------------------------------------------ the trainer's side
@dataclass(frozen=True)
class Trainer:
    """How the trainer scores a case: as it does (``bug`` ""), or with one of the planted bugs."""

    bug: str = ""

    def filters(self, case: Case) -> Case:
        if self.bug == BUG_OTHER_TOP_P:
            return Case(case.name, case.temperature, case.top_k, 0.95, case.min_p, case.min_p_first)
        if self.bug == BUG_OTHER_ORDER:
            return Case(case.name, case.temperature, case.top_k, case.top_p, case.min_p, not case.min_p_first)
        return case

    def terms(self, theta: Tensor, problem: Problem, case: Case, rows: Tensor, full: bool = False):
        """(log pi_S [B, T] in the graph of ``theta``, log ref_S [B, T], KL_t of ``full`` or None) of ``rows``."""
        prefix, tokens, mask = problem.prefix_BT[rows], problem.tokens_BT[rows], problem.mask_BT[rows]
        logits, ref_logits = theta[prefix], problem.ref_theta[prefix]
        t, f = case.temperature, self.filters(case)
        counts = None
        if f.filters and self.bug != BUG_WHOLE_SOFTMAX:  # rollout.truncation policy: the kept-set sizes
            scores = truncate_scores(logits.detach() / t, f.top_k, f.top_p, f.min_p, f.min_p_first)
            counts = settled_counts(kept_counts(scores), mask, logits.shape[-1])
        if full:
            logp, kl, _, ref_logp = token_logprobs_and_full_kl(logits, tokens, ref_logits, _identity, t,
                                                               kept_BT=counts)
        else:
            logp, kl = token_logprobs(logits, tokens, t, kept_BT=counts), None
            if counts is None:
                ref_logp = token_logprobs(ref_logits, tokens, t)
            else:
                ref_logp = reference_over_kept_set(logits.detach() / t, ref_logits / t, tokens, counts)[0]
        zero = torch.zeros((), dtype=logp.dtype)
        return torch.where(mask, logp, zero), torch.where(mask, ref_logp, zero), kl


def _identity(hidden: Tensor) -> Tensor:
    return hidden  # the problems give the reference's logits directly: its "output layer" is the identity


def expected_value(trainer: Trainer, problem: Problem, case: Case, ex: Exact, estimator: str) -> float:
    """E_{pi_S}[sum_t k_t] (full: sum_t KL_t) by enumeration of the sequences pi_S can draw."""
    with torch.no_grad():
        logp, ref_logp, kl = trainer.terms(problem.theta, problem, case, ex.rows, full=estimator == FULL_KL)
        k = kl if estimator == FULL_KL else kl_estimate(logp, ref_logp, estimator)
        k = torch.where(problem.mask_BT[ex.rows], k, torch.zeros((), dtype=k.dtype))
        return float((ex.weights_B * k.sum(-1)).sum())


def expected_gradient(trainer: Trainer, problem: Problem, case: Case, ex: Exact, estimator: str, placement: str,
                      sampling: str, correction: str) -> Tensor:
    """E_{pi_S}[grad L] exactly: autograd of sum over the drawable sequences of P_S * the trainer's objective."""
    theta = problem.theta.clone().requires_grad_(True)
    full = estimator == FULL_KL
    logp, ref_logp, kl = trainer.terms(theta, problem, case, ex.rows, full=full)
    first_epoch = sampling.startswith("first_epoch_")
    objective = penalty_objective(
        logp, ref_logp, problem.mask_BT[ex.rows], ex.weights_B, estimator, placement,
        sampling.replace("first_epoch_", "off_policy_") if first_epoch else sampling,
        mu_logp_BT=logp.detach() if first_epoch else None, full_kl_BT=kl, sampler_logp_BT=ex.sampler_logp_BT,
        sampler_correction=SamplerCorrection(correction))
    return flat_grad(objective, theta)


def declared(estimator: str, placement: str, sampling: str, level: str) -> str | None:
    """What the estimator declares for the untruncated case (pi_S and ref_S in the roles of pi and ref)."""
    if estimator == FULL_KL:
        if sampling == "first_epoch_in_graph" and level == "sequence":
            return None
        key = "on_policy" if level == "sequence" and sampling == "first_epoch_detached" else sampling
        return FULL_KL_GRADIENTS[(level, key)]
    if sampling == "on_policy":
        return ESTIMATORS[estimator].gradient_target(placement, "on_policy", level)
    return declared_first_epoch(estimator, placement, sampling.removeprefix("first_epoch_"), level)


# ------------------------------------------------------------------------------ the rows
@dataclass
class TruncationValue:
    level: str
    case: str
    estimator: str
    expected_value: float
    kl: float
    abs_diff: float
    declared_unbiased: bool
    kept_sizes: str
    trainer: str = ""
    passed: bool = False


@dataclass
class TruncationGradient(GradientCheck):
    case: str = ""
    correction: str = ""
    trainer: str = ""


ESTIMATOR_NAMES = (*ESTIMATORS, FULL_KL)


def _unbiased(estimator: str) -> bool:
    return True if estimator == FULL_KL else ESTIMATORS[estimator].value_unbiased


def case_rows(trainer: Trainer, problem: Problem, case: Case, rtol: float = GRADIENT_RTOL):
    """(values, gradients) of one problem and case through ``trainer``."""
    ex = exact(problem, case)
    sizes = "/".join(str(n) for n in sorted({len(k) for k in ex.kept}))
    vacuous = case.filters and not ex.truncates  # a filter that cuts nothing checks nothing
    values = []
    for name in ESTIMATOR_NAMES:
        got = expected_value(trainer, problem, case, ex, name)
        diff = abs(got - ex.kl["reverse"])
        ok = diff < VALUE_ATOL if _unbiased(name) else diff > BIAS_MIN_REL * ex.kl["reverse"]
        values.append(TruncationValue(problem.level, case.name, name, got, ex.kl["reverse"], diff, _unbiased(name),
                                      sizes, trainer.bug, bool(ok and not vacuous)))
    gradients = []
    for name in ESTIMATOR_NAMES:
        for placement in ("loss",) if name == FULL_KL else PLACEMENTS:
            for sampling in SAMPLINGS:
                want = declared(name, placement, sampling, problem.level)
                for correction in SAMPLER_CORRECTIONS:
                    g = expected_gradient(trainer, problem, case, ex, name, placement, sampling, correction)
                    row = gradient_check(g, ex.kl, want, rtol, check=TruncationGradient, estimator=name,
                                         placement=placement, sampling=sampling, level=problem.level,
                                         case=case.name, correction=correction, trainer=trainer.bug)
                    row.passed = row.passed and not vacuous
                    gradients.append(row)
    return values, gradients


@dataclass
class PlantedBug:
    bug: str
    level: str
    case: str
    failed: int
    rows: int

    @property
    def passed(self) -> bool:  # a planted bug passes when the checks catch it
        return self.failed > 0


def truncation_rows(rtol: float = GRADIENT_RTOL):
    """(values, gradients, planted bugs) over both problems and every case."""
    values, gradients, bugs = [], [], []
    for problem, cases in ((token_problem(), TOKEN_CASES), (sequence_problem(), SEQUENCE_CASES)):
        for case in cases:
            v, g = case_rows(Trainer(), problem, case, rtol)
            values += v
            gradients += g
            planted = [BUG_WHOLE_SOFTMAX] if case.filters else []
            if case.top_p == 0.8:
                planted.append(BUG_OTHER_TOP_P)
            if case.min_p_first:
                planted.append(BUG_OTHER_ORDER)
            for bug in planted:
                bv, bg = case_rows(Trainer(bug), problem, case, rtol)
                bugs.append(PlantedBug(bug, problem.level, case.name, sum(not r.passed for r in bv + bg),
                                       len(bv) + len(bg)))
    return values, gradients, bugs


def format_truncation(values: list[TruncationValue], gradients: list[TruncationGradient],
                      bugs: list[PlantedBug]) -> str:
    """One line per problem and case (every row is in --json), then the planted bugs."""
    title = ("Truncated sampling (rollout.truncation policy, the reference renormalised over the policy's kept set): "
             "values E_{pi_S}[k] vs the exact KL(pi_S || ref_S) over kept sets from the filters' definitions, and "
             "the expected gradient of every estimator x placement (loss, reward) x first-update sampling x "
             "rollout.sampler_correction against its declaration")
    head = (f"{'level':<8} {'case':<30} {'|S|':<5} {'KL':>8} {'values':>7} {'gradients':>9}  "
            f"{'found (reverse/forward/neither/zero)':<36} ok")
    lines = []
    for level, case in dict.fromkeys((v.level, v.case) for v in values):
        vs = [v for v in values if (v.level, v.case) == (level, case)]
        gs = [g for g in gradients if (g.level, g.case) == (level, case)]
        found = "/".join(str(sum(g.gradient_target == t for g in gs)) for t in ("reverse", "forward", "neither",
                                                                              "zero"))
        ok = all(v.passed for v in vs) and all(g.passed for g in gs)
        lines.append(f"{level:<8} {case:<30} {vs[0].kept_sizes:<5} {vs[0].kl:8.4f} "
                     f"{sum(v.passed for v in vs):>3}/{len(vs):<3} {sum(g.passed for g in gs):>4}/{len(gs):<4}  "
                     f"{found:<36} {'ok' if ok else 'FAIL'}")
    bug_head = f"{'planted bug':<48} {'level':<8} {'case':<30} {'rows failing':>12}  caught"
    bug_lines = [f"{b.bug:<48} {b.level:<8} {b.case:<30} {b.failed:>5}/{b.rows:<6}  "
                 f"{'ok' if b.passed else 'FAIL (not caught)'}" for b in bugs]
    return "\n".join([title, head, "-" * len(head), *lines, "", bug_head, "-" * len(bug_head), *bug_lines])
