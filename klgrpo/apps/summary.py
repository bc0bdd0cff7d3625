"""The end-of-run summary printed by ``klgrpo train`` (the demo and a run on the user's own config alike).

It reads the dict ``GRPOTrainer.train()`` returns (also written to ``summary.json``): the before/after table of
every evaluation set, final KL, beta and reward, steps and time, and where the run folder, plots and TensorBoard
logs are. The caller prints it on rank 0 only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Mapping


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _round(x, digits: int = 4):
    return None if x is None else round(float(x), digits)


def eval_change(before, after) -> float | None:
    """after - before in percentage points, None when either is missing."""
    return None if before is None or after is None else 100 * (after - before)


def eval_table(summary: Mapping, labels: Mapping[str, str] | None = None) -> list[str]:
    """One row per evaluation set (before, after, change in points); no lines when the run had no eval sets.

    ``labels`` renames sets in the first column (e.g. {"addition": "addition (trained)"})."""
    before, after = summary.get("eval_before") or {}, summary.get("eval_after") or {}
    names = list(dict.fromkeys([*before, *after]))
    if not names:
        return []
    labels = labels or {}
    width = max(28, 2 + max(len(labels.get(n, n)) for n in names))
    lines = [f"  {'evaluation':<{width}}{'before':>8}{'after':>8}{'change':>9}"]
    for name in names:
        b, a = before.get(name), after.get(name)
        change = eval_change(b, a)
        lines.append(f"  {labels.get(name, name):<{width}}{_pct(b):>8}{_pct(a):>8}"
                     f"{'' if change is None else f'{change:+.1f}':>9}")
    return lines


def run_lines(summary: Mapping) -> list[str]:
    """Steps, time, final KL / beta / reward, and an early stop if there was one."""
    timing = f"steps {summary.get('steps')}, {summary.get('seconds_per_step')} s/step, " \
             f"GRPO wall {summary.get('wall_seconds')} s"
    if summary.get("total_wall_seconds") is not None:
        timing += f", total {summary['total_wall_seconds']} s"
    beta = summary.get("final_beta")
    lines = [f"  {timing}",
             f"  final KL {_round(summary.get('final_kl'))}, final beta {_round(beta)}, "
             f"final reward {_round(summary.get('final_reward'))}"]
    if summary.get("stopped_early"):
        lines.append(f"  stopped early: {summary['stopped_early']}")
    return lines


def where_lines(run_dir) -> list[str]:
    run_dir = Path(run_dir)
    return [f"  run folder   {run_dir}  (summary.json, metrics.jsonl, config.yaml, checkpoints/)",
            f"  plots        {run_dir / 'plots'}  (redraw: klgrpo report {run_dir})",
            f"  TensorBoard  tensorboard --logdir {run_dir / 'tb'}"]


def print_run_summary(summary: Mapping, run_dir=None, *, labels: Mapping[str, str] | None = None,
                      middle: list[str] | None = None, footer: list[str] | None = None,
                      out: Callable[[str], None] = print) -> None:
    """Print the summary: eval table, run figures, ``middle`` lines (the demo's replay note), where things are,
    then ``footer`` lines."""
    table = eval_table(summary, labels)
    out("")
    for line in table:
        out(line)
    if table:
        out("")
    for line in run_lines(summary) + (middle or []) + [""] + where_lines(run_dir or summary["run_dir"]):
        out(line)
    for line in footer or []:
        out(line)
