"""The end-of-run summary printed by ``klgrpo train`` (the demo and a run on the user's own config alike).

It reads the dict ``GRPOTrainer.train()`` returns (also written to ``summary.json``): the before/after table of
every evaluation set, final KL, beta and reward, steps and time, LoRA's settings when the run had an adapter, and
where the run folder, plots and TensorBoard logs are (only those the run wrote: logging.plots and
logging.tensorboard false write none). The caller prints it on rank 0 only.
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


def lora_line(cfg) -> str | None:
    """What a LoRA run trains and what its KL is measured against, from its config (GRPOConfig); None without an
    adapter (model.lora.r 0). Without kl.reference the reference is the base model with the adapter off, or with
    kl.sync_every its own frozen adapter (docs/lora.md)."""
    lora = cfg.model.lora
    if lora.r <= 0:
        return None
    targets = ", ".join(str(t) for t in lora.target_modules)
    if cfg.kl.reference:
        reference = f"kl.reference {cfg.kl.reference}"
    elif cfg.kl.sync_every:
        reference = f"the base model with a frozen copy of the adapter, synced every {cfg.kl.sync_every} steps"
    else:
        reference = "the base model with the adapter off"
    return (f"LoRA rank {lora.r}, alpha {lora.alpha:g}, dropout {lora.dropout:g}, targets {targets}; "
            f"reference {reference}")


def stopped_line(summary: Mapping) -> str | None:
    """The summary's early-stop line. A kl.on_runaway stop already printed its full sentence when it happened: here
    only where it stopped and the checkpoint to train on from, read from the runaway record."""
    from klgrpo.run.runaway import STOPPED

    if not summary.get("stopped_early"):
        return None
    actions = (summary.get("runaway") or {}).get("actions", [])
    stop = next((a for a in actions if a.get("action") == STOPPED and a.get("checkpoint")), None)
    if stop is None:
        return f"stopped early: {summary['stopped_early']}"
    kl = "" if stop.get("kl") is None else f" (KL {stop['kl']:.4g} per token)"
    return (f"stopped early: kl.on_runaway stop at step {stop['step']}{kl}; checkpoint {stop['checkpoint']} "
            f"(step {stop['target_step']}): train on from its weights (model.name_or_path {stop['checkpoint']}, "
            f"kl.reference the original model)")


def run_lines(summary: Mapping, lora: str | None = None) -> list[str]:
    """Steps, time, final KL / beta / reward, ``lora`` (``lora_line``), and an early stop if there was one."""
    timing = f"steps {summary.get('steps')}, {summary.get('seconds_per_step')} s/step, " \
             f"GRPO wall {summary.get('wall_seconds')} s"
    if summary.get("total_wall_seconds") is not None:
        timing += f", total {summary['total_wall_seconds']} s"
    beta = summary.get("final_beta")
    lines = [f"  {timing}",
             f"  final KL {_round(summary.get('final_kl'))}, final beta {_round(beta)}, "
             f"final reward {_round(summary.get('final_reward'))}"]
    if lora:
        lines.append(f"  {lora}")
    if (stopped := stopped_line(summary)) is not None:
        lines.append(f"  {stopped}")
    return lines


#: model.lora.save_merged's folder in the run folder (klgrpo/run/loop.py exports it there).
MERGED_DIR = "merged"


def where_lines(run_dir) -> list[str]:
    """The run folder with the records it holds (no checkpoints/ before the first save) and, only where the run
    wrote them, its plots, TensorBoard logs and merged LoRA model."""
    from klgrpo.run.report import PLOT_FILES, PLOTS_DIR
    from klgrpo.run.trackers import TB_DIR
    from klgrpo.store.checkpoint import CHECKPOINTS_DIR
    from klgrpo.store.run_folder import CONFIG_FILE, METRICS_FILE, SUMMARY_FILE

    run_dir = Path(run_dir)
    records = (SUMMARY_FILE, METRICS_FILE, CONFIG_FILE, f"{CHECKPOINTS_DIR}/")
    held = [name for name in records if (run_dir / name.rstrip("/")).exists()]
    lines = [f"  run folder   {run_dir}" + (f"  ({', '.join(held)})" if held else "")]
    if any((run_dir / PLOTS_DIR / name).is_file() for name in PLOT_FILES):
        lines.append(f"  plots        {run_dir / PLOTS_DIR}  (redraw: klgrpo report {run_dir})")
    if (run_dir / TB_DIR).is_dir():
        lines.append(f"  TensorBoard  tensorboard --logdir {run_dir / TB_DIR}")
    if (run_dir / MERGED_DIR).is_dir():
        lines.append(f"  merged model {run_dir / MERGED_DIR}  (base + LoRA adapter, loads with AutoModelForCausalLM)")
    return lines


def print_run_summary(summary: Mapping, run_dir=None, *, labels: Mapping[str, str] | None = None,
                      middle: list[str] | None = None, footer: list[str] | None = None,
                      out: Callable[[str], None] = print, lora: str | None = None) -> None:
    """Print the summary: eval table, run figures (with ``lora``, ``lora_line``'s), ``middle`` lines (the demo's
    replay note), where things are, then ``footer`` lines."""
    table = eval_table(summary, labels)
    out("")
    for line in table:
        out(line)
    if table:
        out("")
    for line in run_lines(summary, lora) + (middle or []) + [""] + where_lines(run_dir or summary["run_dir"]):
        out(line)
    for line in footer or []:
        out(line)
