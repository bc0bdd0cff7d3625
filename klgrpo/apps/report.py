"""``klgrpo report RUN_DIR``: redraw a run folder's plots and print a summary table."""

from __future__ import annotations

import sys
from pathlib import Path

from klgrpo.apps.commands import command_parser
from klgrpo.errors import KLGRPOError
from klgrpo.run.metrics import METRICS_FILE
from klgrpo.run.report import PLOT_FILES, PLOTS_DIR, make_plots, summary_table


def main(argv: list[str] | None = None) -> int:
    parser = command_parser("report", "The plots go to RUN_DIR/plots/*.png; the summary is of its metrics.")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run folder written by `klgrpo train` (runs/<name>)")
    parser.add_argument("--no-plots", action="store_true", help="print the table only; leave plots/ alone")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        print(f"klgrpo report: {run_dir} is not a folder; pass a run folder (runs/<name>), which holds "
              f"{METRICS_FILE}.", file=sys.stderr)
        return 2
    metrics = run_dir / METRICS_FILE
    if not metrics.is_file():
        what = "is not a regular file (a FIFO, a device or a folder)" if metrics.exists() else "does not exist"
        print(f"klgrpo report: {metrics} {what}; a run folder holds {METRICS_FILE} from its first logged step "
              f"on.", file=sys.stderr)
        return 2
    try:
        if not args.no_plots:
            _check_plot_paths(run_dir)
        print(summary_table(run_dir))
        if not args.no_plots:
            paths = make_plots(run_dir)
            print()
            print("plots:" if paths else "plots: none (no plotted metric is in metrics.jsonl yet)")
            for path in paths:
                print(f"  {path}")
    except KLGRPOError as err:
        print(f"klgrpo report: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a read-only run folder (a shared or archived run): the table above is complete
        print(f"klgrpo report: cannot write the plots into {run_dir / 'plots'} ({err.strerror or err}); pass "
              f"--no-plots, or copy the run folder somewhere writable", file=sys.stderr)
        return 2
    return 0


def _check_plot_paths(run_dir: Path) -> None:
    """The plots report redraws (its own, in RUN_DIR/plots) never land on or in what it reads, also through a
    symbolic link there (the one rule of every command's outputs, klgrpo/apps/outputs.py)."""
    from klgrpo.apps.outputs import overlap
    from klgrpo.store.checkpoint import CHECKPOINTS_DIR
    from klgrpo.store.run_folder import CONFIG_FILE, SUMMARY_FILE

    plots = run_dir / PLOTS_DIR
    if plots.is_symlink() and not plots.resolve().is_relative_to(run_dir.resolve()):
        # the plots would replace same-named files of a folder that is not the run's
        raise KLGRPOError(f"{plots} is a symbolic link to {plots.resolve()}, outside the run folder; report "
                          f"redraws its plots only inside the run: remove the link, or pass --no-plots")
    inputs = [run_dir / name for name in (METRICS_FILE, CONFIG_FILE, SUMMARY_FILE, CHECKPOINTS_DIR)]
    for name in PLOT_FILES:
        plot = run_dir / PLOTS_DIR / name
        if (why := overlap(plot, inputs)) is not None:
            raise KLGRPOError(f"the plot {plot} {why} (through a symbolic link); remove the link, or pass --no-plots")
