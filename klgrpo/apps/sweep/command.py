"""``klgrpo sweep``: a grid of trainings (the demo by default), one normal run folder per cell and seed, and
one table of accuracy, retention, final KL and wall time with the spread over seeds.

    klgrpo sweep --grid kl.coef=0,0.04 --grid kl.replay.coef=0,1 --seeds 0,1
    klgrpo sweep --config run.yaml --grid kl.estimator=k2,k3_st --output-dir runs/sweep-est -- --train.steps 200
    klgrpo sweep --grid kl.coef=0,0.04 --cell kl.controller=adaptive,kl.coef=0.04 --cell "kl.coef=0.04,seeds=[1]"

A --cell adds one setting (a whole set of overrides) after the grid's product, for points that are not a
product (an adaptive controller beside fixed betas); its ``seeds=[...]`` replaces --seeds for that setting, and
a --cell with the same overrides as a grid point adds its seeds to that point (one row, more seeds).

Each run is ``python -m klgrpo train`` in a subprocess (a crash in one cell is reported, the others still
run), in ``<output-dir>/<key=value,...>/seed=<s>/`` with its output in ``sweep.log`` there. Running the same
command again skips the runs that finished with the same resolved config (a run's identity is the SHA-256 of
its full resolved config, kept in ``sweep_cell.json``) and reruns failed or interrupted ones from scratch
(``--overwrite``). A finished run (one with a summary.json) is never trained over: when its config changed
(overrides, config file, sweep-wide options) it is named, kept as it is and left out of the table; the new config
trains in another --output-dir. With --no-checkpoints each finished run's checkpoints are deleted once its summary
is written (the metrics, summary, config and log stay), so a sweep of a real model fits on a small disk.

The table (printed, and saved as table.md and table.json, plus accuracy_vs_retention.png, accuracy_vs_beta.png
and runs_accuracy_vs_retention.png, one point per run):
    accuracy   greedy accuracy after training on the trained skill, and its change in points from before
    retention  the same for every other evaluation set (forgetting shows as a negative change)
    which set is which: the demo's names (addition trained, subtraction held out) when present; otherwise
               the first entry of eval.sets is the task and the others are retention sets
    final KL   adaptive_kl/raw_kl of the last step (training prompts); replay KL = the last kl/replay
    wall s     the run's total wall seconds (the demo's includes loading; the trainer's is GRPO + evaluation)
Each value is the mean +- the sample standard deviation over the seeds that finished (min..max in
table.json). With --baseline SETTING, a second table compares every other setting with that one on the seeds
both finished (klgrpo/apps/sweep/paired.py): per seed the difference of the changes, its mean with a percentile
bootstrap interval and an exact sign test, so that "keeps the skills better than beta 0" is a measured statement.

Sweep defaults (printed in the table header; any of them can be overridden after --): no TensorBoard, plots,
progress bar or intermediate checkpoints, one torch thread, no wall-clock guard (train.max_wall_seconds 0, so
a busy machine cannot cut some runs short and not others), and on the demo, when kl.coef is swept,
kl.controller fixed (the demo's adaptive beta would make kl.coef only a starting value, and refuses 0).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Callable

from klgrpo.apps.sweep.paired import paired_markdown, paired_table, plot_runs
from klgrpo.apps.sweep.plan import (
    RESERVED,
    SweepError,
    cells_of,
    overrides_in,
    parse_cell,
    parse_grid,
    parse_seeds,
    plan_runs,
)
from klgrpo.apps.sweep.table import (
    IDENTITY_FILE,
    LOG_FILE,
    Cell,
    Run,
    build_table,
    plot,
    plot_vs_beta,
    runs_span,
    table_header,
    table_markdown,
)
from klgrpo.apps.train import resolved_config
from klgrpo.errors import KLGRPOError
from klgrpo.store.checkpoint import CHECKPOINTS_DIR
from klgrpo.store.run_folder import SUMMARY_FILE
from klgrpo.train.stop_signals import sigterm_as_interrupt

PLOT_FILE = "accuracy_vs_retention.png"
BETA_PLOT_FILE = "accuracy_vs_beta.png"
RUNS_PLOT_FILE = "runs_accuracy_vs_retention.png"
#: Added to every run before the user's overrides: results stay the same, runs get quieter and lighter
#: (no TensorBoard, plots or intermediate checkpoints), one torch thread (repeatable, and no OpenMP
#: blow-up beside other processes), and no wall-clock guard (a busy machine must not cut some cells short).
SWEEP_DEFAULTS = {"logging.progress": "false", "logging.tensorboard": "false", "logging.plots": "false",
                  "train.save_every": "0", "train.torch_threads": "1", "train.max_wall_seconds": "0"}
#: The demo's beta is adaptive (kl.coef is only its start, and 0 is refused); a sweep of kl.coef on the demo
#: compares fixed betas (as docs/retention.md does) unless kl.controller is given.
DEMO_COEF_SWEEP_DEFAULTS = {"kl.controller": "fixed"}

USAGE = """usage: klgrpo sweep --grid KEY=V1,V2,... [--grid ...] [--cell KEY=V,KEY=V,...] [--seeds 0,1] [--config FILE]
                    [--output-dir DIR] [--jobs N] [--baseline SETTING] [--no-checkpoints] [--dry-run]
                    [-- extra train overrides ...]

