"""``klgrpo sweep``'s runs and what is made of them: the Cell and Run records, the table of accuracy and
retention per cell (mean +- sample std over the seeds) and its markdown and plot (klgrpo/apps/sweep/command.py runs
the grid)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from klgrpo.errors import KLGRPOError
from klgrpo.train.metric_names import KL_REPLAY

LOG_FILE = "sweep.log"
IDENTITY_FILE = "sweep_cell.json"
#: The axis of the second plot, when swept: the KL coefficient (beta).
BETA_KEY = "kl.coef"


@dataclass
class Cell:
    """One grid point: the (key, value text) overrides in --grid order."""

    overrides: tuple[tuple[str, str], ...]
    seeds: tuple[int, ...] = ()    # a --cell's own seeds (empty: the sweep's --seeds)

    @property
    def name(self) -> str:
        return ",".join(f"{k}={_safe(v)}" for k, v in self.overrides) or "base"


@dataclass
class Run:
    cell: Cell
    seed: int
    run_dir: Path
    status: str = "pending"        # finished | skipped (finished before) | failed | changed (finished with another
    #                                config: kept, not in the table) | missing (--table-only: not run yet)
    error: str = ""
    summary: dict = field(default_factory=dict)
    seconds: float = 0.0


def _safe(value: str) -> str:
    """A value as it appears in a folder name (path separators and spaces replaced)."""
    return "".join("_" if c in "/\\ :*?\"<>|" else c for c in value)


def skill_names(summary: dict) -> tuple[str | None, list[str]]:
    """(trained set, retention sets) of a run: as its summary names them (the demo's "trained_set" and
    "retention_sets"), else the first evaluation set and the others."""
    names = list(summary.get("eval_after") or summary.get("eval_before") or {})
    trained, retention = summary.get("trained_set"), summary.get("retention_sets") or []
    if trained in names and all(n in names for n in retention):
        return trained, retention + [n for n in names if n != trained and n not in retention]
    return (names[0] if names else None), names[1:]


def process_seconds(run_dir: Path) -> float | None:
    """Wall seconds of a run's whole process (loading, training, evaluation, saving): recorded by the sweep in
    sweep_cell.json; for a folder of an older sweep, the time from that file's writing to sweep.log's last write."""
    try:
        recorded = json.loads((run_dir / IDENTITY_FILE).read_text()).get("process_seconds")
        if recorded is not None:
            return float(recorded)
        return (run_dir / LOG_FILE).stat().st_mtime - (run_dir / IDENTITY_FILE).stat().st_mtime
    except (OSError, ValueError, AttributeError, TypeError):
        return None


def _final_replay_kl(run: Run) -> float | None:
    if run.summary.get("final_replay_kl") is not None:
        return run.summary["final_replay_kl"]
    try:
        from klgrpo.run.metrics import read_metrics

        values = [r[KL_REPLAY] for r in read_metrics(run.run_dir) if KL_REPLAY in r]
    except (OSError, KLGRPOError):
        return None
    return values[-1] if values else None


def run_values(run: Run, trained: str | None, retention: list[str]) -> dict[str, float | None]:
    """The table's numbers for one finished run (accuracies as fractions, changes in points)."""
    s = run.summary
    before, after = s.get("eval_before") or {}, s.get("eval_after") or {}
    values: dict[str, float | None] = {}
    for name in ([trained] if trained else []) + retention:
        a, b = after.get(name), before.get(name)
        values[f"{name}/before"] = b
        values[f"{name}/after"] = a
        values[f"{name}/change"] = None if a is None or b is None else 100.0 * (a - b)
    values["final_kl"] = s.get("final_kl")
    values["final_beta"] = s.get("final_beta")
    values["replay_kl"] = _final_replay_kl(run)
    values["wall_seconds"] = s.get("total_wall_seconds", s.get("wall_seconds"))
    values["process_seconds"] = process_seconds(run.run_dir)
    values["steps"] = s.get("steps")
    return values


def aggregate(xs: list[float | None]) -> dict[str, Any] | None:
    """mean, sample std (ddof 1; 0 for one value), min, max and n of the non-missing, finite values."""
    vals = [float(x) for x in xs if x is not None and math.isfinite(float(x))]
    if not vals:
        return None
    n = len(vals)
    mean = sum(vals) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in vals) / (n - 1)) if n > 1 else 0.0
    return {"mean": mean, "std": sd, "min": min(vals), "max": max(vals), "n": n}


