"""Nothing lost, nothing executed that was not asked for: run folders, locks, non-finite steps, state files
without pickle, corrupt checkpoints, full disks, orphans, SIGTERM, float notation, sweep identity, memory."""

from __future__ import annotations

import errno
import json
import math
import os
import pickle
import signal
import subprocess
import sys

import pytest
import torch
from helpers.checkpoints import strip_checksums
from helpers.configs import make_config, quiet

from klgrpo.errors import ConfigError, KLGRPOError, KLGRPOWarning
from klgrpo.run.metrics import read_metrics
from klgrpo.run.trainer import GRPOTrainer

FAST = {"logging": {"progress": False, "tensorboard": False, "plots": False}}


def _cli(args, capsys):
    from klgrpo.apps.cli import main

    code = main(["train", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _base_args(model, data, out, *extra):
    return ["--model.name_or_path", str(model), "--data.source", str(data), "--output-dir", str(out),
            "--rollout.group_size", "4", "--rollout.prompts_per_step", "4", "--rollout.max_new_tokens", "4",
            "--rewards.functions", "[{name: format, kwargs: {pattern: '0'}}]", "--optim.lr", "1e-2",
            "--train.steps", "2", "--logging.progress", "false", "--logging.tensorboard", "false",
            "--logging.plots", "false", *extra]


def _weights(run_dir, step):
    from safetensors.torch import load_file

    return load_file(str(run_dir / "checkpoints" / f"step_{step}" / "model.safetensors"))


# ------------------------------------------------------------------------------------- 1. run folders
def test_fresh_run_into_a_run_folder_is_refused_and_overwrite_replaces_it(tiny_model_dir, addition_file,
                                                                          tmp_path, capsys):
    out = tmp_path / "run"
    assert _cli(_base_args(tiny_model_dir, addition_file, out), capsys)[0] == 0
    before = {p.name: p.read_bytes() for p in [out / "config.yaml", out / "metrics.jsonl", out / "summary.json"]}
    code, _, err = _cli(_base_args(tiny_model_dir, addition_file, out, "--train.seed", "1"), capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "already holds a run" in err and "--resume" in err and "--output-dir" in err and "--overwrite" in err
    assert {n: (out / n).read_bytes() for n in before} == before  # nothing touched
    (out / "notes.txt").write_text("mine")
    code, _, _ = _cli(_base_args(tiny_model_dir, addition_file, out, "--train.seed", "1", "--train.steps", "1",
                                 "--overwrite"), capsys)
    assert code == 0
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_1"]  # the old step_2 went with the old run
    assert len(read_metrics(out)) == 1 and (out / "notes.txt").read_text() == "mine"  # user files stay


FLAKY_REWARD = """
import pathlib
CALLS = pathlib.Path(__file__).with_name("calls.txt")

def flaky(prompts, completions, **kw):
    n = int(CALLS.read_text()) if CALLS.exists() else 0
    CALLS.write_text(str(n + 1))
    if n == 1:
        raise ValueError("the grader went away")
    return [float("0" in c) for c in completions]
"""


def test_run_that_failed_before_its_first_checkpoint_names_only_remedies_that_work(tiny_model_dir, addition_file,
                                                                                    tmp_path, capsys):
    """A run that fails at step 2 (its reward raises) leaves step 1's metrics row and no checkpoint: the next fresh
    run is refused without the impossible --resume latest, and --overwrite (the remedy it names) works."""
    reward = tmp_path / "flaky_reward.py"
    reward.write_text(FLAKY_REWARD)
    out = tmp_path / "run"
    args = _base_args(tiny_model_dir, addition_file, out, "--rewards.functions", f"[{{name: '{reward}:flaky'}}]")
    code, _, err = _cli(args, capsys)
    assert code == 2 and "the grader went away" in err
    assert [r["step"] for r in read_metrics(out)] == [1] and not (out / "checkpoints").exists()
    code, _, err = _cli(args, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "stopped before its first checkpoint" in err and "--overwrite" in err and "--output-dir" in err
    assert "--resume" not in err
    code, _, err = _cli([*args, "--overwrite"], capsys)  # the grader works again after its second call
    assert code == 0, err
    assert [r["step"] for r in read_metrics(out) if "train/loss" in r] == [1, 2]


def test_resume_without_config_uses_the_run_folder_config(tiny_model_dir, addition_file, tmp_path, capsys):
    out = tmp_path / "run"
    args = _base_args(tiny_model_dir, addition_file, out, "--train.save_every", "1")
    assert _cli(args, capsys)[0] == 0
    saved = (out / "config.yaml").read_text()
    code, _, err = _cli(["--output-dir", str(out), "--resume", "latest", "--train.steps", "3"], capsys)
    assert code == 0, err
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]
    assert "train.steps 2 -> 3" in (out / "config.yaml").read_text() or "steps: 3" in (out / "config.yaml").read_text()
    assert saved != (out / "config.yaml").read_text()


def test_resume_with_a_changed_exactness_field_is_refused(tiny_model_dir, addition_file, tmp_path, capsys):
    out = tmp_path / "run"
    assert _cli(_base_args(tiny_model_dir, addition_file, out), capsys)[0] == 0
    saved = (out / "config.yaml").read_bytes()
    for field, value in [("rollout.group_size", "8"), ("train.seed", "3"), ("rollout.prompts_per_step", "2")]:
        code, _, err = _cli(_base_args(tiny_model_dir, addition_file, out, "--resume", "latest",
                                       f"--{field}", value), capsys)
        assert code == 2 and field in err and "--output-dir" in err and len(err.strip().splitlines()) == 1
    assert (out / "config.yaml").read_bytes() == saved


def test_extending_a_finished_cosine_run_warns():
    from klgrpo.config.schema import GRPOConfig
    from klgrpo.store.run_folder import compare_configs

    old = GRPOConfig.from_dict({"optim": {"schedule": "cosine"}, "train": {"steps": 10}})
    new = old.override({"train.steps": 20})
    warnings = compare_configs(old.to_dict(), new.to_dict(), "run")
    assert any("train.steps 10 -> 20" in w for w in warnings)
    assert any("optim.schedule=cosine" in w and "rises again" in w for w in warnings)
    assert compare_configs(old.to_dict(), old.to_dict(), "run") == []


def test_lock_refuses_a_live_writer_and_takes_over_a_dead_one(tmp_path):
    import socket

    from klgrpo.config.schema import GRPOConfig
    from klgrpo.store.run_folder import LOCK_FILE, RunLock, check_run_folder

    run = tmp_path / "run"
    run.mkdir()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (run / LOCK_FILE).write_text(json.dumps({"pid": live.pid, "host": socket.gethostname()}))
        with pytest.raises(ConfigError, match=f"PID {live.pid}"):
            RunLock(run).acquire()
        with pytest.raises(ConfigError, match="being written by another klgrpo run"):
            check_run_folder(run, GRPOConfig(), None)
    finally:
        live.kill()
        live.wait()
    # The same PID is now dead: its lock is stale and taken over.
    lock = RunLock(run).acquire()
    assert json.loads((run / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (run / LOCK_FILE).exists()


def test_a_second_trainer_in_the_same_process_is_refused(tiny_model_dir, addition_file, tmp_path):
    """Trainer A runs in a thread (held inside its first step); trainer B of the same process on the same folder
    is refused, without touching A's lock. Once A is done, the folder is free again."""
    import threading

    from klgrpo.store.run_folder import LOCK_FILE

    run = tmp_path / "run"
    first = GRPOTrainer(make_config(tiny_model_dir, addition_file, run, train={"steps": 1}), log=quiet)
    second = GRPOTrainer(make_config(tiny_model_dir, addition_file, run, train={"steps": 2}), log=quiet)
    inside, release, results = threading.Event(), threading.Event(), []
    step = first.run.train_step

    def held_step():
        inside.set()
        release.wait(120)
        return step()

    first.run.train_step = held_step
    thread = threading.Thread(target=lambda: results.append(first.train()))
    thread.start()
    try:
        assert inside.wait(120)
        lock = (run / LOCK_FILE).read_text()
        with pytest.raises(ConfigError, match="being written by another trainer in this process"):
            second.train(resume="latest")
        assert (run / LOCK_FILE).read_text() == lock  # A's lock untouched
    finally:
        release.set()
        thread.join(120)
    assert results and results[0]["steps"] == 1 and not (run / LOCK_FILE).exists()
    assert second.train(resume="latest")["steps"] == 2  # free again


def test_resume_auto_continues_a_checkpoint_restarts_an_unsaved_start_and_starts_fresh(tiny_model_dir, addition_file,
                                                                                        tmp_path, capsys):
    """--resume auto: a fresh folder starts a run; a folder with a checkpoint continues from it; the beginning
    of the same run killed before its first checkpoint starts again; another run's beginning is refused."""
    from klgrpo.apps.args import parse_args
    from klgrpo.store.run_folder import resolve_auto_resume

    out = tmp_path / "run"
    cfg = parse_args(_base_args(tiny_model_dir, addition_file, out))[0]
    assert resolve_auto_resume(out, cfg) == (None, False)
    code, _, err = _cli(_base_args(tiny_model_dir, addition_file, out, "--resume", "auto"), capsys)
    assert code == 0, err
    assert resolve_auto_resume(out, cfg) == ("latest", False)
    code, _, err = _cli(_base_args(tiny_model_dir, addition_file, out, "--resume", "auto", "--train.steps", "3"),
                        capsys)
    assert code == 0, err
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]
    # Killed after logging step 1, before any checkpoint: the same config starts again from step 0.
    import shutil

    shutil.rmtree(out / "checkpoints")
    (out / "summary.json").unlink()
    assert resolve_auto_resume(out, cfg.override({"train.steps": 3})) == (None, True)
    code, _, err = _cli(_base_args(tiny_model_dir, addition_file, out, "--resume", "auto", "--train.steps", "3"),
                        capsys)
    assert code == 0, err
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]
    shutil.rmtree(out / "checkpoints")
    (out / "summary.json").unlink()
    code, _, err = _cli(_base_args(tiny_model_dir, addition_file, out, "--resume", "auto", "--train.seed", "5"),
                        capsys)
    assert code == 2 and "train.seed 0 -> 5" in err and len(err.strip().splitlines()) == 1


def test_orphans_are_cleaned_and_only_those(tmp_path):
    from klgrpo.store.checkpoint import clean_incomplete

    root = tmp_path / "checkpoints"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()

    def complete(name):
        (root / name).mkdir(parents=True)
        for f in ("trainer_state.json", "trainer_state.safetensors", "model.safetensors"):
            (root / name / f).write_text("x")

    complete("step_2")
    complete("step_4")
    (root / "step_1").mkdir()
    (root / "step_1" / "trainer_state.json").write_text("x")  # half-pruned: older than the newest, incomplete
    (root / "step_6").mkdir()  # incomplete but NEWER than every complete one: not ours to judge, kept
    (root / f".tmp_step_5_{dead}").mkdir()  # a dead process's save
    (root / f".tmp_step_5_{os.getpid()}").mkdir()  # a live process's save (this one): kept
    (root / ".trash_step_0_123").mkdir()  # an interrupted prune
    (root / "mine").mkdir()  # not a klgrpo pattern
    removed = sorted(p.name for p in clean_incomplete(tmp_path))
    assert removed == sorted([".tmp_step_5_" + dead, ".trash_step_0_123", "step_1"])
    assert sorted(p.name for p in root.iterdir()) == sorted(
        ["step_2", "step_4", "step_6", f".tmp_step_5_{os.getpid()}", "mine"])


# ---------------------------------------------------------------------------------- 2. non-finite steps
def _poison(step, monkeypatch, at_steps, what):
    real = step.accumulate_gradients

    def poisoned(batch, keep_logp=False):
        sums, logp = real(batch, keep_logp)
        if step.completed + 1 in at_steps:
            if what == "loss":
                sums.loss = sums.loss * float("nan")
            else:  # a finite loss with an infinite gradient
                next(p for p in step.model.parameters() if p.grad is not None).grad[0] = float("inf")
        return sums, logp

    monkeypatch.setattr(step, "accumulate_gradients", poisoned)


@pytest.mark.parametrize("what", ["loss", "grad"])
def test_non_finite_step_is_skipped_before_the_weights_change(tiny_model_dir, addition_file, tmp_path,
                                                              monkeypatch, what):
    cfg = make_config(tiny_model_dir, addition_file, tmp_path / "r", train={"steps": 3, "save_every": 1,
                                                                          "keep_checkpoints": 0}, **FAST)
    trainer = GRPOTrainer(cfg, log=quiet)
    _poison(trainer.grpo_step, monkeypatch, {2}, what)
    trainer.train()
    w1, w2, w3 = (_weights(tmp_path / "r", s) for s in (1, 2, 3))
    assert all(torch.equal(w1[k], w2[k]) for k in w1)  # step 2 was skipped: the weights did not move
    assert any(not torch.equal(w2[k], w3[k]) for k in w1)  # step 3 trained again
    rows = [r for r in read_metrics(tmp_path / "r") if "train/loss" in r]
    assert [r["train/skipped_steps"] for r in rows] == [0, 1, 1]
    assert trainer.grpo_step.scheduler.last_epoch == 2  # the scheduler skipped the step too


def test_consecutive_non_finite_steps_stop_the_run_non_zero(tiny_model_dir, addition_file, tmp_path, monkeypatch,
                                                            capsys):
    from klgrpo.train.step import GRPOStep

    real_update = GRPOStep.update

    def nan_from_step_2(self, batch, *rest):
        if self.completed >= 1:
            _poison(self, monkeypatch, {self.completed + 1}, "loss")
        return real_update(self, batch, *rest)

    monkeypatch.setattr(GRPOStep, "update", nan_from_step_2)
    out = tmp_path / "r"
    code, _, err = _cli(_base_args(tiny_model_dir, addition_file, out, "--train.steps", "10",
                                   "--train.max_skipped_steps", "2"), capsys)
    assert code == 2 and "2 steps in a row" in err and "train.max_skipped_steps=2" in err
    assert len(err.strip().splitlines()) == 1
    saved = sorted((out / "checkpoints").iterdir())
    assert [p.name for p in saved] == ["step_3"]  # stopped after steps 2 and 3 were skipped
    assert all(torch.isfinite(t).all() for t in _weights(out, 3).values())


def test_no_checkpoint_with_non_finite_weights(tiny_model_dir, addition_file, tmp_path):
    from klgrpo.train.guard import NonFiniteError

    trainer = GRPOTrainer(make_config(tiny_model_dir, addition_file, tmp_path / "r", **FAST), log=quiet)
    with torch.no_grad():
        next(trainer.model.parameters())[0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match="no checkpoint was written"):
        trainer.save()
    assert not (tmp_path / "r" / "checkpoints" / "step_0").exists()
    assert not list((tmp_path / "r" / "checkpoints").glob(".tmp_*"))


# ------------------------------------------------------------------------------ 3. no unpickling anywhere
class _Payload:
    marker = None

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


def _pickle_payload(tmp_path):
    _Payload.marker = tmp_path / "PWNED"
    return pickle.dumps({"x": _Payload()})


def test_state_round_trip_keeps_every_type_bitwise(tmp_path):
    import numpy as np

    from klgrpo.core.batch import StepBatch
    from klgrpo.core.rollout import RolloutBatch
    from klgrpo.math.aggregation import Normalizer
    from klgrpo.store.state_io import load_state, save_state

    rollout = RolloutBatch(input_ids=torch.arange(12).reshape(2, 6), attention_mask=torch.ones(2, 6, dtype=torch.long),
                           completion_ids=torch.arange(8).reshape(2, 4), completion_mask=torch.ones(2, 4).bool(),
                           truncated=torch.tensor([True, False]), prompt_len=2, group_size=2,
                           prompts=[[{"role": "user", "content": "1+1=\u00e9"}], "x"], completions=["2", "NaN"])
    logp = torch.randn(2, 4, dtype=torch.float64)
    batch = StepBatch(rollout=rollout, rewards=torch.tensor([1.0, -0.5]), reward_columns={"f": torch.ones(2)},
                      advantages=torch.tensor([0.7, -0.7]), loss_mask=rollout.completion_mask,
                      normalizer=Normalizer(2.0, torch.tensor(8.0), 4.0), ref_logp=logp[:, :3], old_logp=None,
                      timings={"time/generate": 0.125}, iterations_done=1)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    import random

    tree = {"batch": batch, "optimizer": opt.state_dict(), "python_rng": random.getstate(),
            "numpy_rng": np.random.get_state(), "torch_rng": torch.get_rng_state(), "values": [math.inf, 0.1, None]}
    save_state(tmp_path, "s", tree)
    back = load_state(tmp_path, "s")
    b = back["batch"]
    assert isinstance(b, StepBatch) and b.rollout.prompts == rollout.prompts and b.rollout.completions == ["2", "NaN"]
    assert torch.equal(b.ref_logp, logp[:, :3]) and b.ref_logp.dtype == torch.float64 and b.old_logp is None
    assert torch.equal(b.normalizer.num_tokens, torch.tensor(8.0)) and b.timings == {"time/generate": 0.125}
    assert b.iterations_done == 1 and b.rollout.prompt_len == 2 and torch.equal(b.loss_mask, rollout.completion_mask)
    assert back["python_rng"] == random.getstate()
    assert back["numpy_rng"][0] == "MT19937" and np.array_equal(back["numpy_rng"][1], np.random.get_state()[1])
    assert torch.equal(back["torch_rng"], torch.get_rng_state()) and back["values"][0] == math.inf
    state = back["optimizer"]["state"]
    assert set(state) == {0, 1} and torch.equal(state[0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)  # tuples stay tuples
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fresh.load_state_dict(back["optimizer"])


def test_a_pickle_payload_in_any_file_klgrpo_reads_does_not_run(tiny_model_dir, addition_file, tmp_path):
    from klgrpo.store.checkpoint import load_trainer_state
    from klgrpo.store.state_io import StateFileError, load_state
    from klgrpo.verify.from_run import DumpError, load_dump

    payload = _pickle_payload(tmp_path)
    cfg = make_config(tiny_model_dir, addition_file, tmp_path / "r", train={"steps": 1}, **FAST)
    GRPOTrainer(cfg, log=quiet).train()
    ckpt = tmp_path / "r" / "checkpoints" / "step_1"
    # 1) the trainer state's files replaced by pickles (one at a time)
    for name in ("trainer_state.safetensors", "trainer_state.json"):
        original = (ckpt / name).read_bytes()
        (ckpt / name).write_bytes(payload)
        with pytest.raises(StateFileError):
            load_trainer_state(ckpt)
        (ckpt / name).write_bytes(original)
    # 2) a pickle in the JSON's tensor-free parts cannot name a class either
    doc = json.loads((ckpt / "trainer_state.json").read_text())
    doc["tree"]["evil"] = {"__klgrpo__": "dataclass", "type": "Popen", "fields": {"args": "true"}}
    (ckpt / "trainer_state.json").write_text(json.dumps(doc))
    with pytest.raises(StateFileError, match="does not know"):
        load_trainer_state(ckpt)
    # 3) a legacy pickled trainer_state.pt is refused, not loaded
    legacy = tmp_path / "legacy" / "checkpoints" / "step_1"
    legacy.mkdir(parents=True)
    (legacy / "trainer_state.pt").write_bytes(payload)
    with pytest.raises(ConfigError, match="does not load because unpickling can run code"):
        GRPOTrainer(make_config(tiny_model_dir, addition_file, tmp_path / "legacy", **FAST),
                    log=quiet).train(resume="latest")
    # 4) the replay cache (read whenever a run uses that folder, even without --resume)
    (tmp_path / "rc").mkdir()
    for name in ("replay_cache.safetensors", "replay_cache.json", "replay_cache.pt"):
        (tmp_path / "rc" / name).write_bytes(payload)
    with pytest.raises(StateFileError):
        load_state(tmp_path / "rc", "replay_cache")
    # 5) a KL dump read by verify-kl --from-run
    (tmp_path / "step_000001.pt").write_bytes(payload)
    with pytest.raises(DumpError):
        load_dump(tmp_path / "step_000001.pt")
    assert not (tmp_path / "PWNED").exists()


def test_replay_cache_with_a_pickle_payload_is_resampled_not_run(tiny_model_dir, addition_file, tmp_path):
    payload = _pickle_payload(tmp_path)
    run = tmp_path / "r"
    run.mkdir()
    for name in ("replay_cache.safetensors", "replay_cache.json", "replay_cache.pt"):
        (run / name).write_bytes(payload)
    messages = []
    cfg = make_config(tiny_model_dir, addition_file, run, kl={"coef": 0.1, "replay": {
        "coef": 1.0, "source": str(addition_file), "num_prompts": 4, "batch_size": 4}}, **FAST)
    trainer = GRPOTrainer(cfg, log=messages.append)
    assert any("cannot read" in m and "sampling a new cache" in m for m in messages)
    assert not (tmp_path / "PWNED").exists()
    assert (run / "replay_cache.json").read_bytes() == payload  # the folder is not the run's before train()
    trainer.train()
    assert json.loads((run / "replay_cache.json").read_text())["format"] == 1


# --------------------------------------------------------------------------- 4. scientific notation
def test_scientific_notation_everywhere(tmp_path):
    from klgrpo.apps.args import parse_args
    from klgrpo.apps.sweep.plan import parse_grid

    (tmp_path / "c.yaml").write_text("optim:\n  lr: 5e-6\nkl:\n  coef: 1E-3\n  target: +2.5e-2\n")
    cfg, _ = parse_args(["--config", str(tmp_path / "c.yaml"), "--loss.std_eps", "1e-8"])
    assert (cfg.optim.lr, cfg.kl.coef, cfg.kl.target, cfg.loss.std_eps) == (5e-6, 1e-3, 2.5e-2, 1e-8)
    assert parse_args(["--optim.lr", "1e-4"])[0].optim.lr == 1e-4
    assert parse_grid(["kl.coef=1e-3,2e-2"]) == [("kl.coef", ["1e-3", "2e-2"])]
    from klgrpo.core.rewards import RewardSpec

    assert RewardSpec.parse({"name": "exact_match", "weight": "5e-1"}).weight == 0.5
    with pytest.raises(ConfigError, match="must be float"):
        parse_args(["--optim.lr", "1e-4x"])


# ---------------------------------------------------------------------- 5. corrupt checkpoints, full disk
def test_corrupt_newest_checkpoint_falls_back_and_names_the_file(tiny_model_dir, addition_file, tmp_path):
    cfg = make_config(tiny_model_dir, addition_file, tmp_path / "r", train={"steps": 2, "save_every": 1,
                                                                          "keep_checkpoints": 0}, **FAST)
    GRPOTrainer(cfg, log=quiet).train()
    newest = tmp_path / "r" / "checkpoints" / "step_2" / "model.safetensors"
    newest.write_bytes(newest.read_bytes()[:100])  # truncated
    with pytest.raises(KLGRPOError, match="step_2/model.safetensors cannot be read") as err:
        GRPOTrainer(cfg.override({"train.steps": 4}), log=quiet).train(
            resume=str(tmp_path / "r" / "checkpoints" / "step_2"))
    assert "\n" not in str(err.value)
    trainer = GRPOTrainer(cfg.override({"train.steps": 3}), log=quiet)
    with pytest.warns(KLGRPOWarning) as record:
        trainer.train(resume="latest")
    messages = [str(w.message) for w in record]
    assert any("step_2 cannot be loaded" in m and "model.safetensors" in m for m in messages)
    assert any("resuming from" in m and "step_1" in m for m in messages)
    assert [r["step"] for r in read_metrics(tmp_path / "r")] == [1, 2, 3]


def test_full_disk_during_save_says_so_and_keeps_the_old_checkpoint(tiny_model_dir, addition_file, tmp_path,
                                                                    monkeypatch):
    from klgrpo.store import checkpoint

    cfg = make_config(tiny_model_dir, addition_file, tmp_path / "r", train={"steps": 1}, **FAST)
    trainer = GRPOTrainer(cfg, log=quiet)
    trainer.train()

    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint, "save_state", full)
    trainer.grpo_step.completed = 2
    with pytest.raises(KLGRPOError) as err:
        trainer.save()
    assert "no space left" in str(err.value) and "step_1" in str(err.value)
    assert [p.name for p in (tmp_path / "r" / "checkpoints").iterdir()] == ["step_1"]  # no .tmp left


# --------------------------------------------------------------------------------------------- 7. SIGTERM
def test_sigterm_saves_the_last_complete_step_and_exits_143(tiny_model_dir, addition_file, tmp_path, capsys,
                                                            monkeypatch):
    from klgrpo.train.step import GRPOStep

    real_update = GRPOStep.update

    def terminate_on_second(self, batch, *rest):
        if self.completed == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_update(self, batch, *rest)

    monkeypatch.setattr(GRPOStep, "update", terminate_on_second)
    out = tmp_path / "r"
    code, _, err = _cli(_base_args(tiny_model_dir, addition_file, out, "--train.steps", "3"), capsys)
    assert code == 143 and "SIGTERM" in err
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_1"]
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the handler is gone after the run


# ------------------------------------------------------------------------------------------- 10. sweep
def test_sweep_neither_relabels_nor_replaces_a_run_whose_config_changed(tmp_path, monkeypatch):
    from klgrpo.apps.sweep import command as sweep

    script = tmp_path / "fake.py"
    script.write_text("import json, pathlib, sys\nargs = [a for a in sys.argv[1:] if a != '--overwrite']\n"
                      "kv = dict(zip([a[2:] for a in args[0::2]], args[1::2]))\n"
                      "out = pathlib.Path(kv['output-dir']); out.mkdir(parents=True, exist_ok=True)\n"
                      "(out / 'summary.json').write_text(json.dumps({'steps': int(kv['train.steps']), "
                      "'overwrite': '--overwrite' in sys.argv}))\n")
    monkeypatch.setattr(sweep, "train_argv_prefix", lambda: [sys.executable, str(script)])
    cells = sweep.cells_of(sweep.parse_grid(["kl.coef=1e-3"]))
    first = sweep.run_sweep(cells, [0], tmp_path / "s", None, ["--train.steps", "7"], log=quiet)
    same = sweep.run_sweep(cells, [0], tmp_path / "s", None, ["--train.steps", "7"], log=quiet)
    changed = sweep.run_sweep(cells, [0], tmp_path / "s", None, ["--train.steps", "8"], log=quiet)
    assert [r.status for r in (first + same + changed)] == ["finished", "skipped", "changed"]
    assert json.loads((tmp_path / "s" / "kl.coef=1e-3" / "seed=0" / "summary.json").read_text())["steps"] == 7
    assert changed[0].summary == {}  # the old run is not reported as the new config's result
    elsewhere = sweep.run_sweep(cells, [0], tmp_path / "s8", None, ["--train.steps", "8"], log=quiet)
    assert [r.status for r in elsewhere] == ["finished"] and elsewhere[0].summary["steps"] == 8


# ------------------------------------------------------------------------------------------ 11. memory
def test_step_tally_keeps_constant_state():
    from klgrpo.run.tally import StepTally

    tally = StepTally()
    for i in range(1000):
        tally.append({"time/step": float(i), "train/reward": i * 2.0})
    assert tally.last == {"time/step": 999.0, "train/reward": 1998.0}
    assert tally.mean("time/step") == pytest.approx(499.5) and len(tally) == 1000
    assert len(vars(tally)["_sums"]) == 1  # no per-step rows kept


# ------------------------------------------------------------------- 9. resuming the right state, owned files
def test_a_checkpoint_missing_weights_is_refused_and_the_older_one_used(tiny_model_dir, addition_file, tmp_path):
    """A model.safetensors without the model's tensors (here: none at all) must not resume "from step 2" with
    the base weights: it is named, and the older checkpoint resumes, with its exact weights."""
    from safetensors.torch import save_file

    run = tmp_path / "r"
    cfg = make_config(tiny_model_dir, addition_file, run, train={"steps": 2, "save_every": 1,
                                                                 "keep_checkpoints": 0}, **FAST)
    GRPOTrainer(cfg, log=quiet).train()
    save_file({}, str(run / "checkpoints" / "step_2" / "model.safetensors"))
    # As a checkpoint written before weights checksums were recorded: the load itself must refuse it.
    strip_checksums(run / "checkpoints" / "step_2", as_before_checksums=True)
    trainer = GRPOTrainer(cfg.override({"train.steps": 3}), log=quiet)
    with pytest.warns(KLGRPOWarning) as record:
        trainer.resume("latest")
    messages = [str(w.message) for w in record]
    assert trainer.step == 1 and any("step_2" in m and "lacks" in m for m in messages), messages
    expected = _weights(run, 1)
    for name, p in trainer.model.named_parameters():
        if name in expected:
            assert torch.equal(p.detach(), expected[name]), name
    # the resume kept it aside (checkpoints/damaged_step_2), and it is still refused when named
    assert not (run / "checkpoints" / "step_2").exists()
    with pytest.raises(KLGRPOError, match="lacks .* weights"):
        GRPOTrainer(cfg.override({"train.steps": 3}), log=quiet).resume(str(run / "checkpoints" / "damaged_step_2"))


def test_resume_refuses_a_run_without_config_yaml_and_a_finished_run(tiny_model_dir, addition_file, tmp_path,
                                                                      capsys):
    out = tmp_path / "run"
    assert _cli(_base_args(tiny_model_dir, addition_file, out), capsys)[0] == 0
    files = {n: (out / n).read_bytes() for n in ("config.yaml", "summary.json", "metrics.jsonl")}
    code, _, err = _cli(["--output-dir", str(out), "--resume", "latest"], capsys)  # finished at train.steps 2
    assert code == 2 and "already reached step 2" in err and len(err.strip().splitlines()) == 1
    assert {n: (out / n).read_bytes() for n in files} == files  # summary.json keeps its numbers
    (out / "config.yaml").unlink()
    code, _, err = _cli(["--output-dir", str(out), "--resume", "latest", "--train.steps", "3"], capsys)
    assert code == 2 and "config.yaml is missing" in err and "--config" in err, err
    assert not (out / "config.yaml").exists() and [r["step"] for r in read_metrics(out)] == [1, 2]


def test_files_klgrpo_did_not_write_are_never_changed(tiny_model_dir, addition_file, tmp_path, capsys):
    """A config.yaml symlink, the user's own config.yaml (--output-dir .), and a foreign folder that has a
    summary.json and plots/: refused, and --overwrite deletes none of it."""
    target = tmp_path / "elsewhere.yaml"
    target.write_text("mine: 1\n")
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "config.yaml").symlink_to(target)
    code, _, err = _cli(_base_args(tiny_model_dir, addition_file, linked), capsys)
    assert code == 2 and "config.yaml" in err and "not written by a klgrpo run" in err, err
    assert target.read_text() == "mine: 1\n" and (linked / "config.yaml").is_symlink()

    own = tmp_path / "project"
    own.mkdir()
    (own / "config.yaml").write_text("my: project\n")
    code, _, err = _cli(_base_args(tiny_model_dir, addition_file, own), capsys)
    assert code == 2 and (own / "config.yaml").read_text() == "my: project\n"

    foreign = tmp_path / "foreign"
    (foreign / "plots").mkdir(parents=True)
    (foreign / "plots" / "figure.png").write_bytes(b"png")
    (foreign / "summary.json").write_text("{}")
    code, _, err = _cli(_base_args(tiny_model_dir, addition_file, foreign, "--overwrite"), capsys)
    assert code == 2 and "summary.json" in err and "plots" in err, err
    assert (foreign / "plots" / "figure.png").read_bytes() == b"png" and (foreign / "summary.json").exists()

    # A run klgrpo made itself is listed in its marker, and --overwrite replaces exactly that.
    out = tmp_path / "run"
    assert _cli(_base_args(tiny_model_dir, addition_file, out), capsys)[0] == 0
    (out / "mine.txt").write_text("kept")
    assert _cli(_base_args(tiny_model_dir, addition_file, out, "--train.steps", "1", "--overwrite"), capsys)[0] == 0
    assert (out / "mine.txt").read_text() == "kept" and [r["step"] for r in read_metrics(out)] == [1]


def _small_tmpfs(path):
    """A 100 KiB tmpfs (a checkpoint of the tiny model takes ~220 KiB) at ``path`` when this process may mount one
    (root in a container), else None."""
    import shutil as _shutil

    if _shutil.which("mount") is None or os.geteuid() != 0:
        return None
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=100k", "tmpfs", str(path)], capture_output=True)
    return path if done.returncode == 0 else None


def test_full_disk_in_safetensors_says_so_and_leaves_no_tmp_folder(tiny_model_dir, addition_file, tmp_path,
                                                                   monkeypatch):
    """safetensors reports a full disk with its own SafetensorError, not an OSError: on a real small tmpfs when
    one can be mounted here, else with safetensors' writer failing the way it does on a full disk."""
    from safetensors import SafetensorError

    from klgrpo.store import checkpoint

    disk = _small_tmpfs(tmp_path / "disk")
    run = (disk or tmp_path) / "r"
    try:
        trainer = GRPOTrainer(make_config(tiny_model_dir, addition_file, run, train={"steps": 1}, **FAST), log=quiet)
        if disk is None:
            def full(*_a, **_k):
                raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

            monkeypatch.setattr(checkpoint, "save_state", full)
        with pytest.raises(KLGRPOError, match="no space left on the device while saving") as err:
            trainer.train()
        assert "no earlier checkpoint exists" in str(err.value)
        assert [p.name for p in (run / "checkpoints").iterdir()] == []  # no .tmp_step_* left on the full disk
    finally:
        if disk is not None:
            subprocess.run(["umount", str(disk)], check=True)


@pytest.mark.parametrize("hostile", ["deep_nesting", "wrong_types", "garbage_optimizer"])
def test_a_hostile_trainer_state_falls_back_to_the_older_checkpoint(hostile, tiny_model_dir, addition_file,
                                                                    tmp_path):
    """A trainer_state.json edited by hand or by an attacker: unreadable nesting, wrong types, an optimizer
    state of the wrong shape. The newest checkpoint is named and skipped; the older one resumes."""
    run = tmp_path / "r"
    cfg = make_config(tiny_model_dir, addition_file, run, train={"steps": 2, "save_every": 1,
                                                                 "keep_checkpoints": 0}, **FAST)
    GRPOTrainer(cfg, log=quiet).train()
    doc = run / "checkpoints" / "step_2" / "trainer_state.json"
    data = json.loads(doc.read_text())
    if hostile == "deep_nesting":
        doc.write_text(doc.read_text()[:-1] + ', "deep": ' + "[" * 100_000 + "]" * 100_000 + "}")
    elif hostile == "wrong_types":
        data["tree"]["sampler"] = "not a sampler state"
        data["tree"]["scheduler"] = [1, 2, 3]
        doc.write_text(json.dumps(data))
    else:
        data["tree"]["optimizer"] = {"state": "garbage", "param_groups": [{"params": "all of them"}]}
        doc.write_text(json.dumps(data))
    trainer = GRPOTrainer(cfg.override({"train.steps": 3}), log=quiet)
    with pytest.warns(KLGRPOWarning) as record:
        trainer.resume("latest")
    messages = [str(w.message) for w in record]
    assert trainer.step == 1, messages
    assert any("step_2 cannot be loaded" in m for m in messages), messages
    expected = _weights(run, 1)
    for name, p in trainer.model.named_parameters():
        if name in expected:
            assert torch.equal(p.detach(), expected[name]), name


def test_a_failed_resume_leaves_config_yaml_as_it_was(tiny_model_dir, addition_file, tmp_path, capsys):
    out = tmp_path / "run"
    assert _cli(_base_args(tiny_model_dir, addition_file, out), capsys)[0] == 0
    saved = (out / "config.yaml").read_bytes()
    weights = out / "checkpoints" / "step_2" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # the only checkpoint no longer loads
    code, _, err = _cli(["--output-dir", str(out), "--resume", "latest", "--train.steps", "3"], capsys)
    assert code == 2 and "cannot resume" in err, err
    assert (out / "config.yaml").read_bytes() == saved  # not rewritten with train.steps 3


def test_a_finished_multi_process_command_runs_its_exit_handlers_then_leaves_without_the_teardown(tmp_path):
    """exit_now_if_distributed: under a launcher (WORLD_SIZE > 1) the exit handlers run, the output is flushed and
    the process leaves with the command's status, skipping the interpreter's teardown (where a gloo rank could
    abort after a finished run); a single process returns and exits as usual."""
    import subprocess
    import sys

    script = (f"import atexit, pathlib, sys\n"
              f"from klgrpo.train.distributed import exit_now_if_distributed\n"
              f"atexit.register(lambda: pathlib.Path({str(tmp_path / 'handler')!r}).write_text('ran'))\n"
              f"print('summary', end='')\n"
              f"exit_now_if_distributed(3)\n"
              f"print(' returned', end='')\n")
    for world, code, out in (("2", 3, "summary"), ("1", 0, "summary returned")):
        (tmp_path / "handler").unlink(missing_ok=True)
        done = subprocess.run([sys.executable, "-c", script], env={**os.environ, "WORLD_SIZE": world},
                              capture_output=True, text=True, timeout=120)
        assert (done.returncode, done.stdout) == (code, out), done.stderr[-2000:]
        assert (tmp_path / "handler").read_text() == "ran"