Runs `klgrpo train` for every combination of the --grid values and every seed (no --config and no
model.name_or_path: the embedded demo). Re-running the same command skips finished runs.

  --grid KEY=V1,V2,...  a config field (as in `klgrpo train --KEY VALUE`) and its values; repeat for a product
  --cell KEY=V,KEY=V    one more setting after the grid's product (repeatable); seeds=[S1,S2] in it replaces
                        --seeds for that setting (the same overrides as a grid point: more seeds for that point)
  --seeds S1,S2,...     training seeds (default 0); the table gives mean +- std over them
  --config FILE         YAML config of every run
  --output-dir DIR      the sweep folder (default runs/sweep-<timestamp>)
  --jobs N              runs at once (default 1; each run uses one torch thread)
  --baseline SETTING    compare every other setting with this one on the same seeds (e.g. kl.coef=0, as the
                        table names it): per seed the difference in retention and accuracy change, its mean with
                        a 95% bootstrap interval and a sign test, in table.md and table.json
  --no-checkpoints      delete each run's checkpoints once it has finished (its metrics, summary and log stay):
                        every run of SmolLM2-135M keeps ~1.6 GB of weights and optimizer state otherwise
  --dry-run             print the commands and exit
  --table-only          train nothing: write the table and plots from the runs that finished (a partial table
                        while the sweep runs, or after an upgrade of klgrpo)
  -- ...                overrides for every run, e.g. -- --train.steps 150
