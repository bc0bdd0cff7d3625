"""klgrpo report: plots, the summary table (hand-checked numbers) and the command's error path."""

from __future__ import annotations

import json
from pathlib import Path

from klgrpo.apps.cli import main as cli_main
from klgrpo.apps.report import main
from klgrpo.run.report import make_plots, summary_table

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_rows(run_dir: Path, rows: list[dict]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    with (run_dir / "metrics.jsonl").open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def full_run(run_dir: Path, steps: int = 60) -> None:
    rows = []
    for s in range(1, steps + 1):
        row = {"step": s, "wall_time": 0.1 * s, "train/reward": s / steps, "rewards/exact": s / steps,
               "rewards/format": 1.0, "adaptive_kl/raw_kl": 0.001 * s, "adaptive_kl/adapted_kl": 0.0009 * s,
               "kl/k1": 0.001 * s, "kl/k2": 0.0011 * s, "kl/k3": 0.001 * s, "adaptive_kl/current_beta": 0.04,
               "completions/mean_length": 3.0, "completions/max_length": 4.0, "completions/clipped_ratio": 0.1}
        if s == 30:
            row["kl/k3"] = "NaN"
        rows.append(row)
        if s % 20 == 0:
            rows.append({"step": s, "wall_time": 0.1 * s, "eval/add": s / 100, "eval/sub": 0.5})
    write_rows(run_dir, rows)


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 5000, path


def test_make_plots_writes_the_four_pngs(tmp_path):
    full_run(tmp_path)
    paths = make_plots(tmp_path)
    assert [p.name for p in paths] == ["reward.png", "kl.png", "beta.png", "length.png"]
    for p in paths:
        assert p.parent == tmp_path / "plots"
        assert_png(p)


def test_make_plots_skips_plots_whose_metrics_are_absent(tmp_path):
    write_rows(tmp_path, [{"step": s, "wall_time": s, "adaptive_kl/current_beta": 0.04 + 0.001 * s}
                          for s in range(1, 6)])
    paths = make_plots(tmp_path)
    assert [p.name for p in paths] == ["beta.png"]
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["beta.png"]
    assert_png(paths[0])

    other = tmp_path / "nothing_plotted"
    write_rows(other, [{"step": 1, "wall_time": 0.1, "grad_norm": 1.0}])
    assert make_plots(other) == []
    assert not (other / "plots").exists()


def table_rows(text: str) -> dict[str, list[str]]:
    return {line.split()[0]: line.split()[1:] for line in text.splitlines()
            if line.split() and "/" in line.split()[0] and not line.startswith(" ")}


def test_summary_table_numbers_by_hand(tmp_path):
    rows = []
    for s in range(1, 21):
        # train/reward = s: first 1, last 20, min 1, max 20; last 10% of 20 values = steps 19, 20 -> 19.5
        # adaptive_kl/raw_kl = 0.5 * s except NaN at step 20: last 10% = steps 19 (9.5) and 20 (NaN) -> 9.5;
        #   max over finite values = 9.5 (step 19), last shows nan
        row = {"step": s, "wall_time": s, "train/reward": float(s),
               "adaptive_kl/raw_kl": "NaN" if s == 20 else 0.5 * s}
        if s in (10, 20):
            row["eval/add"] = 0.25 if s == 10 else 0.75  # n = 2, last 10% = ceil(0.2) = 1 value -> 0.75
        rows.append(row)
    write_rows(tmp_path, rows)
    (tmp_path / "summary.json").write_text(json.dumps({"accuracy_before": 0.125, "accuracy_after": 0.5,
                                                        "steps": 20}))
    text = summary_table(tmp_path)
    table = table_rows(text)
    assert table["train/reward"] == ["20", "1", "20", "1", "20", "19.5"]
    assert table["adaptive_kl/raw_kl"] == ["20", "0.5", "nan", "0.5", "9.5", "9.5"]
    assert table["eval/add"] == ["2", "0.25", "0.75", "0.25", "0.75", "0.75"]
    assert "adaptive_kl/raw_kl: 1 non-finite value(s), first at step 20" in text
    assert "20 rows, last step 20" in text
    summary = text.split("summary.json:")[1].split()
    assert summary == ["accuracy_before", "0.125", "accuracy_after", "0.5", "steps", "20"]


def test_main_prints_table_and_plot_paths(tmp_path, capsys):
    full_run(tmp_path)
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "train/reward" in out and str(tmp_path / "plots" / "kl.png") in out


def test_main_no_plots_leaves_plots_alone(tmp_path, capsys):
    full_run(tmp_path)
    assert cli_main(["report", str(tmp_path), "--no-plots"]) == 0
    assert not (tmp_path / "plots").exists()
    assert "train/reward" in capsys.readouterr().out


def test_main_error_paths_print_one_line_and_return_2(tmp_path, capsys):
    missing = tmp_path / "no_such_run"
    assert main([str(missing)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and str(missing) in lines[0] and "metrics.jsonl" in lines[0]

    empty = tmp_path / "empty_run"
    empty.mkdir()
    assert main([str(empty)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and str(empty / "metrics.jsonl") in lines[0] and "run folder holds" in lines[0]

    corrupt = tmp_path / "corrupt_run"
    corrupt.mkdir()
    (corrupt / "metrics.jsonl").write_text('{"step": 1}\n{oops\n{"step": 3}\n')
    assert main([str(corrupt)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "line 2" in lines[0] and "Traceback" not in lines[0]

    binary = tmp_path / "binary_run"
    binary.mkdir()
    (binary / "metrics.jsonl").write_bytes(b'{"step": 1}\n{"step": 2}\n\x89PNG\xff\xfe\x00\n')
    before = (binary / "metrics.jsonl").read_bytes()
    assert main([str(binary)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "metrics.jsonl, line 3: not UTF-8 text" in lines[0], lines
    assert (binary / "metrics.jsonl").read_bytes() == before and sorted(binary.iterdir()) == [binary / "metrics.jsonl"]


def test_kl_plot_target_line_comes_from_the_run_config(tmp_path):
    from klgrpo.run.report import _controller_target

    (tmp_path / "config.yaml").write_text("kl:\n  controller: adaptive\n  target: 0.07\n  kl_measure: token_mean\n")
    assert _controller_target(tmp_path) == 0.07
    (tmp_path / "config.yaml").write_text("kl:\n  controller: fixed\n  target: 0.07\n")
    assert _controller_target(tmp_path) is None
    (tmp_path / "config.yaml").write_text("kl:\n  controller: dual\n  target: 3.0\n  kl_measure: sequence_sum\n")
    assert _controller_target(tmp_path) is None  # a sequence-sum target is not on the per-token axis


def test_kl_plot_keeps_coinciding_curves_visible():
    """raw = adapted (no shaping) and raw = k3 (k3 estimators) coincide: each keeps a style no other curve in
    its panel has, and the monitors sit in a panel of their own."""
    from klgrpo.run.report import PlotContext, _kl_plot

    rows = [{"step": s, "adaptive_kl/raw_kl": 0.01 * s, "adaptive_kl/adapted_kl": 0.01 * s, "kl/k1": 0.01 * s,
             "kl/k2": 0.01 * s, "kl/k3": 0.01 * s} for s in range(1, 61)]
    fig = _kl_plot(rows, set(rows[0]) - {"step"}, PlotContext(kl_target=0.1))
    top, bottom = fig.axes
    def styles(ax):
        return {line.get_label().split(" ")[0]: (line.get_linestyle(), line.get_linewidth())
                for line in ax.get_lines() if not line.get_label().startswith("_")}

    assert set(styles(top)) == {"adaptive_kl/raw_kl", "adaptive_kl/adapted_kl", "controller"}
    assert set(styles(bottom)) == {"kl/k1", "kl/k2", "kl/k3"}
    for ax in (top, bottom):
        drawn = [v for k, v in styles(ax).items() if k != "controller"]
        assert len(set(drawn)) == len(drawn), drawn  # no two curves drawn alike


def test_main_on_a_folder_it_cannot_write_prints_the_table_and_one_line(tmp_path, capsys):
    """A run folder where plots/ cannot be written (here a file is in its place; a read-only folder fails the
    same way, with an OSError): the table is printed, then one line names the folder and --no-plots."""
    full_run(tmp_path)
    (tmp_path / "plots").write_text("not a folder")
    assert main([str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert "train/reward" in captured.out
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and str(tmp_path / "plots") in lines[0] and "--no-plots" in lines[0], captured.err


def test_the_sampler_panel_is_drawn_with_its_warning_bands(tmp_path):
    """A run with the sampler panel gets plots/sampler.png; its bands come from the run's config.yaml."""
    rows = [{"step": s, "wall_time": 0.1 * s, "sampler/kl_k1": 1e-3 * s, "sampler/kl_k3": 1e-3 * s,
             "sampler/chi2_token": 0.01 * s, "sampler/chi2_seq": 0.05 * s, "sampler/ess": 1 - 0.02 * s,
             "sampler/masked_token_frac": 0.0, "sampler/masked_seq_frac": 0.0,
             "sampler/q1/chi2_token": 0.005 * s, "sampler/q4/chi2_token": 0.02 * s} for s in range(1, 21)]
    write_rows(tmp_path, rows)
    (tmp_path / "config.yaml").write_text("rollout:\n  warn_ess_below: 0.7\n  warn_chi2_above: 0.15\n")
    paths = make_plots(tmp_path)
    assert [p.name for p in paths] == ["sampler.png"]
    assert_png(paths[0])
    from klgrpo.run.report import _sampler_bands

    assert _sampler_bands(tmp_path) == {"warn_ess_below": 0.7, "warn_chi2_above": 0.15}
    (tmp_path / "config.yaml").write_text("rollout: [unclosed\n")  # a damaged config: the plot without bands
    assert _sampler_bands(tmp_path) == {} and [p.name for p in make_plots(tmp_path)] == ["sampler.png"]
