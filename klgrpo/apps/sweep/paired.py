"""``klgrpo sweep --baseline SETTING``: every other setting against one baseline setting on the seeds both
finished (a paired comparison: the same seed gives the same prompts, the same first samples and the same
evaluation sets, so the difference per seed removes what the seed alone does), with a bootstrap interval of
the mean difference and an exact sign test, and the per-run plot of retention change against task change.

A difference is in points of greedy accuracy; "retention" is the mean change over the retention sets of one
run, so a run that trades one skill for another scores the balance."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

from klgrpo.apps.sweep.table import save_change_plot

RETENTION = "retention"        # the mean of a run's retention-set changes, in points
RESAMPLES = 10_000             # bootstrap resamples of the seeds' differences (fixed generator: repeatable)
LEVEL = 0.95                   # the interval's coverage
TIE = 1e-9                     # points: differences this small are ties (float noise of equal accuracies)


def retention_change(values: dict, retention: list[str]) -> float | None:
    """The mean change (points) over the retention sets of one run; None when any is missing."""
    changes = [values.get(f"{name}/change") for name in retention]
    if not changes or any(c is None for c in changes):
        return None
    return sum(changes) / len(changes)


def bootstrap_interval(diffs: list[float], resamples: int = RESAMPLES, level: float = LEVEL,
                       seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``diffs`` (resampling the seeds with replacement). With few
    seeds it is narrow for what it is: it cannot see past the spread the seeds showed."""
    rng = random.Random(seed)
    n = len(diffs)
    means = sorted(sum(rng.choice(diffs) for _ in range(n)) / n for _ in range(resamples))
    lo = means[int(math.floor((1 - level) / 2 * resamples))]
    hi = means[min(resamples - 1, int(math.ceil((1 + level) / 2 * resamples)) - 1)]
    return lo, hi


def sign_test(diffs: list[float]) -> tuple[int, int, float]:
    """(seeds above 0, seeds below 0, two-sided exact binomial p of that split at 1/2); ties are left out, as
    the sign test does. With 5 seeds the smallest possible p is 2/32 = 0.0625: 5 seeds can show a direction
    every time but never reach p < 0.05 on their own."""
    # A tie within float noise is a tie: two changes of whole prompts that agree differ by ~1e-14 points.
    up, down = sum(d > TIE for d in diffs), sum(d < -TIE for d in diffs)
    n, k = up + down, min(up, down)
    if n == 0:
        return up, down, 1.0
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return up, down, min(1.0, 2 * tail)


def _per_seed(cell: dict, key: str, retention: list[str]) -> dict[int, float]:
    out = {}
    for r in cell["runs"]:
        if "values" not in r:
            continue
        v = retention_change(r["values"], retention) if key == RETENTION else r["values"].get(key)
        if v is not None:
            out[r["seed"]] = float(v)
    return out


def compare(cell: dict, base: dict, key: str, retention: list[str]) -> dict[str, Any] | None:
    """``cell`` minus ``base`` in ``key`` (a "<set>/change" or RETENTION) over the seeds both have."""
    mine, theirs = _per_seed(cell, key, retention), _per_seed(base, key, retention)
    seeds = sorted(set(mine) & set(theirs))
    if not seeds:
        return None
    diffs = [mine[s] - theirs[s] for s in seeds]
    lo, hi = bootstrap_interval(diffs)
    up, down, p = sign_test(diffs)
    return {"seeds": seeds, "diffs": diffs, "mean": sum(diffs) / len(diffs), "low": lo, "high": hi,
            "higher": up, "lower": down, "sign_p": p}