"""


# ---------------------------------------------------------------------------------------------- running
def train_argv_prefix() -> list[str]:
    """How a run starts (tests replace it with a fake trainer)."""
    return [sys.executable, "-m", "klgrpo", "train"]


def sweep_defaults(config: str | None, grid_keys: list[str], extra: list[str]) -> dict[str, str]:
    """SWEEP_DEFAULTS, plus DEMO_COEF_SWEEP_DEFAULTS when kl.coef is swept on the demo; minus what the user sets."""
    defaults = dict(SWEEP_DEFAULTS)
    if not config and "kl.coef" in grid_keys:
        defaults.update(DEMO_COEF_SWEEP_DEFAULTS)
    user = overrides_in(extra) | set(grid_keys)
    return {k: v for k, v in defaults.items() if k not in user}


def run_argv(run: Run, config: str | None, extra: list[str], overwrite: bool = False) -> list[str]:
    argv = list(train_argv_prefix())
    if overwrite:  # the folder holds an earlier run of this cell (failed, or with another config)
        argv.append("--overwrite")
    if config:
        argv += ["--config", config]
    for key, value in sweep_defaults(config, [k for k, _ in run.cell.overrides], extra).items():
        argv += [f"--{key}", value]
    argv += list(extra)
    for key, value in run.cell.overrides:
        argv += [f"--{key}", value]
    return argv + ["--train.seed", str(run.seed), "--output-dir", str(run.run_dir)]


def run_identity(run: Run, config: str | None, extra: list[str]) -> str:
    """SHA-256 of the config the run trains with, fully resolved (defaults < config file < sweep defaults <
    extra < cell < seed; for the demo its own defaults < the same arguments, as ``klgrpo train --print-config``
    shows them), without its output folder; of the argument list when it does not resolve (the run will fail).
    An override equal to the library default still changes a demo run whose default differs."""
    import hashlib

    argv = run_argv(run, config, extra)[len(train_argv_prefix()):]
    try:
        resolved = resolved_config(argv).to_dict()
        resolved["train"].pop("output_dir", None)
        payload = {"config": resolved}
    except KLGRPOError:
        payload = {"argv": argv[:-2]}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def check_run_configs(runs: list[Run], config: str | None, extra: list[str]) -> None:
    """Refuse the sweep, before any run starts, when a run's config does not resolve or validate (a --grid value
    out of range, a misspelt field): one line naming the run, instead of a failure an hour into the sweep."""
    for run in runs:
        try:
            resolved_config(run_argv(run, config, extra)[len(train_argv_prefix()):]).validate()
        except KLGRPOError as exc:
            raise SweepError(f"{run.cell.name} seed={run.seed}: {exc}; nothing was run") from None


def _finished_identity(run_dir: Path) -> str | None:
    try:
        return json.loads((run_dir / IDENTITY_FILE).read_text()).get("identity")
    except (OSError, ValueError, AttributeError):
        return None


def execute(run: Run, argv: list[str], identity: str = "") -> None:
    """Run one training in a subprocess, its output into <run>/sweep.log; sets status, error, summary."""
    run.run_dir.mkdir(parents=True, exist_ok=True)
    (run.run_dir / IDENTITY_FILE).write_text(json.dumps({"identity": identity, "argv": argv}))
    t0 = time.perf_counter()
    with open(run.run_dir / LOG_FILE, "w", encoding="utf-8") as log:
        log.write("$ " + " ".join(argv) + "\n")
        log.flush()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        _LIVE.add(proc)
        try:
            code = proc.wait()
        except BaseException:  # Ctrl-C while waiting: the run must not go on without its sweep
            _stop(proc)
            raise
        finally:
            _LIVE.discard(proc)
    run.seconds = time.perf_counter() - t0
    (run.run_dir / IDENTITY_FILE).write_text(json.dumps({"identity": identity, "argv": argv,
                                                         "process_seconds": round(run.seconds, 1)}))
    summary = _read_summary(run.run_dir)
    if code != 0 or summary is None:
        run.status = "failed"
        why = f"exit code {code}" if code != 0 else f"no {SUMMARY_FILE} written"
        run.error = f"{why}: {_last_line(run.run_dir / LOG_FILE)}"
    else:
        run.status, run.summary = "finished", summary


_LIVE: set[subprocess.Popen] = set()


def _stop_live_runs() -> None:
    """Terminate the runs still going (Ctrl-C of the sweep); their folders are rerun next time."""
    for proc in list(_LIVE):
        proc.terminate()
    for proc in list(_LIVE):
        _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM (the trainer saves and exits), then SIGKILL when it is still there after 30 s."""
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _read_summary(run_dir: Path) -> dict | None:
    try:
        return json.loads((run_dir / SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        return None


def _last_line(path: Path) -> str:
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1][:300] if lines else "(no output)"


def earlier_state(run: Run, identity: str) -> str:
    """What ``run``'s folder holds from before: "finished" (a summary.json of this config: reused), "changed" (a
    summary.json of another config, or with no sweep record of its config: the sweep's to keep, never to train
    over), "failed" (a folder without a summary: a failed or killed run, trained again) or "new"."""
    if _read_summary(run.run_dir) is not None:
        return "finished" if _finished_identity(run.run_dir) == identity else "changed"
    return "failed" if run.run_dir.exists() else "new"


#: What a run whose folder is in each earlier_state becomes, and how the sweep's first line counts them.
_EARLIER = {"finished": ("skipped", "finished before, skipped"),
            "changed": ("changed", "finished with another config, left as they are"),
            "failed": ("pending", "failed or incomplete before, run again")}


def sort_runs(runs: list[Run], identities: dict[int, str]) -> tuple[list[Run], str]:
    """Sets each run's status from its folder (earlier_state); returns the runs to train and what was found."""
    counts = dict.fromkeys(_EARLIER, 0)
    todo = []
    for run in runs:
        state = earlier_state(run, identities[id(run)])
        if state in counts:
            counts[state] += 1
        run.status = _EARLIER.get(state, ("pending",))[0]
        if run.status == "skipped":
            run.summary = _read_summary(run.run_dir) or {}
        elif run.status == "changed":
            run.error = (f"finished with another config; left as it is (another --output-dir, or delete "
                         f"{run.run_dir}, to train it again)")
        else:
            todo.append(run)
    found = "; ".join(f"{n} {_EARLIER[state][1]}" for state, n in counts.items() if n)
    return todo, found


def finished_runs(cells: list[Cell], seeds: list[int], out: Path, config: str | None, extra: list[str]) -> list[Run]:
    """The planned runs without training: finished ones (same resolved config) as "skipped", those finished with
    another config as "changed", the others "missing"."""
    runs = plan_runs(cells, seeds, out)
    for run in sort_runs(runs, {id(run): run_identity(run, config, extra) for run in runs})[0]:
        run.status = "missing"
    return runs


def run_sweep(cells: list[Cell], seeds: list[int], out: Path, config: str | None, extra: list[str], jobs: int = 1,
              log: Callable[[str], None] = print, keep_checkpoints: bool = True,
              progress: bool | None = False) -> list[Run]:
    """Train the planned runs that have no result yet. A folder that holds a summary.json is never trained over
    nor changed: reused when its config is the same, else named ("changed") and left as it is.
    ``keep_checkpoints`` False deletes the checkpoints of each run this call finishes. Each run is one ``log``
    line when it starts (run i/N, its settings and seed, where its output goes) and one when it ends;
    ``progress`` adds a bar of the runs done on stderr (None: where stderr is a terminal, tqdm's rule)."""
    import threading

    from tqdm.auto import tqdm

    runs = plan_runs(cells, seeds, out)
    identities = {id(run): run_identity(run, config, extra) for run in runs}
    todo, found = sort_runs(runs, identities)
    # Seed-major: every setting's first seed before any setting's second, so a sweep stopped early still
    # compares all settings on the same seeds (the table keeps the planned order).
    todo.sort(key=lambda run: (run.cell.seeds or seeds).index(run.seed))
    check_run_configs(todo, config, extra)
    done = len(runs) - len(todo)
    settings = len({run.cell.name for run in runs})
    log(f"klgrpo sweep: {settings} settings, {len(runs)} runs in {out}" + (f" ({found})" if found else ""))
    for run in runs:
        if run.status == "changed":
            log(f"  {run.cell.name} seed={run.seed}: {run.error}")
    started, ended = itertools.count(done + 1), itertools.count(done + 1)
    bar = tqdm(total=len(runs), initial=done, desc="sweep", unit="run", dynamic_ncols=True,
               disable=None if progress is None else not progress)
    said = threading.Lock()  # --jobs N: one line at a time, the bar redrawn under it

    def say(line: str, finished: bool = False) -> None:
        with said, tqdm.external_write_mode():
            log(line)
        if finished:
            bar.update(1)

    def one(run: Run) -> Run:
        from klgrpo.store.run_folder import holds_run

        say(f"  run {next(started)}/{len(runs)}: {run.cell.name} seed={run.seed} (output: {run.run_dir / LOG_FILE})")
        earlier = run.run_dir.is_dir() and holds_run(run.run_dir)
        execute(run, run_argv(run, config, extra, overwrite=earlier), identities[id(run)])
        if run.status == "finished" and not keep_checkpoints:
            shutil.rmtree(run.run_dir / CHECKPOINTS_DIR, ignore_errors=True)
        verdict = f"{run.seconds:.0f} s" if run.status == "finished" else f"FAILED ({run.error})"
        say(f"  [{next(ended)}/{len(runs)}] {run.cell.name} seed={run.seed}: {verdict}", finished=True)
        return run

    try:
        _train_each(todo, one, jobs)
    finally:
        bar.close()
    return runs


def _train_each(todo: list[Run], one: Callable[[Run], Run], jobs: int) -> None:
    """``one`` of every run in ``todo``, ``jobs`` at a time."""
    if jobs <= 1:
        for run in todo:
            one(run)
        return
    pool = ThreadPoolExecutor(max_workers=jobs)
    try:
        list(pool.map(one, todo))
    except BaseException:  # Ctrl-C: start no queued run (the caller stops the live ones)
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()


# --------------------------------------------------------------------------------------------------- CLI
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="klgrpo sweep", usage=USAGE, add_help=False)
    p.add_argument("--grid", action="append", default=[])
    p.add_argument("--cell", action="append", default=[])
    p.add_argument("--seeds", default="0")
    p.add_argument("--config")
    p.add_argument("--output-dir")
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--baseline")
    p.add_argument("--no-checkpoints", action="store_true")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--table-only", action="store_true")
    p.add_argument("-h", "--help", action="store_true")
    return p