def build_table(runs: list[Run]) -> dict[str, Any]:
    ok = [r for r in runs if r.status in ("finished", "skipped")]
    trained, retention = skill_names(ok[0].summary) if ok else (None, [])
    cells: dict[str, dict[str, Any]] = {}
    for run in runs:
        entry = cells.setdefault(run.cell.name, {"setting": run.cell.name, "overrides": dict(run.cell.overrides),
                                                 "seeds": [], "failed": [], "missing": [], "changed": [],
                                                 "runs": []})
        record = {"seed": run.seed, "run_dir": str(run.run_dir), "status": run.status}
        if run.status == "failed":
            entry["failed"].append({"seed": run.seed, "error": run.error, "log": str(run.run_dir / LOG_FILE)})
        elif run.status in ("missing", "changed"):
            entry[run.status].append(run.seed)
        else:
            record["values"] = run_values(run, trained, retention)
            if run.summary.get("stopped_early"):
                record["stopped_early"] = run.summary["stopped_early"]
            entry["seeds"].append(run.seed)
        entry["runs"].append(record)
    for entry in cells.values():
        keys = {k for r in entry["runs"] for k in r.get("values", {})}
        entry["stats"] = {k: aggregate([r["values"].get(k) for r in entry["runs"] if "values" in r])
                          for k in sorted(keys)}
    return {"trained": trained, "retention": retention, "cells": list(cells.values())}


def _fmt(stat: dict | None, kind: str) -> str:
    if stat is None:
        return "n/a"
    m, sd, n = stat["mean"], stat["std"], stat["n"]
    if kind == "pct":
        text, spread = f"{100 * m:.1f}%", f"{100 * sd:.1f}"
    elif kind == "pts":
        text, spread = f"{round(m, 1) + 0.0:+.1f}", f"{sd:.1f}"  # + 0.0: no "-0.0"
    elif kind == "kl":
        text, spread = f"{m:.4f}", f"{sd:.4f}"
    elif kind == "beta":
        text, spread = f"{m:.4g}", f"{sd:.2g}"
    elif kind == "range":
        lo, hi = stat["min"], stat["max"]
        return f"{lo:.0f}" if lo == hi else f"{lo:.0f}..{hi:.0f}"
    else:
        text, spread = f"{m:.0f}", f"{sd:.0f}"
    return text if n < 2 else f"{text} ± {spread}"