def paired_table(table: dict[str, Any], baseline: str) -> dict[str, Any]:
    """Every setting but ``baseline`` against it: the retention mean, each retention set and the trained set."""
    cells = {c["setting"]: c for c in table["cells"]}
    base = cells[baseline]
    retention, trained = table["retention"], table["trained"]
    keys = ([RETENTION] if retention else []) + [f"{n}/change" for n in retention] + \
        ([f"{trained}/change"] if trained else [])
    rows = []
    for name, cell in cells.items():
        if name == baseline:
            continue
        rows.append({"setting": name, **{k: compare(cell, base, k, retention) for k in keys}})
    return {"baseline": baseline, "keys": keys, "resamples": RESAMPLES, "level": LEVEL, "rows": rows}


def _label(key: str) -> str:
    return "retention (mean of sets)" if key == RETENTION else key.replace("/change", "")


def points(value: float) -> str:
    """``value`` in points with its sign, to one decimal; a mean that rounds to zero reads +0.0, never -0.0."""
    return f"{round(value, 1) + 0.0:+.1f}"


def _cell_text(c: dict | None) -> str:
    if c is None:
        return "n/a"
    return (f"{points(c['mean'])} ({points(c['low'])}..{points(c['high'])}); {c['higher']}+ {c['lower']}- "
            f"p={c['sign_p']:.3g}")


def paired_markdown(paired: dict[str, Any]) -> str:
    """The paired table and one sentence per setting on the retention mean."""
    keys = paired["keys"]
    if not keys:  # no run has finished yet (--table-only early): nothing names the sets to compare
        return f"## Paired against {paired['baseline']} (same seeds)\n\nNo finished runs to compare yet.\n"
    lines = [f"## Paired against {paired['baseline']} (same seeds)", "",
             f"Per seed: the setting's change minus the baseline's, in points. Each cell: mean difference "
             f"({100 * paired['level']:.0f}% percentile bootstrap interval over the seeds, {paired['resamples']} "
             f"resamples); seeds above + and below - the baseline; the two-sided exact sign test's p.", "",
             "| setting | seeds | " + " | ".join(f"{_label(k)} vs baseline" for k in keys) + " |",
             "|" + "|".join("---" for _ in range(len(keys) + 2)) + "|"]
    sentences = []
    for row in paired["rows"]:
        first = next((row[k] for k in keys if row[k]), None)
        seeds = ",".join(map(str, first["seeds"])) if first else "-"
        lines.append(f"| {row['setting']} | {seeds} | " + " | ".join(_cell_text(row[k]) for k in keys) + " |")
        r = row.get(RETENTION)
        if r:
            n = len(r["seeds"])
            sentences.append(f"- {row['setting']}: retention change vs {paired['baseline']}: "
                             f"{points(r['mean'])} points ({100 * paired['level']:.0f}% interval "
                             f"{points(r['low'])}..{points(r['high'])}) over "
                             f"{n} seed{'s' if n > 1 else ''} ({r['higher']} above, {r['lower']} below; sign test "
                             f"p={r['sign_p']:.3g})")
    return "\n".join(lines + ([""] + sentences if sentences else [])) + "\n"


def plot_runs(table: dict[str, Any], path: Path) -> Path | None:
    """One point per finished run: its retention change (mean of the retention sets, x) against its trained-set
    change (y), one marker and colour per setting: where the means hide a seed that collapsed, this shows it."""
    trained, retention = table["trained"], table["retention"]
    if not trained or not retention:
        return None
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5.5), dpi=110)
    ax = fig.add_subplot()
    markers = "osD^vP*Xph<>"
    for i, c in enumerate(table["cells"]):
        pts = [(retention_change(r["values"], retention), r["values"].get(f"{trained}/change"), r["seed"])
               for r in c["runs"] if "values" in r]
        pts = [p for p in pts if p[0] is not None and p[1] is not None]
        if not pts:
            continue
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], marker=markers[i % len(markers)], s=40,
                   color=f"C{i % 10}", label=c["setting"], alpha=0.8)
    ax.legend(fontsize=7, loc="best")
    return save_change_plot(fig, ax, path, f"retention change (points, mean of {', '.join(retention)}): higher is "
                            "better", trained, "each run: trained skill vs retention")
