"""``klgrpo explain --run``: a klgrpo run's metrics.jsonl and a TRL output_dir's trainer_state.json, summarised with
the log's own numbers; the bands judged as the trainer's KL watch judges them; the plot; one-line refusals."""

from __future__ import annotations

import json
import statistics

import pytest

from klgrpo.apps.explain import main
from klgrpo.apps.explain.run_logs import band_windows
from klgrpo.run.kl_watch import KLWatch
from klgrpo.run.metrics import read_metrics
from klgrpo.run.trainer import GRPOTrainer
from tests.helpers.configs import make_config, quiet

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def klgrpo_run(tiny_model_dir, addition_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("explain_run") / "run"
    cfg = make_config(tiny_model_dir, addition_file, out, train={"steps": 4},
                      kl={"coef": 0.1, "controller": "adaptive", "target": 0.01, "warn_window": 2})
    GRPOTrainer(cfg, log=quiet).train()
    return out


def test_a_klgrpo_run_in_numbers_of_its_own_log(klgrpo_run, tmp_path, capsys):
    out, png = tmp_path / "run.json", tmp_path / "kl.png"
    assert main(["--run", str(klgrpo_run), "--json", str(out), "--plot", str(png)]) == 0
    summary = json.loads(out.read_text())
    rows = [r for r in read_metrics(klgrpo_run) if "adaptive_kl/raw_kl" in r]
    kl = [(r["step"], r["adaptive_kl/raw_kl"]) for r in rows]
    peak = max(kl, key=lambda p: p[1])
    assert summary["kind"] == "klgrpo" and summary["kl"]["metric"] == "adaptive_kl/raw_kl"
    assert summary["kl"]["first"] == {"step": kl[0][0], "value": kl[0][1]}
    assert summary["kl"]["last"] == {"step": kl[-1][0], "value": kl[-1][1]}
    assert summary["kl"]["max"] == {"step": peak[0], "value": peak[1]}
    assert summary["kl"]["median"] == statistics.median(v for _, v in kl)
    betas = [r["adaptive_kl/current_beta"] for r in rows]
    assert summary["beta"]["first"]["value"] == betas[0] and summary["beta"]["last"]["value"] == betas[-1]
    assert summary["beta"]["changes"] == sum(a != b for a, b in zip(betas, betas[1:]))
    assert summary["bands"]["window"] == 2 and summary["bands"]["warn_above"] == 0.2  # the run's config.yaml
    assert summary["config_verdict"]["source"] == "klgrpo"
    assert summary["config_verdict"]["config"]["kl"]["controller"] == "adaptive"
    assert png.read_bytes().startswith(PNG_MAGIC)
    printed = capsys.readouterr().out
    assert printed.startswith(f"{klgrpo_run}: klgrpo run") and "KL (adaptive_kl/raw_kl): first " in printed
    assert "beta (adaptive_kl/current_beta): from 0.1 to " in printed and f"{klgrpo_run}/config.yaml: klgrpo" in printed
    assert "shorter than one warning window" not in printed  # 4 logged steps fill two windows of 2


def test_the_bands_can_be_overridden(klgrpo_run, tmp_path):
    out = tmp_path / "run.json"
    assert main(["--run", str(klgrpo_run), "--json", str(out), "--warn-above", "0", "--warn-below", "1e9"]) == 0
    windows = json.loads(out.read_text())["bands"]["windows"]
    assert [w["band"] for w in windows] == ["not_learning"]  # every window but the first is below 1e9
    assert (windows[0]["first_step"], windows[0]["last_step"]) == (3, 4)


def _trl_state(folder, history):
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": history[-1]["step"],
                                                           "log_history": history}))
    (folder / "training_args.bin").write_bytes(b"\x80\x04 a pickle that must never be read")


TRL_HISTORY = [
    {"step": 1, "loss": 0.1, "kl": 0.0, "reward": 0.25, "entropy": 1.9, "clip_ratio/region_mean": 0.0},
    {"step": 2, "loss": 0.1, "kl": 0.5, "reward": 0.5, "entropy": 1.8, "clip_ratio/region_mean": 0.01},
    {"step": 3, "loss": 0.1, "kl": 0.75, "reward": 0.5, "entropy": 1.7, "clip_ratio/region_mean": 0.02},
    {"step": 4, "loss": 0.1, "kl": 1.25, "reward": 0.75, "entropy": 1.6, "clip_ratio/region_mean": 0.0},
    {"step": 4, "train_runtime": 12.5, "train_loss": 0.1},
]


