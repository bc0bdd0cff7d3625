"""klgrpo sweep: grid parsing, cell naming, skipping finished runs, failed runs reported while the others run,
and the table's mean and spread over seeds. A fake trainer (a tiny script) stands in for `klgrpo train`;
one real sweep on a tiny model is marked slow."""

from __future__ import annotations

import json
import math
import sys
import textwrap

import pytest

from klgrpo.apps.sweep import command as sweep
from klgrpo.apps.sweep import table as sweep_table
from klgrpo.apps.sweep.command import run_sweep
from klgrpo.apps.sweep.plan import SweepError, cells_of, parse_grid, split_values
from klgrpo.apps.sweep.table import Cell, Run, aggregate, build_table
from klgrpo.apps.train import resolved_config

FAKE_TRAIN = textwrap.dedent("""
    import json, pathlib, sys
    args = sys.argv[1:]
    kv = dict(zip([a[2:] for a in args[0::2]], args[1::2]))
    coef, seed = float(kv.get("kl.coef", 0)), int(kv["train.seed"])
    print("fake training", coef, seed)
    out = pathlib.Path(kv["output-dir"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "checkpoints" / "step_2").mkdir(parents=True, exist_ok=True)
    (out / "checkpoints" / "step_2" / "model.safetensors").write_bytes(b"weights")
    if coef == 0.5:
        print("RuntimeError: boom at step 3")
        sys.exit(3)
    # Hand-made numbers: addition gains 10 + 10 * seed points; subtraction loses 100 * coef points.
    summary = {"steps": 5, "wall_seconds": 2.0 + seed,
               "eval_before": {"addition": 0.30, "subtraction": 0.80},
               "eval_after": {"addition": 0.40 + 0.10 * seed, "subtraction": 0.80 - coef},
               "final_kl": coef / 10, "final_replay_kl": float(kv.get("kl.replay.coef", 0)) / 100,
               "args": kv}
    (out / "summary.json").write_text(json.dumps(summary))
""")


@pytest.fixture
def fake_trainer(tmp_path, monkeypatch):
    script = tmp_path / "fake_train.py"
    script.write_text(FAKE_TRAIN)
    monkeypatch.setattr(sweep, "train_argv_prefix", lambda: [sys.executable, str(script)])
    return script


def quiet(*_):
    pass


# ---------------------------------------------------------------------------------------------- parsing
def test_grid_product_order_and_names():
    grid = parse_grid(["kl.coef=0,0.04", "kl.replay.coef=0,1", "kl.estimator=k2,k3_st"])
    assert grid == [("kl.coef", ["0", "0.04"]), ("kl.replay.coef", ["0", "1"]), ("kl.estimator", ["k2", "k3_st"])]
    cells = cells_of(grid)
    assert len(cells) == 8
    assert cells[0].name == "kl.coef=0,kl.replay.coef=0,kl.estimator=k2"
    assert cells[1].name == "kl.coef=0,kl.replay.coef=0,kl.estimator=k3_st"  # the last key varies fastest
    assert cells[-1].name == "kl.coef=0.04,kl.replay.coef=1,kl.estimator=k3_st"
    assert len({c.name for c in cells}) == 8


def test_grid_values_split_outside_brackets_and_folder_safe():
    assert split_values("0,[a,b],'x,y', 3") == ["0", "[a,b]", "'x,y'", "3"]
    grid = parse_grid(["--eval.sets=[],[{name: a, source: b}]", "model.name_or_path=a/b,c"])
    assert grid[0][1] == ["[]", "[{name: a, source: b}]"]
    cell = cells_of(grid)[2]
    assert "/" not in cell.name and cell.name.endswith("model.name_or_path=a_b")


@pytest.mark.parametrize("arg, expected", [
    ("kl.coef", "--grid 'kl.coef': write KEY=V1,V2"),
    ("kl.coef=", "--grid 'kl.coef=': write KEY=V1,V2"),
    ("kl.coef=0,,1", "--grid 'kl.coef=0,,1': an empty value"),
    ("kl.coef=0,0", "a value is repeated"),
    ("kl.coeff=0,1", "unknown config field 'kl.coeff' in --grid kl.coeff=0,1; did you mean kl.coef?"),
    ("kl.coef=0,abc", "kl.coef in --grid kl.coef=0,abc must be float, got 'abc'"),
    ("train.steps=10,1.5", "train.steps in --grid train.steps=10,1.5 must be int"),
    ("kl.estimator=k2,k4", "choose one of"),
    ("train.seed=0,1", "use --seeds"),
])
def test_bad_grid_errors_name_the_argument(arg, expected):
    with pytest.raises(SweepError) as info:
        parse_grid([arg])
    assert expected in str(info.value)


