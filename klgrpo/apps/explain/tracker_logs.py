"""The logs verl and OpenRLHF write through their trackers, read for ``klgrpo explain --run``.

TensorBoard event files (verl's ``Tracking`` with the tensorboard backend writes them under
``$TENSORBOARD_DIR``, default ``tensorboard_log/<project>/<experiment>``; OpenRLHF's ``--logger.tensorboard_dir``
under ``<dir>/<run_name>``) are read with TensorBoard's own ``EventAccumulator``. W&B offline runs
(``wandb/offline-run-*/run-*.wandb``) are read with the wandb package's own reader (``wandb leet inspect
--json``); without wandb an offline run is refused in one line that says what to install.

Which framework wrote a log is told by its metric names: the names are the frameworks' own (docs/explain.md
cites the files that log each one).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from klgrpo.errors import ConfigError

EVENT_PREFIX = "events.out.tfevents."
WANDB_SUFFIX = ".wandb"
#: How deep under the folder given to --run event files and W&B run files are looked for: verl's
#: tensorboard_log/<project>/<experiment>/ and wandb/offline-run-*/ both sit within it.
SEARCH_DEPTH = 3
#: Names only one framework logs: the first framework with one of them in a log wrote it.
FRAMEWORK_TAGS = {
    "verl": ("actor/kl_loss", "actor/kl_coef", "actor/reward_kl_penalty", "critic/kl", "actor/pg_clipfrac",
             "actor/pg_loss", "critic/score/mean"),
    "openrlhf": ("train/policy_loss", "train/ppo_clip_ratio", "train/ppo_kl", "train/actor_lr"),
}
#: The step of a W&B history row: OpenRLHF logs its own (wandb.define_metric("train/*",
#: step_metric="train/global_step")); verl passes its global step to wandb.log(step=...), W&B's _step.
WANDB_STEPS = ("train/global_step", "_step")
WANDB_TIMEOUT_S = 300
#: A run's last values fit in this; a larger wandb-summary.json is not quoted.
SUMMARY_BYTES = 1 << 20


def find_logs(path: Path, limit_bytes: int) -> tuple[str, list[Path]] | None:
    """("tensorboard", [event files of one folder]) or ("wandb", [one run file]) under ``path``, or None."""
    event_dirs, run_files = {}, []
    for folder, dirs, files in os.walk(path):
        depth = len(Path(folder).relative_to(path).parts)
        if depth >= SEARCH_DEPTH:
            dirs[:] = []
        events = sorted(Path(folder) / f for f in files if f.startswith(EVENT_PREFIX))
        if events:
            event_dirs[Path(folder)] = events
        run_files += [Path(folder) / f for f in files if f.startswith("run-") and f.endswith(WANDB_SUFFIX)]
    for kind, found in (("tensorboard", list(event_dirs)), ("wandb", run_files)):
        if len(found) > 1:
            shown = ", ".join(str(p) for p in sorted(found)[:3])
            raise ConfigError(f"{path} holds {len(found)} {kind} runs ({shown}{', ...' if len(found) > 3 else ''}): "
                              "pass the folder of one")
        if found:
            files = event_dirs[found[0]] if kind == "tensorboard" else found
            _check_size(files, limit_bytes)
            return kind, files
    return None


def _check_size(files: list[Path], limit_bytes: int) -> None:
    size = sum(f.stat().st_size for f in files)
    if size > limit_bytes:
        raise ConfigError(f"{files[0].parent} holds {size} bytes of logs, more than the {limit_bytes} explain --run "
                          "reads")


def tensorboard_rows(files: list[Path]) -> list[dict]:
    """One row per step: {"step": step, tag: value, ...}, every scalar tag of the folder's event files."""
    from tensorboard.backend.event_processing import event_accumulator

    accumulator = event_accumulator.EventAccumulator(str(files[0].parent),
                                                     size_guidance={event_accumulator.SCALARS: 0})
    accumulator.Reload()
    by_step: dict[int, dict] = {}
    for tag in accumulator.Tags()["scalars"]:
        for event in accumulator.Scalars(tag):
            by_step.setdefault(event.step, {"step": event.step})[tag] = event.value
    return [by_step[step] for step in sorted(by_step)]


def wandb_rows(run_file: Path, kl_names: tuple[str, ...]) -> list[dict]:
    """The history rows of a W&B run file, each with its step, or one ConfigError saying what to install."""
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"{run_file} is a W&B offline run: reading it needs the wandb package (pip install "
                          f"'wandb>=0.31', whose `wandb leet inspect` reads it){_summary_hint(run_file, kl_names)}")
    try:
        done = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_file)],
                              capture_output=True, text=True, timeout=WANDB_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise ConfigError(f"{run_file}: wandb did not read it in {WANDB_TIMEOUT_S} s") from None
    if done.returncode != 0:
        said = ((done.stderr.strip() or done.stdout.strip()).splitlines() or ["no message"])[-1]
        raise ConfigError(f"{run_file}: wandb could not read it ({said}); explain reads W&B runs with `wandb leet "
                          "inspect` (wandb >= 0.31)")
    return [row for line in done.stdout.splitlines() if (row := _history_row(line)) is not None]


def _history_row(line: str) -> dict | None:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    item = record.get("history", {}).get("item") if record.get("type") == "history" else None
    if not isinstance(item, dict):
        return None
    step = next((int(item[name]) for name in WANDB_STEPS if isinstance(item.get(name), (int, float))
                 and not isinstance(item.get(name), bool) and float(item[name]).is_integer()), None)
    return None if step is None else {**item, "step": step}


def _summary_hint(run_file: Path, kl_names: tuple[str, ...]) -> str:
    """What the run's files/wandb-summary.json (the last values, where wandb wrote one) says of the KL."""
    summary_file = run_file.parent / "files" / "wandb-summary.json"
    try:
        if summary_file.stat().st_size > SUMMARY_BYTES:
            return ""
        summary = json.loads(summary_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return ""
    names = [n for n in kl_names if isinstance(summary, dict) and isinstance(summary.get(n), (int, float))]
    return f"; its files/wandb-summary.json holds only the last values ({names[0]} {summary[names[0]]})" if names \
        else ""


def framework(rows: list[dict], where: Path) -> str:
    """"verl" or "openrlhf", from the metric names the log holds; one ConfigError naming what was looked for."""
    tags = set().union(*rows) if rows else set()
    for name, marks in FRAMEWORK_TAGS.items():
        if tags & set(marks):
            return name
    looked = "; ".join(f"{name}: {', '.join(marks)}" for name, marks in FRAMEWORK_TAGS.items())
    raise ConfigError(f"{where} logs none of the metric names explain reads ({looked}): is it a verl or OpenRLHF "
                      "run's log?")
