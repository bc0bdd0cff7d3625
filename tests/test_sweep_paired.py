"""``klgrpo sweep --baseline``: the paired comparison of each setting with a baseline on the same seeds, its
bootstrap interval and sign test (hand-derived values), and the per-run plot."""

from __future__ import annotations

import json
import math

import pytest

from klgrpo.apps.sweep import command as sweep
from klgrpo.apps.sweep.paired import (
    RETENTION,
    bootstrap_interval,
    paired_markdown,
    paired_table,
    plot_runs,
    retention_change,
    sign_test,
)
from klgrpo.apps.sweep.table import Cell, Run, build_table
from tests.test_sweep import fake_trainer  # noqa: F401  (the fixture)

BEFORE = {"task": 0.5, "keep_a": 0.8, "keep_b": 0.6}


def _run(tmp_path, coef, seed, task, keep_a, keep_b):
    run = Run(Cell((("kl.coef", coef),)), seed, tmp_path / coef / f"seed={seed}", status="finished")
    run.summary = {"eval_before": BEFORE, "eval_after": {"task": task, "keep_a": keep_a, "keep_b": keep_b},
                   "final_kl": 0.1, "steps": 4, "wall_seconds": 1.0}
    return run


def test_sign_test_exact_binomial():
    assert sign_test([1, 2, 3, 4, 5]) == (5, 0, pytest.approx(2 / 32))       # 2 * (1/2)^5
    assert sign_test([1, 2, 3, 4, -5]) == (4, 1, pytest.approx(2 * 6 / 32))  # 2 * (1 + 5) / 32 = 0.375
    assert sign_test([1, -1, 2, -2]) == (2, 2, 1.0)                          # capped at 1
    assert sign_test([0.0, 0.0, 3.0]) == (1, 0, 1.0)                         # ties left out: 1 of 1, p = 2 * 1/2
    assert sign_test([0.0]) == (0, 0, 1.0)
    ups = [1.0] * 10
    assert sign_test(ups)[2] == pytest.approx(2 / 1024)


def test_bootstrap_interval_bounds_and_repeatability():
    assert bootstrap_interval([4.0] * 5) == (4.0, 4.0)           # no spread, no interval
    diffs = [-10.0, 2.0, 5.0, 8.0, 20.0]
    lo, hi = bootstrap_interval(diffs)
    assert bootstrap_interval(diffs) == (lo, hi)                 # a fixed generator
    assert min(diffs) <= lo < sum(diffs) / 5 < hi <= max(diffs)
    # The normal approximation of the mean's 95% interval: 5 +- 1.96 * sd(pop) / sqrt(5) ~ 5 +- 8.9; the
    # percentile bootstrap lands near it (it resamples the population sd, not the sample's).
    sd = math.sqrt(sum((d - 5) ** 2 for d in diffs) / 5)
    assert lo == pytest.approx(5 - 1.96 * sd / math.sqrt(5), abs=2.0)
    assert hi == pytest.approx(5 + 1.96 * sd / math.sqrt(5), abs=2.0)
    assert bootstrap_interval([1.0, 3.0], resamples=4000, seed=1)[0] == 1.0  # both draws the same: 1/4 of them


def test_retention_change_is_the_mean_over_the_sets():
    assert retention_change({"a/change": -10.0, "b/change": 4.0}, ["a", "b"]) == pytest.approx(-3.0)
    assert retention_change({"a/change": -10.0, "b/change": None}, ["a", "b"]) is None
    assert retention_change({}, []) is None


def test_paired_table_uses_the_common_seeds_only(tmp_path):
    # baseline kl.coef=0 forgets: keep_a -20, keep_b -10 points on every seed; kl.coef=0.1 keeps them on seeds
    # 0-2 (0 and 0) and has a seed 3 the baseline lacks, which must not count.
    runs = [_run(tmp_path, "0", s, 0.7, 0.6, 0.5) for s in range(3)]
    runs += [_run(tmp_path, "0.1", s, 0.6 + 0.1 * (s == 2), 0.8, 0.6) for s in range(4)]
    table = build_table(runs)
    paired = paired_table(table, "kl.coef=0")
    assert paired["keys"] == [RETENTION, "keep_a/change", "keep_b/change", "task/change"]
    (row,) = paired["rows"]
    r = row[RETENTION]
    assert r["seeds"] == [0, 1, 2]
    # retention per run: baseline (-20 - 10) / 2 = -15, setting 0: per seed difference +15
    assert r["diffs"] == pytest.approx([15.0, 15.0, 15.0]) and (r["low"], r["high"]) == pytest.approx((15.0, 15.0))
    assert (r["higher"], r["lower"], r["sign_p"]) == (3, 0, pytest.approx(0.25))
    # task: baseline +20; setting +10, +10, +20 -> -10, -10, 0 (the tie leaves the sign test with 2 seeds)
    t = row["task/change"]
    assert t["diffs"] == pytest.approx([-10.0, -10.0, 0.0]) and t["mean"] == pytest.approx(-20 / 3)
    assert (t["higher"], t["lower"], t["sign_p"]) == (0, 2, pytest.approx(0.5))
    md = paired_markdown(paired)
    assert "| kl.coef=0.1 | 0,1,2 | +15.0 (+15.0..+15.0); 3+ 0- p=0.25 |" in md
    assert ("- kl.coef=0.1: retention change vs kl.coef=0: +15.0 points (95% interval +15.0..+15.0) over 3 seeds "
            "(3 above, 0 below; sign test p=0.25)") in md
    # --table-only before any run finished: the section says so instead of an empty table
    missing = [Run(Cell((("kl.coef", c),)), 0, tmp_path / c, status="missing") for c in ("0", "0.1")]
    md = paired_markdown(paired_table(build_table(missing), "kl.coef=0"))
    assert md == "## Paired against kl.coef=0 (same seeds)\n\nNo finished runs to compare yet.\n"