def table_markdown(table: dict[str, Any], header: list[str]) -> str:
    trained, retention = table["trained"], table["retention"]
    has_replay = any(c["stats"].get("replay_kl") for c in table["cells"])
    betas = {round(c["stats"]["final_beta"]["mean"], 12) for c in table["cells"] if c["stats"].get("final_beta")}
    has_beta = len(betas) > 1  # a column only when beta differs between settings
    has_process = any(c["stats"].get("process_seconds") for c in table["cells"])
    cols = ["setting", "seeds"]
    if trained:
        cols += [f"{trained} after", f"{trained} change (pts)"]
    for name in retention:
        cols += [f"{name} after", f"{name} change (pts)"]
    cols += ["final KL"] + (["final beta"] if has_beta else []) + (["replay KL"] if has_replay else [])
    cols += ["wall s"] + (["process s"] if has_process else []) + ["steps"]
    lines = [*header, "", "| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    notes, changed = [], []
    for c in table["cells"]:
        st = c["stats"]
        seeds = ",".join(map(str, c["seeds"])) or "-"
        if c["failed"]:
            seeds += f" (failed: {','.join(str(f['seed']) for f in c['failed'])})"
            notes += [f"- {c['setting']} seed={f['seed']} failed: {f['error']} (log: {f['log']})" for f in c["failed"]]
        if c.get("missing"):
            seeds += f" (not run yet: {','.join(map(str, c['missing']))})"
        if c.get("changed"):
            seeds += f" (finished with another config: {','.join(map(str, c['changed']))})"
            changed += [f"- {r['run_dir']}" for r in c["runs"] if r["status"] == "changed"]
        row = [c["setting"], seeds]
        for name in ([trained] if trained else []) + retention:
            row += [_fmt(st.get(f"{name}/after"), "pct"), _fmt(st.get(f"{name}/change"), "pts")]
        row += [_fmt(st.get("final_kl"), "kl")] + ([_fmt(st.get("final_beta"), "beta")] if has_beta else [])
        row += [_fmt(st.get("replay_kl"), "kl")] if has_replay else []
        row += [_fmt(st.get("wall_seconds"), "s")] + ([_fmt(st.get("process_seconds"), "s")] if has_process else [])
        row += [_fmt(st.get("steps"), "range")]
        lines.append("| " + " | ".join(row) + " |")
    before = before_line(table)
    if before:
        lines += ["", before]
    if notes:
        lines += ["", "Failed runs (rerun the same command to retry them):", *notes]
    if changed:
        lines += ["", "Finished with another config, kept as they are and left out of the table (give another "
                      "--output-dir, or delete these folders, to train them with this one):", *changed]
    return "\n".join(lines) + "\n"


def before_line(table: dict[str, Any]) -> str:
    """"Before training: add 34.4%, ..." (greedy accuracy of the starting model; a range where runs differ)."""
    parts = []
    for name in ([table["trained"]] if table["trained"] else []) + table["retention"]:
        vals = [r["values"].get(f"{name}/before") for c in table["cells"] for r in c["runs"] if "values" in r]
        st = aggregate(vals)
        if st is None:
            continue
        lo, hi = 100 * st["min"], 100 * st["max"]
        parts.append(f"{name} {lo:.1f}%" if round(lo, 1) == round(hi, 1) else f"{name} {lo:.1f}..{hi:.1f}%")
    return ("Before training (greedy accuracy of the starting model): " + ", ".join(parts)) if parts else ""


def plot(table: dict[str, Any], path: Path) -> Path | None:
    """Trained-skill change (y) against the first retention set's change (x), error bars = std over seeds."""
    trained, retention = table["trained"], table["retention"]
    if not trained or not retention:
        return None
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 5), dpi=110)
    ax = fig.add_subplot()
    for c in table["cells"]:
        x, y = c["stats"].get(f"{retention[0]}/change"), c["stats"].get(f"{trained}/change")
        if x is None or y is None:
            continue
        ax.errorbar(x["mean"], y["mean"], xerr=x["std"], yerr=y["std"], fmt="o", capsize=3)
        ax.annotate(c["setting"], (x["mean"], y["mean"]), textcoords="offset points", xytext=(5, 5), fontsize=8)
    ax.margins(x=0.3, y=0.15)  # room for the labels
    return save_change_plot(fig, ax, path, f"{retention[0]} change (points): retention, higher is better", trained,
                            "accuracy vs retention (mean ± std over seeds)")


def save_change_plot(fig, ax, path: Path, xlabel: str, trained: str, title: str) -> Path:
    """Finish and save a plot of the trained skill's change (y) against a retention change (x): the zero lines
    (above them: improved; right of them: kept), the axes' labels and the title."""
    ax.axvline(0, color="grey", lw=0.8)
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"{trained} change (points): the trained skill")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path)
    return path