def test_cli_errors_are_one_line(capsys, tmp_path):
    for argv, expected in [(["--grid", "kl.coef=0", "--grid", "kl.coef=1"], "already in another --grid"),
                           ([], "at least one --grid"),
                           (["--cell", "kl.coef=0", "--", "--kl.coef", "1"], "both in --grid and after --"),
                           (["--grid", "kl.coef=0", "--seeds", "0,x"], "--seeds '0,x'"),
                           (["--grid", "kl.coef=0", "--frob"], "unknown options: --frob"),
                           (["--grid", "kl.coef=0", "--", "--kl.coef", "1"], "both in --grid and after --"),
                           (["--grid", "kl.coef=0", "--", "--output-dir", "x"], "set by the sweep"),
                           (["--grid", "kl.coef=0", "--config", str(tmp_path / "no.yaml")], "no such file")]:
        assert sweep.main(argv) == 2
        err = capsys.readouterr().err
        assert expected in err and len(err.strip().splitlines()) == 1, err


def test_run_arguments_order(tmp_path):
    run = Run(Cell((("kl.coef", "0.1"),)), 3, tmp_path / "c" / "seed=3")
    argv = sweep.run_argv(run, "run.yaml", ["--train.steps", "7", "--logging.plots=true"])
    text = " ".join(argv)
    assert "--config run.yaml" in text and "--train.steps 7" in text
    assert "--logging.plots false" not in text  # the user's override replaces the sweep default
    assert "--logging.tensorboard false" in text
    assert argv[-6:] == ["--kl.coef", "0.1", "--train.seed", "3", "--output-dir", str(tmp_path / "c" / "seed=3")]


def test_cells_beside_the_grid_and_their_own_seeds(tmp_path):
    cell = sweep.parse_cell("kl.controller=adaptive, kl.coef=0.04,seeds=[1,2]")
    assert cell.overrides == (("kl.controller", "adaptive"), ("kl.coef", "0.04")) and cell.seeds == (1, 2)
    assert cell.name == "kl.controller=adaptive,kl.coef=0.04"
    assert sweep.parse_cell("kl.coef=0.1,seeds=3").seeds == (3,)
    grid_cells = cells_of(parse_grid(["kl.coef=0,0.04"]))
    more_seeds = sweep.parse_cell("kl.coef=0.04,seeds=[0,1]")  # the same point as the grid's: one row, seed 1 added
    runs = sweep.plan_runs(grid_cells + [cell, more_seeds], [0], tmp_path)
    assert [(r.cell.name, r.seed) for r in runs] == [
        ("kl.coef=0", 0), ("kl.coef=0.04", 0), ("kl.controller=adaptive,kl.coef=0.04", 1),
        ("kl.controller=adaptive,kl.coef=0.04", 2), ("kl.coef=0.04", 1)]
    assert runs[-1].run_dir == tmp_path / "kl.coef=0.04" / "seed=1"


@pytest.mark.parametrize("arg, expected", [
    ("kl.coef", "write KEY=VALUE,KEY=VALUE"),
    ("seeds=[1]", "at least one KEY=VALUE besides seeds"),
    ("kl.coef=0,kl.coef=1", "kl.coef is given twice"),
    ("kl.coeff=0", "did you mean kl.coef?"),
    ("kl.coef=0,seeds=[1,x]", "--seeds '1,x'"),
    ("train.seed=1", "write seeds=[...]"),
])
def test_bad_cell_errors_name_the_argument(arg, expected):
    with pytest.raises(SweepError) as info:
        sweep.parse_cell(arg)
    assert expected in str(info.value)