def test_plot_of_every_run(tmp_path):
    runs = [_run(tmp_path, c, s, 0.6, 0.7, 0.5) for c in ("0", "0.1") for s in range(2)]
    path = plot_runs(build_table(runs), tmp_path / "runs.png")
    assert path.stat().st_size > 0


def test_sweep_baseline_end_to_end(fake_trainer, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "s"
    # The fake trainer: subtraction (the retention set) loses 100 * coef points; addition gains 10 + 10 * seed.
    assert sweep.main(["--grid", "kl.coef=0,0.2", "--seeds", "0,1", "--output-dir", str(out),
                       "--baseline", "kl.coef=0.2"]) == 0
    table = json.loads((out / "table.json").read_text())
    (row,) = table["paired"]["rows"]
    assert row["setting"] == "kl.coef=0" and row[RETENTION]["diffs"] == pytest.approx([20.0, 20.0])
    assert row["addition/change"]["diffs"] == pytest.approx([0.0, 0.0])
    md = (out / "table.md").read_text()
    assert "## Paired against kl.coef=0.2 (same seeds)" in md
    assert (out / sweep.RUNS_PLOT_FILE).stat().st_size > 0


def test_a_baseline_that_is_not_a_setting_is_refused_before_any_run(fake_trainer, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "s"
    assert sweep.main(["--grid", "kl.coef=0,0.2", "--output-dir", str(out), "--baseline", "kl.coef=0.0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("klgrpo sweep: error: --baseline kl.coef=0.0: not a setting of this sweep; the settings are "
                   "kl.coef=0, kl.coef=0.2")
    assert not out.exists()


def test_runs_train_seed_major_and_the_table_keeps_the_planned_order(fake_trainer, tmp_path):  # noqa: F811
    out = tmp_path / "s"
    lines = []
    runs = sweep.run_sweep(sweep.cells_of(sweep.parse_grid(["kl.coef=0,0.2"])), [0, 1], out, None, [],
                           log=lines.append)
    trained = [line.split("] ")[1].split(":")[0] for line in lines if line.startswith("  [")]
    assert trained == ["kl.coef=0 seed=0", "kl.coef=0.2 seed=0", "kl.coef=0 seed=1", "kl.coef=0.2 seed=1"]
    assert [(r.cell.name, r.seed) for r in runs] == [("kl.coef=0", 0), ("kl.coef=0", 1), ("kl.coef=0.2", 0),
                                                      ("kl.coef=0.2", 1)]


def test_float_noise_is_a_tie():
    # (15.2 - 8.7) / 2 and (13.0 - 6.5) / 2 from accuracies on 46 prompts agree but differ in the last bits
    a = (100 * (39 / 46 - 32 / 46) + 100 * (31 / 46 - 35 / 46)) / 2
    b = (100 * (38 / 46 - 32 / 46) + 100 * (32 / 46 - 35 / 46)) / 2
    assert sign_test([a - b, 0.0, 5.0])[:2] == (1, 0)
    assert sign_test([1e-12, -1e-12]) == (0, 0, 1.0)


def test_a_sweep_option_after_the_double_dash_is_refused_in_one_line(fake_trainer, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "s"
    code = sweep.main(["--grid", "kl.coef=0,0.2", "--output-dir", str(out), "--", "--train.steps", "2", "--dry-run"])
    assert code == 2 and not out.exists()
    assert capsys.readouterr().err.strip() == ("klgrpo sweep: error: --dry-run comes after --, where only the runs' "
                                               "train overrides go; it is an option of the sweep: put it before --")


def test_a_difference_that_rounds_to_zero_reads_plus_zero():
    from klgrpo.apps.sweep.paired import points

    assert [points(v) for v in (-0.04, -0.0, 0.04, -0.06, 2.25, -12.96)] == [
        "+0.0", "+0.0", "+0.0", "-0.1", "+2.2", "-13.0"]