def _as_float(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def beta_points(table: dict[str, Any]) -> list[tuple[float, str, dict]]:
    """(kl.coef, the setting's other overrides as "k=v,..." ("" for kl.coef alone), stats) of every setting with
    a numeric kl.coef and at least one finished run, sorted by kl.coef (stable)."""
    points = []
    for c in table["cells"]:
        beta = _as_float(str(c["overrides"].get(BETA_KEY, "")))
        if beta is not None and any(v is not None for v in c["stats"].values()):
            others = ",".join(f"{k}={v}" for k, v in c["overrides"].items() if k != BETA_KEY)
            points.append((beta, others, c["stats"]))
    return sorted(points, key=lambda p: p[0])


def plot_vs_beta(table: dict[str, Any], path: Path) -> Path | None:
    """One panel per evaluation set (accuracy after training against kl.coef, the accuracy before as a dashed
    line) and one of the final KL. Settings that set kl.coef alone form the line; the others (another
    controller, the replay anchor, ...) are marked points at their kl.coef, labelled with what else they set.
    None when no setting sets a numeric kl.coef."""
    names = ([table["trained"]] if table["trained"] else []) + table["retention"]
    points = beta_points(table)
    if not points:
        return None
    from matplotlib.figure import Figure

    panels = [(n, f"{n}/after", f"{n}/before", 100.0) for n in names] + [("final KL", "final_kl", None, 1.0)]
    fig = Figure(figsize=(4.2 * len(panels), 4), dpi=110)
    smallest = min((b for b, _, _ in points if b > 0), default=1e-3)
    markers = iter("sD^vP*Xph")
    marker_of: dict[str, str] = {}
    for i, (title, key, before_key, scale) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        line = sorted((b, st[key]) for b, others, st in points if not others and st.get(key))
        if line:
            ax.errorbar([b for b, _ in line], [scale * v["mean"] for _, v in line],
                        yerr=[scale * v["std"] for _, v in line], fmt="o-", color="C0", capsize=3,
                        label=f"{BETA_KEY} alone")
        labelled = set()  # one legend entry per setting kind, however many betas it sits at
        for b, others, st in points:
            if others and st.get(key):
                marker = marker_of.setdefault(others, next(markers, "o"))
                ax.errorbar([b], [scale * st[key]["mean"]], yerr=[scale * st[key]["std"]], fmt=marker, ms=8,
                            capsize=3, color=f"C{1 + list(marker_of).index(others)}",
                            label=None if others in labelled else others)
                labelled.add(others)
        if before_key:
            befores = [st[before_key]["mean"] for _, _, st in points if st.get(before_key)]
            if befores:
                ax.axhline(scale * sum(befores) / len(befores), ls="--", color="grey", lw=1, label="before training")
            ax.set_ylabel("greedy accuracy after training (%)")
            ax.set_ylim(0, 100)  # the whole scale: a few points on a few dozen prompts is noise
            ax.set_title(f"{title} ({'trained' if title == table['trained'] else 'retention'})")
        else:
            ax.set_ylabel("KL on the training prompts, last step")
            ax.set_ylim(bottom=0)
            ax.set_title(title)
        ax.set_xscale("symlog", linthresh=smallest)  # beta = 0 on a log axis
        ax.set_xlim(-0.3 * smallest, 1.6 * max(max(b for b, _, _ in points), smallest))
        ax.set_xlabel(f"{BETA_KEY} (beta)")
        ax.legend(fontsize=7)
    fig.suptitle("after training vs beta (mean ± std over seeds)")
    fig.tight_layout()
    fig.savefig(path)
    return path


def runs_span(runs: list[Run]) -> float:
    """Seconds from the first run's start to the last run's end over the runs that finished (a run ends at its
    sweep.log's last write and starts its process_seconds earlier, or when sweep_cell.json was written): the
    sweep's wall time, read from its folders."""
    starts, ends = [], []
    for run in runs:
        if run.status not in ("finished", "skipped"):
            continue
        try:
            end = (run.run_dir / LOG_FILE).stat().st_mtime
            recorded = json.loads((run.run_dir / IDENTITY_FILE).read_text()).get("process_seconds")
            start = end - float(recorded) if recorded is not None else (run.run_dir / IDENTITY_FILE).stat().st_mtime
        except (OSError, ValueError, AttributeError, TypeError):
            continue
        starts.append(start)
        ends.append(end)
    return max(ends) - min(starts) if starts else 0.0


def table_header(grid, extra_cells, seeds, config, extra, defaults: str, table, out: Path, wall: float,
                 table_only: bool = False) -> list[str]:
    """The lines above the table: what was swept, how each run was started, what the columns mean."""
    trained, retention = table["trained"], table["retention"]
    base = f"--config {config}" if config else "the embedded demo"
    axes = " x ".join(k + "={" + ",".join(v) + "}" for k, v in grid) or "none"
    added = "".join(f"; cell {c.name}" + (f" seeds {','.join(map(str, c.seeds))}" if c.seeds else "")
                    for c in extra_cells)
    lines = [f"# klgrpo sweep {out}",
             "",
             f"- grid: {axes}{added}; seeds {','.join(map(str, seeds))}; sweep wall time {wall:.0f} s"
             + (" (from the first run's start to the last finished run's end; --table-only)" if table_only else ""),
             f"- runs: {base}" + (f", with {' '.join(extra)}" if extra else "") + f"; sweep defaults: {defaults}",
             f"- accuracy = {trained or 'n/a'} (trained); retention = {', '.join(retention) or 'none'}; "
             f"after = greedy accuracy after training, change = after - before in points",
             "- values: mean ± sample std over the seeds that finished (min..max in table.json); "
             "final KL = adaptive_kl/raw_kl of the last step; final beta = the KL coefficient at the end (a column "
             "when it differs between settings); replay KL = the last kl/replay; wall s = the run's own wall time "
             "(the trainer's: GRPO + evaluation); process s = the whole process (loading, training, evaluation, "
             "saving)"]
    return lines