#: The sweep's own options that are not also `klgrpo train` options (--config and --output-dir are both).
_SWEEP_OPTIONS = {"--grid", "--cell", "--seeds", "--jobs", "--baseline", "--no-checkpoints", "--dry-run",
                  "--table-only"}


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    argv = list(argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    parser = _parser()

    def fail(message: str) -> None:
        raise SweepError(message.replace("argument ", "").replace("unrecognized arguments", "unknown options"))

    parser.error = fail  # one-sentence errors instead of argparse's usage dump
    args = parser.parse_args(argv)
    if args.help:
        return args, extra
    if not args.grid and not args.cell:
        raise SweepError("give at least one --grid KEY=V1,V2,... (e.g. --grid kl.coef=0,0.04) or --cell KEY=V,...")
    if args.jobs < 1:
        raise SweepError(f"--jobs {args.jobs}: must be >= 1")
    if args.config and not Path(args.config).is_file():
        what = "not a regular file (a folder, a FIFO or a device)" if Path(args.config).exists() else "no such file"
        raise SweepError(f"--config {args.config}: {what}")
    if args.output_dir is not None:
        check_sweep_folder(args.output_dir)
    misplaced = [a for a in extra if a.split("=")[0] in _SWEEP_OPTIONS]
    if misplaced:
        raise SweepError(f"{misplaced[0]} comes after --, where only the runs' train overrides go; it is an option "
                         f"of the sweep: put it before --")
    clash = overrides_in(extra) & set(RESERVED)
    if clash:
        raise SweepError(f"-- {' '.join(sorted(clash))}: set by the sweep for each run (use --seeds and --output-dir)")
    return args, extra


def check_sweep_folder(output_dir: str) -> None:
    """--output-dir names a folder for the sweep's runs, never one that holds a ``klgrpo train`` run (the
    sweep's folders and tables would be written into it)."""
    from klgrpo.store.run_folder import CONFIG_FILE, OWNED_FILE, holds_run

    if not output_dir.strip():
        raise SweepError("--output-dir is empty; pass the sweep folder (or leave it out for runs/sweep-<time>)")
    out = Path(output_dir)
    if out.exists() and not out.is_dir():
        raise SweepError(f"--output-dir {out} is a file; pass a folder")
    if out.is_dir() and (holds_run(out) or (out / CONFIG_FILE).exists() or (out / OWNED_FILE).exists()):
        raise SweepError(f"--output-dir {out} holds a klgrpo train run, which the sweep would write into; pass "
                         f"another folder for the sweep")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args, extra = parse_args(argv)
        if args.help:
            print(USAGE)
            return 0
        grid = parse_grid(args.grid)
        extra_cells = [parse_cell(arg) for arg in args.cell]
        both = overrides_in(extra) & ({k for k, _ in grid} | {k for c in extra_cells for k, _ in c.overrides})
        if both:
            raise SweepError(f"{', '.join(sorted(both))} is both in --grid and after --; keep it in one place")
        seeds = parse_seeds(args.seeds)
    except KLGRPOError as exc:
        print(f"klgrpo sweep: error: {exc}", file=sys.stderr)
        return 2
    cells = (cells_of(grid) if grid else []) + extra_cells
    names = list(dict.fromkeys(c.name for c in cells))
    if args.baseline is not None and args.baseline not in names:
        print(f"klgrpo sweep: error: --baseline {args.baseline}: not a setting of this sweep; the settings are "
              f"{', '.join(names)}", file=sys.stderr)
        return 2
    out = Path(args.output_dir or Path("runs") / f"sweep-{datetime.now().strftime('%Y%m%d-%H%M%S')}")
    if args.dry_run:
        runs = plan_runs(cells, seeds, out)
        try:  # the commands printed are ones the sweep would run: a run it would refuse is refused here too
            check_run_configs(runs, args.config, extra)
        except KLGRPOError as exc:
            print(f"klgrpo sweep: error: {exc}", file=sys.stderr)
            return 2
        for run in runs:
            print(" ".join(run_argv(run, args.config, extra)))
        return 0
    try:
        lock = take_sweep_folder(out, cells, seeds, args.config, lock=not args.table_only)
    except KLGRPOError as exc:
        print(f"klgrpo sweep: error: {exc}", file=sys.stderr)
        return 2
    try:
        return _sweep(cells, grid, extra_cells, seeds, args, extra, out)
    finally:
        lock.release()


def take_sweep_folder(out: Path, cells: list[Cell], seeds: list[int], config: str | None, lock: bool = True):
    """Before anything is written: the sweep folder holds none of the inputs where the sweep writes (the one
    rule of every command's outputs, klgrpo/apps/outputs.py), then its lock (``.klgrpo.lock``, as a run
    folder's): a second sweep into the folder of a live one is refused, never run beside it. --table-only
    (``lock`` False) trains nothing and may run beside the sweep whose partial table it writes."""
    from klgrpo.apps.outputs import overlap
    from klgrpo.store.run_folder import RunLock

    writes = {run.run_dir.relative_to(out).parts[0] for run in plan_runs(cells, seeds, out)}
    writes |= {"table.md", "table.json", PLOT_FILE, BETA_PLOT_FILE, RUNS_PLOT_FILE}
    if (why := overlap(out, {"--config": config} if config else {}, folder=True, writes=writes)) is not None:
        raise SweepError(f"--output-dir {out} {why}; pass another folder")
    held = RunLock(out)
    if lock:
        held.check_free("sweep")
        out.mkdir(parents=True, exist_ok=True)
        held.acquire()
    return held


def _sweep(cells, grid, extra_cells, seeds, args, extra, out: Path) -> int:
    t0 = time.perf_counter()
    try:
        with sigterm_as_interrupt():  # SIGTERM stops the sweep (and its live runs) like Ctrl-C
            if args.table_only:
                runs = finished_runs(cells, seeds, out, args.config, extra)
            else:
                runs = run_sweep(cells, seeds, out, args.config, extra, args.jobs,
                                 keep_checkpoints=not args.no_checkpoints, progress=None)
    except KeyboardInterrupt:
        _stop_live_runs()
        print(f"klgrpo sweep: interrupted; run the same command with --output-dir {out} to continue "
              f"(finished runs are skipped)", file=sys.stderr)
        return 130
    wall = time.perf_counter() - t0 if not args.table_only else runs_span(runs)
    _write_table(runs, grid, extra_cells, seeds, args, extra, out, wall)
    return 1 if any(r.status in ("failed", "changed") for r in runs) else 0


def _write_table(runs, grid, extra_cells, seeds, args, extra, out: Path, wall: float) -> None:
    """table.md, table.json and the three plots of the sweep's runs, printed and saved in ``out``."""
    table = build_table(runs)
    defaults = " ".join(f"--{k} {v}" for k, v in sweep_defaults(args.config, [k for k, _ in grid], extra).items())
    header = table_header(grid, extra_cells, seeds, args.config, extra, defaults, table, out, wall, args.table_only)
    text = table_markdown(table, header)
    paired = paired_table(table, args.baseline) if args.baseline else None
    if paired:
        text += "\n" + paired_markdown(paired)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(text)
    (out / "table.json").write_text(json.dumps({"header": header, "grid": dict(grid), "seeds": seeds,
                                                "sweep_wall_seconds": round(wall, 1), **table,
                                                **({"paired": paired} if paired else {})}, indent=2))
    print()
    print(text)
    pictures = []
    for draw, name in ((plot, PLOT_FILE), (plot_vs_beta, BETA_PLOT_FILE), (plot_runs, RUNS_PLOT_FILE)):
        try:
            pictures.append(draw(table, out / name))
        except Exception as exc:  # a plot must not hide the table
            print(f"(no {name}: {type(exc).__name__}: {exc})")
    print(f"saved {out / 'table.md'}, {out / 'table.json'}" + "".join(f", {p}" for p in pictures if p))