def test_a_trl_output_dir_reads_the_newest_checkpoint(tmp_path, capsys):
    _trl_state(tmp_path / "out" / "checkpoint-2", TRL_HISTORY[:2])
    _trl_state(tmp_path / "out" / "checkpoint-4", TRL_HISTORY)
    out = tmp_path / "run.json"
    assert main(["--run", str(tmp_path / "out"), "--json", str(out), "--warn-above", "0.3"]) == 0
    summary = json.loads(out.read_text())
    assert summary["kind"] == "trl" and summary["log"].endswith("checkpoint-4/trainer_state.json")
    assert summary["kl"]["first"] == {"step": 1, "value": 0.0}
    assert summary["kl"]["max"] == {"step": 4, "value": 1.25} and summary["kl"]["median"] == 0.625
    assert summary["reward"]["last"] == {"step": 4, "value": 0.75} and summary["beta"] is None
    # windows of 20 (klgrpo's default) do not fill with 4 steps: none judged
    assert summary["bands"]["windows"] == []
    printed = capsys.readouterr().out
    assert "the run is shorter than one warning window (4 logged KL values, a window is 20): no band judged" in printed
    assert "training_args.bin is a pickle and is not read: pass --config FILE" in printed
    assert "beta is not logged: TRL's beta is fixed at GRPOConfig.beta" in printed


def test_a_trl_run_with_its_config_and_windows(tmp_path, capsys):
    _trl_state(tmp_path / "checkpoint-4", TRL_HISTORY)
    config = tmp_path / "trl.yaml"
    config.write_text("beta: 0.04\nuse_bias_correction_kl: false\n")
    out = tmp_path / "run.json"
    assert main(["--run", str(tmp_path / "checkpoint-4"), "--config", str(config), "--json", str(out),
                 "--warn-above", "0.3", "--warn-below", "0.1"]) == 0
    summary = json.loads(out.read_text())
    assert summary["config_verdict"]["gradient"]["token_on_policy"] == "forward"
    # windows of 20 steps: too few; the hand check below uses windows of 2 on the same points
    points = [(r["step"], r["kl"]) for r in TRL_HISTORY if "kl" in r]
    assert band_windows(points, 0.3, 0.1, 2) == [{"band": "drifting", "first_step": 3, "last_step": 4,
                                                  "mean": 1.0}]
    assert "KL gradient: token forward" in capsys.readouterr().out


def test_the_bands_are_the_kl_watchs():
    """Each band the KL watch announces begins at a window that band_windows lists."""
    points = [(s, v) for s, v in enumerate([0.0, 0.3, 0.5, 0.6, 0.001, 0.002, 0.4, 0.9, 0.95, 0.001], 1)]
    windows = band_windows(points, 0.3, 0.01, 2)
    # window means 0.15, 0.55 (above 0.3 and rising), 0.0015 (below 0.01), 0.65 (rising), 0.4755 (falling)
    assert [(w["band"], w["last_step"]) for w in windows] == [("drifting", 4), ("not_learning", 6), ("drifting", 8)]
    watch, announced = KLWatch(0.3, 0.01, 2), []
    for step, value in points:
        announced += [(line, step) for line in watch.observe(step, value)]
    listed = {w["last_step"] for w in windows}
    assert announced and all(step in listed for _, step in announced)


@pytest.mark.parametrize("setup, message", [
    (lambda p: None, "is not a folder"),
    (lambda p: p.mkdir(), "holds neither metrics.jsonl"),
    (lambda p: (p.mkdir(), (p / "trainer_state.json").write_bytes(b"\x00\xff" * 10)), "is not valid JSON"),
    (lambda p: (p.mkdir(), (p / "trainer_state.json").write_text('{"log_history": 3}')), "has no log_history"),
    (lambda p: (p.mkdir(), (p / "metrics.jsonl").write_bytes(b"\xff\xfe\x00" * 10)), "metrics.jsonl"),
    (lambda p: _trl_state(p, [{"step": 1, "loss": 0.3}]), "logs no KL"),
])
def test_bad_run_folders_are_one_line(tmp_path, capsys, setup, message):
    folder = tmp_path / "run"
    setup(folder)
    assert main(["--run", str(folder), "--plot", str(tmp_path / "p.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "p.png").exists()
