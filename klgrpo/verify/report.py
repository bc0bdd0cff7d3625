"""Run every check once and format the results; the command and the tests both go through :func:`run_all`."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from klgrpo.core.threads import torch_threads
from klgrpo.math.kl import ESTIMATORS
from klgrpo.verify import categorical, full_kl, masked_kl, montecarlo, optimum, sequence_toy, staleness, truncation
from klgrpo.verify.entropy import EntropyCheck, entropy_rows
from klgrpo.verify.first_epoch import first_epoch_rows
from klgrpo.verify.migration import MigrationCheck, migration_rows
from klgrpo.verify.penalty import GRADIENT_RTOL, GradientCheck
from klgrpo.verify.sampler_mismatch import SamplerMismatchCheck, sampler_mismatch_rows

#: The per-sample gradient formula must match autograd to this absolute error (float64).
PER_SAMPLE_ATOL = 1e-12


@dataclass
class VerifyReport:
    rows: list[GradientCheck] = field(default_factory=list)
    first_epoch: list[GradientCheck] = field(default_factory=list)
    migration: list[MigrationCheck] = field(default_factory=list)
    values: list[dict] = field(default_factory=list)
    full_kl: list[GradientCheck] = field(default_factory=list)       # kl.estimator full, loss placement
    full_kl_values: list[dict] = field(default_factory=list)
    entropy: list[EntropyCheck] = field(default_factory=list)       # which entropy the bonus's gradient follows
    sampler_mismatch: list[SamplerMismatchCheck] = field(default_factory=list)  # a sampler that is not pi
    truncation_values: list[truncation.TruncationValue] = field(default_factory=list)  # top-p, top-k, min-p, T
    truncation: list[truncation.TruncationGradient] = field(default_factory=list)
    truncation_bugs: list[truncation.PlantedBug] = field(default_factory=list)  # each must be caught
    masked_kl: list[masked_kl.MaskedKLRow] = field(default_factory=list)  # kl.masked_tokens x every mask
    masked_kl_bugs: list[masked_kl.MaskedKLBug] = field(default_factory=list)
    staleness: list[staleness.StalenessCheck] = field(default_factory=list)  # mu = the policy K updates back
    staleness_bugs: list[staleness.StalenessBug] = field(default_factory=list)
    monte_carlo: list[montecarlo.MonteCarloCheck] = field(default_factory=list)
    optimum: list[optimum.OptimumResult] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(x.passed for x in self.rows + self.first_epoch + self.migration + self.monte_carlo
                   + self.optimum + self.full_kl + self.entropy + self.sampler_mismatch + self.truncation_values
                   + self.truncation + self.truncation_bugs + self.masked_kl + self.masked_kl_bugs + self.staleness
                   + self.staleness_bugs) and all(
            v["passed"] for v in self.values + self.full_kl_values)

    def as_dict(self) -> dict:
        return {
            "rows": [asdict(r) for r in self.rows],
            "first_epoch": [asdict(r) for r in self.first_epoch],
            "migration": [asdict(r) for r in self.migration],
            "values": self.values,
            "full_kl": [asdict(r) for r in self.full_kl],
            "full_kl_values": self.full_kl_values,
            "entropy": [asdict(e) for e in self.entropy],
            "sampler_mismatch": [asdict(r) for r in self.sampler_mismatch],
            "truncation_values": [asdict(r) for r in self.truncation_values],
            "truncation": [asdict(r) for r in self.truncation],
            "truncation_bugs": [{**asdict(b), "caught": b.passed} for b in self.truncation_bugs],
            "masked_kl": [asdict(r) for r in self.masked_kl],
            "masked_kl_bugs": [{**asdict(b), "caught": b.passed} for b in self.masked_kl_bugs],
            "staleness": [asdict(r) for r in self.staleness],
            "staleness_bugs": [{**asdict(b), "caught": b.passed} for b in self.staleness_bugs],
            "monte_carlo": [asdict(m) for m in self.monte_carlo],
            "optimum": [asdict(o) for o in self.optimum],
            "seconds": self.seconds,
            "passed": self.passed,
        }


def value_checks(cat: categorical.CategoricalProblem, toy: sequence_toy.ToyProblem) -> list[dict]:
    """Token- and sequence-level value checks, with the per-sample gradient formula at token level."""
    out = []
    for name in ESTIMATORS:
        row = categorical.value_check(cat, name)
        try:
            err = categorical.per_sample_gradient_error(cat, name)
            row["per_sample_grad_max_err"] = err
            row["passed"] = row["passed"] and err < PER_SAMPLE_ATOL
        except KeyError as exc:
            row["per_sample_grad_max_err"] = None
            row["note"] = str(exc).strip("'\"")
            row["passed"] = False
        out.append(row)
        out.append(sequence_toy.value_check(toy, name))
    return out


def run_all(samples: int = montecarlo.DEFAULT_SAMPLES, seed: int = 0, monte_carlo: bool = True,
            optimum_search: bool = True) -> VerifyReport:
    """Every check: values, the token and sequence gradient tables, Monte Carlo (``seed``), the optimum."""
    report = VerifyReport()
    with torch_threads(1):
        cat, toy = categorical.make_categorical(), sequence_toy.make_toy()
        t0 = time.perf_counter()
        report.values = value_checks(cat, toy)
        report.rows = categorical.gradient_rows(cat) + sequence_toy.gradient_rows(toy)
        report.first_epoch = first_epoch_rows(cat, toy)
        report.migration = migration_rows(cat, toy)
        report.full_kl_values = full_kl.value_rows(cat, toy)
        report.full_kl = full_kl.gradient_rows(cat, toy)
        report.entropy = entropy_rows(cat, toy)
        report.sampler_mismatch = sampler_mismatch_rows(cat, toy)
        report.truncation_values, report.truncation, report.truncation_bugs = truncation.truncation_rows()
        report.masked_kl, report.masked_kl_bugs = masked_kl.masked_kl_rows()
        report.staleness, report.staleness_bugs = staleness.all_staleness_rows(cat, toy)
        t1 = time.perf_counter()
        report.seconds["exact"] = t1 - t0
        if monte_carlo:
            report.monte_carlo = montecarlo.run_monte_carlo(samples, seed, cat, toy)
        t2 = time.perf_counter()
        report.seconds["monte_carlo"] = t2 - t1
        if optimum_search:
            report.optimum = optimum.run_optimum()
        report.seconds["optimum"] = time.perf_counter() - t2
    return report


def _mark(ok: bool) -> str:
    return "ok" if ok else "FAIL"


def _table(title: str, head: str, lines: list[str]) -> str:
    """A titled table: the title, the column heads, a rule as wide as the heads, one line per row."""
    return "\n".join([title, head, "-" * len(head), *lines])


def format_values(values: list[dict]) -> str:
    head = (f"{'estimator':<9} {'level':<8} {'E[value]':>12} {'KL':>12} {'|diff|':>9} {'unbiased':>8} "
            f"{'grad f(l)s err':>14}  ok")
    title = ("Values: E_pi[k] by enumeration vs the exact KL(pi||ref) (sequence: E_pi[sum_t k_t] vs the sequence "
             "KL); per-sample gradient vs f(l) s")
    lines = []
    for v in values:
        err = v.get("per_sample_grad_max_err", "")
        err = f"{err:14.1e}" if isinstance(err, float) else f"{'-' if v['level'] == 'sequence' else 'n/a':>14}"
        lines.append(f"{v['estimator']:<9} {v['level']:<8} {v['expected_value']:12.8f} {v['kl']:12.8f} "
                     f"{v['abs_diff']:9.1e} {str(v['declared_unbiased']):>8} {err}  {_mark(v['passed'])}")
        if v.get("note"):
            lines.append(f"    {v['note']}")
    return _table(title, head, lines)


def format_rows(rows: list[GradientCheck], level: str | None, title: str | None = None) -> str:
    what = {"token": "one categorical draw, K = 6", "sequence": "toy sequences, 45 parameters, 31 sequences"}
    head = (f"{'estimator':<9} {'placement':<9} {'sampling':<20} {'found':<8} {'declared':<8} {'ok':<4} "
            f"{'cos_rev':>8} {'cos_fwd':>8} {'|g|/|rev|':>9}")
    if level is None:
        head = f"{'level':<8} " + head
    title = title or (f"Expected gradient of the penalty, level {level} ({what.get(level, level)}): reverse = "
                      f"grad KL(pi||ref), forward = grad KL(ref||pi), within {GRADIENT_RTOL:g} x "
                      f"||grad KL(pi||ref)||; computed by the trainer's grpo_objective, the reward KL read at the "
                      f"rollout policy's log-probs as in training")
    if level is None:
        return _table(title, head, [f"{r.level:<8} " + _row(r) for r in rows])
    return _table(title, head, [_row(r) for r in rows if r.level == level])


def _row(r: GradientCheck) -> str:
    return (f"{r.estimator:<9} {r.placement:<9} {r.sampling:<20} {r.gradient_target:<8} {r.declared:<8} "
            f"{_mark(r.passed):<4} {r.cosine_reverse:8.4f} {r.cosine_forward:8.4f} {r.norm_ratio:9.4f}")


def format_migration(rows: list[MigrationCheck]) -> str:
    head = (f"{'setting':<27} {'level':<8} {'estimator':<9} {'placement':<9} {'sampling':<20} {'found':<8} "
            f"{'declared':<8} {'ok':<4} {'|g|/|rev|':>9}")
    title = ("Migration settings through the trainer's objective (TRL delta, verl dual clip and sequence-score KL; "
             "reward KL read at the rollout policy): which KL each expected gradient follows")
    return _table(title, head, [f"{r.setting:<27} {r.level:<8} {r.estimator:<9} {r.placement:<9} {r.sampling:<20} "
                                f"{r.gradient_target:<8} {r.declared:<8} {_mark(r.passed):<4} {r.norm_ratio:9.4f}"
                                for r in rows])


def format_sampler_mismatch(rows: list[SamplerMismatchCheck]) -> str:
    head = (f"{'level':<8} {'estimator':<9} {'placement':<9} {'kl.is_correction':<20} {'sampler correction':<29} "
            f"{'found':<8} {'declared':<8} {'ok':<4} {'|g|/|rev|':>9}")
    title = ("A sampler mu perturbed away from the policy (first update, pi_old == pi; expectations over mu's "
             "samples): which KL the gradient follows without and with rollout.sampler_correction (the weight "
             "pi_old/mu on the policy and KL terms; exact per sequence, per token only at one position); and "
             "with rollout.old_logprobs sampler (mu's log-probs as pi_old, the ratio pi/mu: no trainer forward) every "
             "setting against what it declares for off-policy samples")
    return _table(title, head, [f"{r.level:<8} {r.estimator:<9} {r.placement:<9} {r.sampling:<20} "
                                f"{r.correction:<29} {r.gradient_target:<8} {r.declared:<8} {_mark(r.passed):<4} "
                                f"{r.norm_ratio:9.4f}" for r in rows])


def format_full_kl(report: VerifyReport) -> str:
    title = ("kl.estimator full (exact KL over the vocabulary at each prefix, loss placement), through the trainer's "
             "chunked KL and grpo_objective: values vs the exact KL, per-draw gradient vs grad KL(pi||ref) "
             "(token: zero variance), expected gradients")
    values = format_values(report.full_kl_values).split("\n")[1:]
    return "\n".join([title, *values, "", *format_rows(report.full_kl, None, "").split("\n")[1:]])


def format_entropy(rows: list[EntropyCheck]) -> str:
    title = ("The entropy bonus (loss.entropy_coef): its expected gradient, E[n] x the trainer's objective's, by "
             "enumeration: the per-position entropy's (prefixes fixed), not the sequence entropy's")
    return _table(title, f"{'level':<9} {'compared with':<48} {'expect':<7} {'rel diff':>9}  ok",
                  [f"{r.level:<9} {r.target:<48} {r.expected:<7} {r.rel_diff:9.1e}  {_mark(r.passed)}"
                   for r in rows])


def format_monte_carlo(checks: list[montecarlo.MonteCarloCheck]) -> str:
    if not checks:
        return "Monte Carlo: skipped"
    head = (f"{'kind':<8} {'level':<8} {'estimator':<9} {'placement':<9} {'sampling':<20} {'N':>6} {'max z':>6} "
            f"{'z*':>5}  ok")
    title = ("Monte Carlo: max |sample mean - exact| / standard error; value z* = 4, gradient z* = two-sided "
             "Bonferroni over the coordinates at alpha 1e-3")
    return _table(title, head, [f"{c.kind:<8} {c.level:<8} {c.estimator:<9} {c.placement:<9} {c.sampling:<20} "
                                f"{c.samples:>6} {c.max_z:6.2f} {c.threshold:5.2f}  {_mark(c.passed)}" for c in checks])


def _tv(tv: float) -> str:
    return f"{tv:10.2e}" if tv < 1e-3 else f"{tv:10.4f}"


def format_optimum(results: list[optimum.OptimumResult]) -> str:
    if not results:
        return "Optimum: skipped"
    prob = optimum.optimal_policy()
    toy = sequence_toy.TOY
    star_len = float((prob * toy.lengths_B).sum())
    star_kl = float((prob * (prob.log() - toy.seq_logp(optimum.reference_theta()))).sum())
    head = (f"{'configuration':<38} {'TV to pi*':>10} {'E[len]':>7} {'KL':>7} {'E[R]':>7} {'steps':>6} "
            f"{'|grad|':>8}  {'exact?':<6} ok")
    title = (f"Optimum on the toy (reward {optimum.REWARD_PER_A} per 'a', beta {optimum.BETA}, ref uniform): "
             f"pi* has E[len] {star_len:.3f}, KL {star_kl:.3f}")
    return _table(title, head, [f"{r.label:<38} {_tv(r.tv_to_optimum)} {r.mean_length:7.3f} {r.kl:7.3f} "
                                f"{r.expected_reward:7.3f} {r.steps:6d} {r.grad_norm:8.1e}  {str(r.expected_exact):<6} "
                                f"{_mark(r.passed)}" for r in results])


def format_report(report: VerifyReport) -> str:
    first_epoch_title = ("First PPO epoch (pi_old == pi, so w = 1 in value) with kl.is_correction applied: token rows "
                         "must match the first_epoch declarations (loss: off-policy rows; reward KL at pi_old = pi: "
                         "on-policy rows), sequence/detached the on_policy row; n/a = information only")
    parts = [format_values(report.values), format_rows(report.rows, "token"), format_rows(report.rows, "sequence"),
             format_rows(report.first_epoch, None, first_epoch_title), format_migration(report.migration),
             format_full_kl(report), format_entropy(report.entropy), format_sampler_mismatch(report.sampler_mismatch),
             truncation.format_truncation(report.truncation_values, report.truncation, report.truncation_bugs),
             masked_kl.format_masked_kl(report.masked_kl, report.masked_kl_bugs),
             staleness.format_staleness(report.staleness, report.staleness_bugs),
             format_monte_carlo(report.monte_carlo), format_optimum(report.optimum)]
    failed = [r for r in report.rows + report.first_epoch + report.migration + report.full_kl + report.entropy
              + report.sampler_mismatch + report.truncation_values + report.truncation + report.truncation_bugs
              + report.masked_kl + report.masked_kl_bugs + report.staleness + report.staleness_bugs if not r.passed]
    values = report.values + report.full_kl_values
    total = (len(report.rows) + len(report.first_epoch) + len(report.migration) + len(report.full_kl) + len(values)
             + len(report.entropy) + len(report.sampler_mismatch)
             + len(report.truncation_values) + len(report.truncation) + len(report.truncation_bugs)
             + len(report.masked_kl) + len(report.masked_kl_bugs) + len(report.staleness) + len(report.staleness_bugs)
             + len(report.monte_carlo)
             + len(report.optimum))
    bad = len(failed) + sum(not v["passed"] for v in values) + sum(
        not m.passed for m in report.monte_carlo) + sum(not o.passed for o in report.optimum)
    parts.append(f"verify-kl: {'PASSED' if report.passed else 'FAILED'}: {total - bad}/{total} checks passed")
    return "\n\n".join(parts)