# ---------------------------------------------------------------------------------------------- running
def test_failed_run_is_reported_and_others_run(fake_trainer, tmp_path, capsys):
    code = sweep.main(["--grid", "kl.coef=0,0.5,0.2", "--seeds", "0,1", "--output-dir", str(tmp_path / "s")])
    out = capsys.readouterr().out
    assert code == 1  # a failed run makes the sweep's exit code non-zero
    table = json.loads((tmp_path / "s" / "table.json").read_text())
    by_name = {c["setting"]: c for c in table["cells"]}
    assert by_name["kl.coef=0.5"]["seeds"] == [] and len(by_name["kl.coef=0.5"]["failed"]) == 2
    assert "exit code 3: RuntimeError: boom at step 3" in by_name["kl.coef=0.5"]["failed"][0]["error"]
    assert by_name["kl.coef=0.2"]["seeds"] == [0, 1]  # the cell after the failing one still ran
    assert "FAILED (exit code 3" in out
    md = (tmp_path / "s" / "table.md").read_text()
    assert "| kl.coef=0.5 | - (failed: 0,1) |" in md and "boom at step 3" in md
    assert (tmp_path / "s" / "kl.coef=0.5" / "seed=0" / "sweep.log").read_text().count("fake training") == 1
    assert (tmp_path / "s" / sweep.PLOT_FILE).stat().st_size > 0


def test_no_checkpoints_deletes_the_finished_runs_checkpoints_only(fake_trainer, tmp_path):
    """--no-checkpoints: a finished run keeps its summary, log and sweep record but not its checkpoints; a failed
    run keeps everything (its log and last checkpoint say what happened); without it every checkpoint stays."""
    assert sweep.main(["--grid", "kl.coef=0,0.5", "--output-dir", str(tmp_path / "s"), "--no-checkpoints"]) == 1
    done, failed = tmp_path / "s" / "kl.coef=0" / "seed=0", tmp_path / "s" / "kl.coef=0.5" / "seed=0"
    assert not (done / "checkpoints").exists()
    assert {p.name for p in done.iterdir()} == {"summary.json", sweep.LOG_FILE, sweep.IDENTITY_FILE}
    assert (failed / "checkpoints" / "step_2" / "model.safetensors").read_bytes() == b"weights"
    assert sweep.main(["--grid", "kl.coef=0", "--output-dir", str(tmp_path / "kept")]) == 0
    assert (tmp_path / "kept" / "kl.coef=0" / "seed=0" / "checkpoints" / "step_2" / "model.safetensors").exists()
    with pytest.raises(SweepError, match="--no-checkpoints comes after --"):
        sweep.parse_args(["--grid", "kl.coef=0", "--", "--no-checkpoints"])


def test_finished_runs_are_skipped(fake_trainer, tmp_path, monkeypatch):
    cells = cells_of(parse_grid(["kl.coef=0,0.5"]))
    first = run_sweep(cells, [0], tmp_path / "s", None, [], log=quiet)
    assert [r.status for r in first] == ["finished", "failed"]
    # Second pass: only the failed run executes again (the command now fails for everyone, to prove it).
    monkeypatch.setattr(sweep, "train_argv_prefix", lambda: [sys.executable, "-c", "import sys; sys.exit(5)"])
    second = run_sweep(cells, [0], tmp_path / "s", None, [], log=quiet)
    assert [r.status for r in second] == ["skipped", "failed"]
    assert "exit code 5" in second[1].error
    assert second[0].summary["eval_after"]["addition"] == pytest.approx(0.4)


def test_each_run_says_when_it_starts_and_a_bar_counts_the_runs_done(fake_trainer, tmp_path, capsys):
    """A line when a run starts (run i/N, its settings and seed, its log file) before its end line, and with
    progress a bar of runs done on stderr that starts at the runs already finished."""
    cells = cells_of(parse_grid(["kl.coef=0,0.5,0.2"]))
    lines = []
    runs = run_sweep(cells, [0], tmp_path / "s", None, [], log=lines.append, progress=True)
    assert [r.status for r in runs] == ["finished", "failed", "finished"]
    starts = [line for line in lines if line.startswith("  run ")]
    assert starts == [f"  run {i}/3: kl.coef={c} seed=0 (output: {tmp_path / 's' / f'kl.coef={c}' / 'seed=0'}"
                      f"/sweep.log)" for i, c in enumerate(["0", "0.5", "0.2"], start=1)]
    ends = [line.split(":")[0] for line in lines if line.startswith("  [")]
    assert ends == ["  [1/3] kl.coef=0 seed=0", "  [2/3] kl.coef=0.5 seed=0", "  [3/3] kl.coef=0.2 seed=0"]
    for start, end in zip(starts, [line for line in lines if line.startswith("  [")]):
        assert lines.index(start) < lines.index(end)  # each run's start before its end
    bar = capsys.readouterr().err
    assert "3/3" in bar and "run" in bar  # the bar reached the last run
    lines.clear()
    run_sweep(cells, [0], tmp_path / "s", None, [], log=lines.append, progress=True)  # only the failed one again
    assert [line for line in lines if line.startswith("  run ")] == [
        f"  run 3/3: kl.coef=0.5 seed=0 (output: {tmp_path / 's' / 'kl.coef=0.5' / 'seed=0'}/sweep.log)"]
    bar = capsys.readouterr().err
    assert "2/3" in bar and "3/3" in bar  # from the two finished before
    run_sweep(cells, [0], tmp_path / "t", None, [], log=quiet, progress=False)
    assert capsys.readouterr().err == ""


