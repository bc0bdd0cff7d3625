"""kl.on_runaway on a planted runaway, and the adaptive controller's reach line.

The planted runaway: the tiny model at lr 0.05 (five times the trainer tests' 1e-2) with beta 0.01. Without a
guard its per-token KL goes 0, 0.10, 0.35, 0.72, 1.67, ... (measured): the window of steps 3-4 has mean 0.535, above
kl.runaway_above 0.5 and above the first window's 0.05. Windows of 2 steps; the first window (steps 1-2) is
healthy, so the target is its start, step 0.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers.configs import make_config, quiet

from klgrpo.math.kl_control import horizon_to_reach
from klgrpo.run.runaway import KLReach
from klgrpo.run.trainer import GRPOTrainer

PLANTED = {"coef": 0.01, "warn_window": 2, "runaway_above": 0.5, "runaway_lr_factor": 0.1}
STEPS = 6


def _config(model, data, out, **kl):
    return make_config(model, data, out, train={"steps": STEPS}, optim={"lr": 0.05}, kl={**PLANTED, **kl})


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _weights(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


@pytest.fixture(scope="module")
def rolled_back(tiny_model_dir, addition_file, tmp_path_factory):
    from klgrpo.run.metrics import MetricsLogger

    out = tmp_path_factory.mktemp("rollback") / "run"
    said = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(MetricsLogger, "message", lambda self, text: said.append(("console", text)))
        patch.setattr(MetricsLogger, "text", lambda self, name, text, step: said.append((name, text, step)))
        GRPOTrainer(_config(tiny_model_dir, addition_file, out, on_runaway="rollback"), log=quiet).train()
    return out, json.loads((out / "summary.json").read_text()), said


def test_a_planted_runaway_is_caught_within_one_window_rolled_back_and_training_goes_on_below_it(rolled_back):
    out, summary, _ = rolled_back
    runaway = summary["runaway"]
    assert runaway["rollbacks"] == 1 and runaway["target_store"] == "memory"
    action = runaway["actions"][0]
    # caught at the end of the first window that ran away (steps 3-4), back to the start of the healthy one
    assert (action["action"], action["step"], action["to_step"]) == ("rolled_back", 4, 0)
    assert 0.5 < action["kl"] < 0.6
    assert action["beta"] == pytest.approx(0.02, rel=1e-12)  # 0.01 x 2
    assert action["base_lr"] == pytest.approx(0.005, rel=1e-12)  # 0.05 x 0.1
    rows = [r for r in _rows(out) if "adaptive_kl/raw_kl" in r]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # the undone steps' rows are gone
    assert max(r["adaptive_kl/raw_kl"] for r in rows) < 0.5
    assert summary["steps"] == STEPS and summary["final_beta"] == pytest.approx(0.02, rel=1e-12)


def test_each_action_is_one_console_line_and_a_tracker_text_entry(rolled_back):
    _, _, said = rolled_back
    console = [text for where, text, *_ in said if where == "console" and text.startswith("KL runaway")]
    tracker = [entry for entry in said if entry[0] == "warnings/kl_runaway"]
    assert len(console) == 1 and "rolled back to step 0" in console[0] and "kept in memory" in console[0]
    assert tracker == [("warnings/kl_runaway", console[0], 4)]
    docs = " ".join((Path(__file__).resolve().parents[1] / "docs" / "metrics.md").read_text().split())
    assert f"`{console[0]}`" in docs  # the line docs/metrics.md quotes is this run's
    assert any(where == "console" and text.startswith("kl.on_runaway rollback: the start of the last healthy "
                                                      "window is kept in memory") for where, text, *_ in said)


def test_stop_ends_the_run_at_the_runaway_and_names_a_loadable_checkpoint(tiny_model_dir, addition_file, tmp_path):
    from klgrpo.store.checkpoint import load_trainer_state, verify_checksums

    out = tmp_path / "run"
    GRPOTrainer(_config(tiny_model_dir, addition_file, out, on_runaway="stop"), log=quiet).train()
    summary = json.loads((out / "summary.json").read_text())
    named = out / "checkpoints" / "step_0"
    assert summary["steps"] == 4 and f"checkpoint {named} (step 0)" in summary["stopped_early"]
    assert summary["runaway"]["actions"][0]["checkpoint"] == str(named)
    verify_checksums(named)
    assert load_trainer_state(named)["step"] == 0
    # the start of the healthy window is the untrained policy, and a new run trains on from its weights
    cfg = _config(named, addition_file, tmp_path / "next", coef=0.1, reference=str(tiny_model_dir))
    cfg.optim.lr, cfg.train.steps = 1e-2, 1
    assert GRPOTrainer(cfg, log=quiet).train()["steps"] == 1


def test_klgrpo_train_exits_3_when_it_stopped_on_a_runaway_and_0_when_it_rolled_back(tiny_model_dir, addition_file,
                                                                                   tmp_path, capsys):
    """A script tells "stopped on a runaway" from "finished": `klgrpo train && klgrpo eval` goes on only after the
    latter. A rollback that trained to the end is a finished run."""
    from klgrpo.apps.cli import main
    from klgrpo.apps.train import RUNAWAY_STOP_EXIT
    from klgrpo.store.checkpoint import load_trainer_state

    codes, said = {}, {}
    for action in ("stop", "rollback"):
        config = tmp_path / f"{action}.yaml"
        config.write_text(_config(tiny_model_dir, addition_file, tmp_path / action, on_runaway=action).to_yaml())
        codes[action] = main(["train", "--config", str(config)])  # the `klgrpo` entry point
        said[action] = capsys.readouterr()
    assert codes == {"stop": RUNAWAY_STOP_EXIT, "rollback": 0} and RUNAWAY_STOP_EXIT == 3
    named = tmp_path / "stop" / "checkpoints" / "step_0"
    stopped = [line.strip() for line in said["stop"].out.splitlines() if line.strip().startswith("stopped early:")]
    assert len(stopped) == 1 and "kl.on_runaway stop" in stopped[0], said["stop"].out
    assert f"checkpoint {named} (step 0): train on from its weights (model.name_or_path {named}" in stopped[0]
    assert said["stop"].err.count("error") == 0 and load_trainer_state(named)["step"] == 0  # loadable
    # the guard's whole sentence (what it saw and what to do) is printed once; the summary names the checkpoint
    said_all = said["stop"].out + said["stop"].err
    assert said_all.count("kl.on_runaway stop: the last healthy window started") == 1, said_all
    assert not any("stopped early" in line for line in said["rollback"].out.splitlines())


def test_the_reach_line_on_a_known_kl_trace():
    # window 2, target 0.08: band [0.04, 0.12]; trace 0, 0.05 | 0.3, 0.5 | 0.4, 0.6 -> window means 0.025, 0.4, 0.5
    reach = KLReach(target=0.08, window=2)
    for step, kl in enumerate([0.0, 0.05, 0.3, 0.5, 0.4, 0.6], start=1):
        reach.observe(step, kl)
    r = reach.summary(beta_start=0.01, beta_now=0.02, updates=6, horizon=32.0, batch=16)
    assert (r["reached"], r["first_step_in_band"], r["last_window_kl"]) == (False, None, pytest.approx(0.5))
    # beta had to move by 0.02 / 0.01 x 0.5 / 0.08 = 12.5 in 6 updates: 12.5^(1/6) = 1.52342, so
    # H = 0.2 x 16 / 0.52342 = 6.1136
    assert r["horizon_to_reach"] == pytest.approx(6.1136, abs=1e-4)
    assert " ".join(r["line"].split("; a kl.horizon")[0].split()) in " ".join(
        (Path(__file__).resolve().parents[1] / "docs" / "metrics.md").read_text().split())  # the line it quotes
    assert r["line"] == ("KL reach: the KL ended outside its band [0.04, 0.12] (kl.target 0.08) at 0.5 (mean of "
                         "steps 5-6), never in the band; a kl.horizon of about 6.11 (this run's 32) would have brought "
                         "it to the target in these 6 updates (estimate: KL ~ 1/beta, the controller's error "
                         "saturated)")
    # a trace that settles: 0.02, 0.06 | 0.1, 0.08 -> means 0.04 (in the band at its edge), 0.09
    settled = KLReach(target=0.08, window=2)
    for step, kl in enumerate([0.02, 0.06, 0.1, 0.08], start=1):
        settled.observe(step, kl)
    r = settled.summary(beta_start=0.01, beta_now=0.02, updates=6, horizon=32.0, batch=16)
    assert (r["reached"], r["first_step_in_band"], r["horizon_to_reach"]) == (True, 2, None)
    assert math.isclose(horizon_to_reach(0.01, 0.01, 4, 0.08, 0.08, 16) or 0.0, 0.0)  # nothing to move: None


def test_the_summary_has_the_reach_of_an_adaptive_run(tiny_model_dir, addition_file, tmp_path):
    out = tmp_path / "run"
    cfg = make_config(tiny_model_dir, addition_file, out, train={"steps": 4}, optim={"lr": 0.05},
                      kl={"coef": 0.01, "controller": "adaptive", "target": 0.08, "horizon": "auto",
                          "warn_window": 2})
    GRPOTrainer(cfg, log=quiet).train()
    summary = json.loads((out / "summary.json").read_text())
    kl = [r["adaptive_kl/raw_kl"] for r in _rows(out) if "adaptive_kl/raw_kl" in r]
    reach = summary["kl_reach"]
    assert reach["last_window_kl"] == pytest.approx((kl[2] + kl[3]) / 2, rel=1e-12)
    # 4 steps of 16 sequences: 10^(4/4) - 1 = 9 per update is above the 0.5 cap, so H = 0.2 x 16 / 0.5 = 6.4
    assert reach["horizon"] == pytest.approx(6.4, rel=1e-12)
    assert reach["reached"] == (0.04 <= reach["last_window_kl"] <= 0.12)


ROLLBACK_KILLS = [(point, "memory") for point in ("before_restore", "after_restore", "inside_save", "after_save",
                                                  "between_removals", "after_removals")] + [
    (point, "disk") for point in ("before_restore", "inside_save", "after_save", "between_removals")]


@pytest.mark.slow
@pytest.mark.parametrize("where,store", ROLLBACK_KILLS)
def test_a_kill_anywhere_in_a_rollback_resumes_from_a_checkpoint_to_the_run_never_killed(
        rolled_back, tiny_model_dir, addition_file, tmp_path, monkeypatch, where, store):
    """SIGKILLed at a point of a rollback (tests/helpers/rollback_kill.py), the run folder still holds a checkpoint
    (--resume latest, not a fresh start), and the resumed run ends with the uninterrupted run's weights, bit for
    bit, after the same one rollback, leaving nothing but checkpoints behind. A rollback that deleted the undone
    checkpoints before its own was in place left none."""
    import subprocess
    import sys

    from klgrpo.run import runaway
    from klgrpo.store.checkpoint import list_checkpoints

    uninterrupted, summary, _ = rolled_back
    out = tmp_path / "run"
    cfg = _config(tiny_model_dir, addition_file, out, on_runaway="rollback")
    if store == "disk":  # no memory to spare, in the killed process and the resumed one
        cfg.train.keep_checkpoints = 1
        monkeypatch.setattr(runaway, "available_memory", lambda: 0)
    config = tmp_path / "config.yaml"
    config.write_text(cfg.to_yaml())
    tests = Path(__file__).resolve().parent
    killed = subprocess.run([sys.executable, "-m", "helpers.rollback_kill", str(config), where,
                             *(["disk"] if store == "disk" else [])], cwd=tests, capture_output=True, text=True,
                            timeout=300)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert list_checkpoints(out), f"killed {where}: no checkpoint left"
    GRPOTrainer(cfg, log=quiet).train(resume="latest")
    again = json.loads((out / "summary.json").read_text())["runaway"]
    assert again["rollbacks"] == summary["runaway"]["rollbacks"] == 1
    assert again["target_store"] == store
    assert [a["to_step"] for a in again["actions"]] == [0]
    expected, got = _weights(uninterrupted / "checkpoints" / f"step_{STEPS}"), _weights(out / "checkpoints" /
                                                                                      f"step_{STEPS}")
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    leftovers = [p.name for p in (out / "checkpoints").iterdir() if not p.name.startswith("step_")]
    assert leftovers == [], leftovers


@pytest.mark.slow
def test_a_target_on_disk_rolls_back_to_the_same_run_as_one_in_memory(rolled_back, tiny_model_dir, addition_file,
                                                                      tmp_path, monkeypatch):
    """No memory to spare: the kept states are checkpoints (never pruned while kept), and the run is the same."""
    from klgrpo.run import runaway

    in_memory, summary, _ = rolled_back
    monkeypatch.setattr(runaway, "available_memory", lambda: 0)
    out = tmp_path / "run"
    cfg = _config(tiny_model_dir, addition_file, out, on_runaway="rollback")
    cfg.train.keep_checkpoints = 1
    GRPOTrainer(cfg, log=quiet).train()
    on_disk = json.loads((out / "summary.json").read_text())["runaway"]
    assert on_disk["target_store"] == "disk"
    assert [a["to_step"] for a in on_disk["actions"]] == [a["to_step"] for a in summary["runaway"]["actions"]]
    expected, got = (_weights(folder / "checkpoints" / f"step_{STEPS}") for folder in (in_memory, out))
    assert all(torch.equal(expected[k], got[k]) for k in expected)