def _files(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_failed_rerun_never_touches_finished_runs(fake_trainer, tmp_path, monkeypatch):
    """A sweep with one failed cell, rerun with a change to every run's config (here -- --train.steps 7) by a
    trainer that now fails at once: the finished run's folder stays byte for byte (summary.json, sweep_cell.json,
    sweep.log), it is named as finished with another config and kept out of the table; the failed one is tried
    again. The same command as the first then skips the finished run again."""
    cells = cells_of(parse_grid(["kl.coef=0,0.5"]))
    assert [r.status for r in run_sweep(cells, [0], tmp_path / "s", None, [], log=quiet)] == ["finished", "failed"]
    finished = tmp_path / "s" / "kl.coef=0" / "seed=0"
    before = _files(finished)
    assert "summary.json" in before
    monkeypatch.setattr(sweep, "train_argv_prefix", lambda: [sys.executable, "-c", "import sys; sys.exit(5)"])
    lines = []
    rerun = run_sweep(cells, [0], tmp_path / "s", None, ["--train.steps", "7"], log=lines.append)
    assert [r.status for r in rerun] == ["changed", "failed"]
    assert _files(finished) == before
    assert "(1 finished with another config, left as they are; 1 failed or incomplete before, run again)" in lines[0]
    assert any("kl.coef=0 seed=0: finished with another config" in line for line in lines)
    table = build_table(rerun)
    assert table["cells"][0]["seeds"] == [] and table["cells"][0]["changed"] == [0]
    assert "(finished with another config: 0)" in sweep.table_markdown(table, [])
    again = run_sweep(cells, [0], tmp_path / "s", None, [], log=quiet)
    assert [r.status for r in again] == ["skipped", "failed"] and _files(finished) == before


def test_a_finished_run_without_its_sweep_record_is_never_retrained(fake_trainer, tmp_path):
    """A summary.json whose sweep_cell.json is gone (or was never written: a run copied in by hand) is not the
    sweep's to replace."""
    cells = cells_of(parse_grid(["kl.coef=0"]))
    run_sweep(cells, [0], tmp_path / "s", None, [], log=quiet)
    folder = tmp_path / "s" / "kl.coef=0" / "seed=0"
    (folder / sweep.IDENTITY_FILE).unlink()
    before = _files(folder)
    assert [r.status for r in run_sweep(cells, [0], tmp_path / "s", None, [], log=quiet)] == ["changed"]
    assert _files(folder) == before


def test_demo_override_equal_to_the_library_default_is_a_new_cell(fake_trainer, tmp_path):
    """The demo trains with the replay anchor on (kl.replay.coef 1); --kl.replay.coef 0 equals the library default
    but turns the anchor off, so a finished run without it must not be reused (the cell's identity is the demo's
    resolved config): it is kept as it is and named, and the new config trains in another folder. Repeating the
    demo's own value is the same config and is reused."""
    cells = cells_of(parse_grid(["kl.coef=0.2"]))
    assert [r.status for r in run_sweep(cells, [0], tmp_path / "s", None, [], log=quiet)] == ["finished"]
    off = run_sweep(cells, [0], tmp_path / "s", None, ["--kl.replay.coef", "0"], log=quiet)
    assert [r.status for r in off] == ["changed"]  # not "skipped", and not trained over
    assert [r.status for r in run_sweep(cells, [0], tmp_path / "s", None, ["--kl.replay.coef", "1"],
                                        log=quiet)] == ["skipped"]
    off = run_sweep(cells, [0], tmp_path / "off", None, ["--kl.replay.coef", "0"], log=quiet)
    assert [r.status for r in off] == ["finished"] and off[0].summary["args"]["kl.replay.coef"] == "0"
    same = run_sweep(cells, [0], tmp_path / "off", None, ["--kl.replay.coef", "0"], log=quiet)
    assert [r.status for r in same] == ["skipped"]
    run = Run(cells[0], 0, tmp_path / "r")
    assert sweep.run_identity(run, None, ["--kl.replay.coef", "1"]) == sweep.run_identity(run, None, [])
    argv = sweep.run_argv(run, None, [])[len(sweep.train_argv_prefix()):]
    assert resolved_config(argv).kl.replay.coef == 1.0


def test_parallel_jobs_give_the_same_table(fake_trainer, tmp_path):
    cells = cells_of(parse_grid(["kl.coef=0,0.2", "kl.replay.coef=0,1"]))
    serial = build_table(run_sweep(cells, [0, 1], tmp_path / "a", None, [], jobs=1, log=quiet))
    parallel = build_table(run_sweep(cells, [0, 1], tmp_path / "b", None, [], jobs=3, log=quiet))
    def strip(table):  # what may differ: the run folders and the processes' wall times
        cells = [{k: v for k, v in c.items() if k != "runs"} for c in table["cells"]]
        return [{**c, "stats": {k: v for k, v in c["stats"].items() if k != "process_seconds"}} for c in cells]
    assert strip(serial) == strip(parallel)


def test_a_sweep_of_cells_only_runs_each_setting_and_seed_once(fake_trainer, tmp_path):
    code = sweep.main(["--cell", "kl.coef=0.2", "--cell", "kl.coef=0.1,seeds=[0,1]",
                       "--cell", "kl.coef=0.2,seeds=[0,2]", "--output-dir", str(tmp_path / "s")])
    assert code == 0
    table = json.loads((tmp_path / "s" / "table.json").read_text())
    assert [(c["setting"], c["seeds"]) for c in table["cells"]] == [("kl.coef=0.2", [0, 2]), ("kl.coef=0.1", [0, 1])]
    # fake trainer: addition after = 0.40 + 0.10 * seed -> seeds 0 and 2: 40% and 60%, change +10 and +30
    assert table["cells"][0]["stats"]["addition/change"]["mean"] == pytest.approx(20.0)
    md = (tmp_path / "s" / "table.md").read_text()
    assert "cell kl.coef=0.1 seeds 0,1" in md


SLOW_FAKE_TRAIN = textwrap.dedent("""
    import json, os, pathlib, sys, time
    args = sys.argv[1:]
    kv = dict(zip([a[2:] for a in args[0::2]], args[1::2]))
    out = pathlib.Path(kv["output-dir"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "started").write_text(str(os.getpid()))
    if float(kv["kl.coef"]) > 0 and not os.environ.get("FAKE_FAST"):
        time.sleep(600)  # stopped by the test's signal long before
    (out / "summary.json").write_text(json.dumps({"steps": 1, "eval_before": {"a": 0.0}, "eval_after": {"a": 1.0}}))
""")


@pytest.mark.slow  # about 22 s each: a real sweep of two trainings, killed and run again
@pytest.mark.parametrize("jobs, signame", [(1, "SIGINT"), (2, "SIGTERM")])
def test_a_killed_sweep_stops_its_runs_and_resumes(tmp_path, jobs, signame):
    """Interrupt a real sweep process while runs are going: it exits 130, the live runs die with it, no queued
    run starts; the same command again skips the finished run and trains the others."""
    import os
    import signal
    import subprocess
    import time

    script = tmp_path / "fake_train.py"
    script.write_text(SLOW_FAKE_TRAIN)
    out = tmp_path / "s"
    # SIGINT as a terminal's Ctrl-C delivers it, even where this test runs as a background job (which starts
    # with SIGINT ignored, and its children inherit that)
    code = (f"import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
            f"from klgrpo.apps.sweep import command as sweep; sweep.train_argv_prefix = lambda: [sys.executable, "
            f"{str(script)!r}]; sys.exit(sweep.main(['--grid', 'kl.coef=0,1,2,3', '--jobs', '{jobs}', "
            f"'--output-dir', {str(out)!r}]))")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sleeping = [out / f"kl.coef={c}" / "seed=0" / "started" for c in ([1] if jobs == 1 else [1, 2])]
    for _ in range(1200):  # until the slow runs have started (a safety bound, not a speed test)
        if all(p.exists() and p.read_text() for p in sleeping):
            break
        time.sleep(0.05)
    else:
        proc.kill()
        pytest.fail(f"the sweep's runs did not start within 60 s:\n{proc.communicate()[0][-3000:]}")
    pids = [int(p.read_text()) for p in sleeping]
    proc.send_signal(getattr(signal, signame))
    try:
        output, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the sweep did not stop within 120 s of {signame}:\n{proc.communicate()[0][-3000:]}")
    assert proc.returncode == 130, output
    assert "interrupted; run the same command" in output
    for pid in pids:  # stopped and reaped by the sweep
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not (out / "kl.coef=3" / "seed=0").exists()  # the queued run never started
    env = dict(os.environ, FAKE_FAST="1")
    again = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "4 runs in" in again.stdout, again.stdout
    assert (f"(1 finished before, skipped; {len(sleeping)} failed or incomplete before, run again)"
            in again.stdout), again.stdout
    table = json.loads((out / "table.json").read_text())
    assert [c["seeds"] for c in table["cells"]] == [[0]] * 4


# ---------------------------------------------------------------------------------------------- the table
def _run_with(tmp_path, name, seed, before, after, **extra):
    run = Run(Cell((("kl.coef", name),)), seed, tmp_path / name / f"seed={seed}", status="finished")
    run.summary = {"eval_before": before, "eval_after": after, "final_kl": 0.01 * (seed + 1), "steps": 4,
                   "wall_seconds": 10.0 + seed, **extra}
    return run


def test_table_mean_and_spread_over_seeds(tmp_path):
    after = [(0.4, 0.7), (0.6, 0.8), (0.5, 0.9)]
    runs = [_run_with(tmp_path, "0.1", s, {"addition": 0.3, "subtraction": 0.8}, {"addition": a, "subtraction": b})
            for s, (a, b) in enumerate(after)]
    table = build_table(runs)
    assert table["trained"] == "addition" and table["retention"] == ["subtraction"]
    st = table["cells"][0]["stats"]
    # addition change: +10, +30, +20 points -> mean 20, sample std sqrt((100 + 100 + 0) / 2) = 10
    assert st["addition/change"]["mean"] == pytest.approx(20.0)
    assert st["addition/change"]["std"] == pytest.approx(10.0)
    assert (st["addition/change"]["min"], st["addition/change"]["max"]) == (pytest.approx(10.0), pytest.approx(30.0))
    # subtraction change: -10, 0, +10 -> mean 0, std 10
    assert st["subtraction/change"]["mean"] == pytest.approx(0.0, abs=1e-9)
    assert st["subtraction/change"]["std"] == pytest.approx(10.0)
    assert st["final_kl"]["mean"] == pytest.approx(0.02) and st["wall_seconds"]["mean"] == pytest.approx(11.0)
    md = sweep.table_markdown(table, ["# t"])
    row = "| kl.coef=0.1 | 0,1,2 | 50.0% ± 10.0 | +20.0 ± 10.0 | 80.0% ± 10.0 | +0.0 ± 10.0 | 0.0200 ± 0.0100 |"
    assert row in md
    assert "replay KL" not in md  # no run had the anchor on


def test_table_generic_names_and_missing_values(tmp_path):
    runs = [_run_with(tmp_path, "0", 0, {"task": 0.1, "keep_a": 0.5, "keep_b": 0.2},
                      {"task": 0.3, "keep_a": 0.4, "keep_b": 0.2}, final_replay_kl=0.003),
            _run_with(tmp_path, "1", 0, {}, {"task": 0.5, "keep_a": 0.5, "keep_b": 0.1})]
    table = build_table(runs)
    assert table["trained"] == "task" and table["retention"] == ["keep_a", "keep_b"]
    second = table["cells"][1]["stats"]
    assert second["task/change"] is None and second["task/after"]["mean"] == 0.5  # no "before": change n/a
    md = sweep.table_markdown(table, [])
    assert "replay KL" in md and "0.0030" in md and "n/a" in md


def test_table_before_line_beta_and_process_columns_and_missing_runs(tmp_path):
    before = {"task": 0.25, "keep": 0.75}
    fixed = [_run_with(tmp_path, c, 0, before, {"task": 0.5, "keep": 0.5}, final_beta=float(c)) for c in ("0", "0.1")]
    missing = Run(Cell((("kl.coef", "0.1"),)), 1, tmp_path / "0.1" / "seed=1", status="missing")
    (tmp_path / "0" / "seed=0").mkdir(parents=True)
    (tmp_path / "0" / "seed=0" / sweep.IDENTITY_FILE).write_text(json.dumps({"identity": "x", "process_seconds": 75.5}))
    table = build_table(fixed + [missing])
    cells = {c["setting"]: c for c in table["cells"]}
    assert cells["kl.coef=0.1"]["missing"] == [1] and cells["kl.coef=0.1"]["seeds"] == [0]
    assert cells["kl.coef=0"]["stats"]["process_seconds"]["mean"] == 75.5
    assert cells["kl.coef=0"]["stats"]["task/before"]["mean"] == 0.25
    md = sweep.table_markdown(table, [])
    assert "| final KL | final beta | wall s | process s | steps |" in md
    assert "| kl.coef=0.1 | 0 (not run yet: 1) | 50.0% | +25.0 | 50.0% | -25.0 | 0.0100 | 0.1 | 10 | n/a | 4 |" in md
    assert "| kl.coef=0 | 0 | 50.0% | +25.0 | 50.0% | -25.0 | 0.0100 | 0 | 10 | 76 | 4 |" in md
    assert md.rstrip().endswith("Before training (greedy accuracy of the starting model): task 25.0%, keep 75.0%")
    # one beta everywhere: no beta column
    same = build_table([_run_with(tmp_path, c, 0, before, before, final_beta=0.04) for c in ("0", "0.1")])
    assert "final beta" not in sweep.table_markdown(same, [])


def test_points_and_plot_against_beta(tmp_path):
    def cell(overrides, after):
        run = Run(Cell(tuple(overrides)), 0, tmp_path / "r", status="finished")
        run.summary = {"eval_before": {"task": 0.2, "keep": 0.8}, "eval_after": {"task": after, "keep": 0.7},
                       "final_kl": 0.1, "steps": 3}
        return run
    table = build_table([cell([("kl.coef", "0.01")], 0.5), cell([("kl.coef", "0")], 0.6),
                         cell([("kl.controller", "adaptive"), ("kl.coef", "0.01")], 0.4),
                         cell([("kl.replay.coef", "1")], 0.3)])  # no kl.coef: not on the beta axis
    points = sweep_table.beta_points(table)
    assert [(b, others, st["task/after"]["mean"]) for b, others, st in points] == [
        (0.0, "", 0.6), (0.01, "", 0.5), (0.01, "kl.controller=adaptive", 0.4)]
    path = sweep.plot_vs_beta(table, tmp_path / "beta.png")
    assert path.stat().st_size > 0
    assert sweep.plot_vs_beta(build_table([cell([("kl.replay.coef", "1")], 0.3)]), tmp_path / "none.png") is None


def test_table_only_trains_nothing_and_lists_what_is_missing(fake_trainer, tmp_path, monkeypatch):
    out = tmp_path / "s"
    assert sweep.main(["--grid", "kl.coef=0,0.2", "--output-dir", str(out)]) == 0
    monkeypatch.setattr(sweep, "train_argv_prefix", lambda: [sys.executable, "-c", "import sys; sys.exit(5)"])
    code = sweep.main(["--grid", "kl.coef=0,0.2", "--seeds", "0,1", "--output-dir", str(out), "--table-only"])
    assert code == 0  # nothing ran, nothing failed
    table = json.loads((out / "table.json").read_text())
    assert [(c["seeds"], c["missing"]) for c in table["cells"]] == [([0], [1]), ([0], [1])]
    assert not (out / "kl.coef=0" / "seed=1").exists()
    md = (out / "table.md").read_text()
    assert "(from the first run's start to the last finished run's end; --table-only)" in md
    assert (out / sweep.BETA_PLOT_FILE).stat().st_size > 0


def test_runs_span_from_the_folders(tmp_path):
    import os

    runs = []
    for i, (recorded, end) in enumerate([(100.0, 1000.0), (None, 1300.0)]):
        run = Run(Cell((("kl.coef", str(i)),)), 0, tmp_path / str(i), status="finished")
        run.run_dir.mkdir()
        ident = {"identity": "x"} | ({"process_seconds": recorded} if recorded else {})
        (run.run_dir / sweep.IDENTITY_FILE).write_text(json.dumps(ident))
        (run.run_dir / sweep.LOG_FILE).write_text("log")
        os.utime(run.run_dir / sweep.LOG_FILE, (end, end))
        os.utime(run.run_dir / sweep.IDENTITY_FILE, (950.0, 950.0))  # an older sweep's: written at the start
        runs.append(run)
    # run 0: 900..1000 (recorded 100 s before its log's end); run 1: 950..1300 -> 400 s
    assert sweep.runs_span(runs) == pytest.approx(400.0)
    assert sweep.runs_span([Run(Cell(()), 0, tmp_path / "none", status="failed")]) == 0.0


def test_aggregate():
    assert aggregate([None, float("nan")]) is None
    one = aggregate([2.0])
    assert one == {"mean": 2.0, "std": 0.0, "min": 2.0, "max": 2.0, "n": 1}
    two = aggregate([1.0, None, 3.0])
    assert two["n"] == 2 and two["std"] == pytest.approx(math.sqrt(2.0))


# ------------------------------------------------------------------------------------------ a real sweep
@pytest.mark.slow
def test_real_sweep_on_a_tiny_model(tiny_model_dir, addition_file, tmp_path, capsys):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(textwrap.dedent(f"""
        model: {{name_or_path: {tiny_model_dir}, dtype: float32, device: cpu}}
        data: {{source: {addition_file}}}
        rollout: {{group_size: 4, prompts_per_step: 4, max_new_tokens: 4}}
        rewards: {{functions: [{{name: format, kwargs: {{pattern: "0"}}}}]}}
        kl: {{replay: {{source: {addition_file}, num_prompts: 4, batch_size: 4}}}}
        optim: {{lr: 0.01}}
        eval:
          sets: [{{name: add, source: {addition_file}, limit: 8}}, {{name: keep, source: {addition_file}, limit: 4}}]
        train: {{steps: 2}}
    """))
    code = sweep.main(["--config", str(cfg), "--grid", "kl.replay.coef=0,1", "--output-dir", str(tmp_path / "s")])
    assert code == 0, capsys.readouterr()
    table = json.loads((tmp_path / "s" / "table.json").read_text())
    assert table["trained"] == "add" and table["retention"] == ["keep"]
    cells = {c["setting"]: c for c in table["cells"]}
    assert cells["kl.replay.coef=0"]["stats"]["replay_kl"] is None
    assert cells["kl.replay.coef=1"]["stats"]["replay_kl"]["mean"] >= 0
    assert cells["kl.replay.coef=1"]["stats"]["steps"]["mean"] == 2


def test_demo_coef_sweep_fixes_beta_unless_told(tmp_path):
    run = Run(Cell((("kl.coef", "0"),)), 0, tmp_path / "r")
    assert "--kl.controller fixed" in " ".join(sweep.run_argv(run, None, []))  # the demo: beta is kl.coef
    assert "--kl.controller" not in " ".join(sweep.run_argv(run, "run.yaml", []))  # a user config decides
    told = " ".join(sweep.run_argv(run, None, ["--kl.controller", "dual"]))
    assert "fixed" not in told and "--kl.controller dual" in told
    other = Run(Cell((("kl.replay.coef", "1"),)), 0, tmp_path / "r")
    assert "--kl.controller" not in " ".join(sweep.run_argv(other, None, []))


def test_a_grid_value_out_of_range_refuses_the_sweep_before_any_run(tmp_path):
    cells = cells_of(parse_grid(["kl.coef=0,-1"]))
    with pytest.raises(SweepError, match=r"kl.coef=-1 seed=0: kl.coef must be >= 0; nothing was run"):
        run_sweep(cells, [0], tmp_path / "s", None, ["--train.steps", "2"], log=quiet)
    assert not (tmp_path / "s").exists()
