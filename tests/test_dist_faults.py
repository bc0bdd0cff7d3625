"""A failing process never hangs the others: 2 CPU processes (gloo) under a real launcher, with a refusal on
rank 0, an exception or a SIGKILL on rank 1 in the middle of a step, and a SIGTERM to the launcher. Every case
must end with every process gone and a non-zero exit; the seconds from the fault to the launcher's exit are
printed (measured, never asserted: docs/reliability.md has the table, benchmarks/dist_faults.py the numbers).
A stuck child fails the test with its output instead of hanging it (tests/helpers/launch.py)."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
import torch

from klgrpo.config.schema import GRPOConfig
from klgrpo.run.trainer import GRPOTrainer
from tests.helpers.launch import Launch, accelerate_command, metrics_steps

HELPERS = Path(__file__).parent / "helpers"
FAULT_REWARD = f"{HELPERS / 'faults.py'}:fault"
TIMEOUT = 240  # seconds before a stuck launch is stopped and the test fails with its output


def fault_config(model_dir, data_file, run: Path, steps=3, **fault) -> dict:
    return {
        "model": {"name_or_path": str(model_dir), "dtype": "float32", "device": "cpu"},
        "data": {"source": str(data_file)},
        "rollout": {"group_size": 4, "prompts_per_step": 4, "max_new_tokens": 4},
        "rewards": {"functions": [{"name": FAULT_REWARD, "kwargs": {"kind": "none", **fault}}]},
        "kl": {"coef": 0.1},
        "train": {"steps": steps, "output_dir": str(run), "dist_timeout_s": 60},
        "logging": {"progress": False, "tensorboard": False, "plots": False},
    }


def write(tmp_path, cfg) -> str:
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def cli(kind, config_file, *extra) -> list[str]:
    return accelerate_command(kind, ["-m", "klgrpo", "train", "--config", config_file, *extra])


def finish(launch: Launch, what: str):
    done = launch.finish(TIMEOUT)
    assert not done.timed_out, f"{what}: still running after {TIMEOUT} s (stopped by the test):\n{done.output[-4000:]}"
    return done


@pytest.mark.slow  # two processes under torchrun, about 19 s
def test_refusal_on_rank_0_stops_every_rank_with_its_message(tiny_model_dir, addition_file, tmp_path):
    """The run folder already holds a run: rank 0 refuses it (only rank 0 opens the folder) and the verdict is
    shared before any collective, so rank 1 stops with the same line instead of waiting in the first step."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text("{}")  # "holds a run"
    cfg = fault_config(tiny_model_dir, addition_file, run)
    cfg["eval"] = {"sets": [{"name": "a", "source": str(addition_file), "limit": 2}]}  # a collective on step 0
    done = finish(Launch(accelerate_command("ddp", [str(HELPERS / "fault_worker.py"), write(tmp_path, cfg)])),
                  "refusal")
    assert done.returncode != 0
    for rank in (0, 1):  # a summary.json and no checkpoint: nothing to resume, so the remedy is --overwrite
        assert (f"rank {rank}: error: {run} holds a run that stopped before its first checkpoint (nothing to resume)"
                in done.output), done.output[-4000:]
    assert metrics_steps(run) == [] and not (run / "config.yaml").exists()


@pytest.mark.slow  # two processes under torchrun, about 19 s each
@pytest.mark.parametrize("kind,fault", [("ddp", "raise"), ("fsdp2", "raise"), ("ddp", "sigkill"), ("fsdp2", "sigkill")])
def test_rank_1_failing_mid_step_brings_the_run_down(kind, fault, tiny_model_dir, addition_file, tmp_path):
    """Rank 1 fails in its reward of step 2 while rank 0 waits in the step's gather of rewards: the launcher
    (which sees rank 1 exit) and the broken connection end rank 0 too; step 1 stays logged once."""
    run = tmp_path / "run"
    cfg = fault_config(tiny_model_dir, addition_file, run, steps=3, kind=fault, rank=1, call=2)
    cfg["train"]["save_every"] = 1
    done = finish(Launch(cli(kind, write(tmp_path, cfg))), f"{fault} on rank 1")
    [fault_at] = done.marks("fault injected")
    print(f"\n{kind} {fault} on rank 1 mid-step: last process gone {done.exited_at - fault_at:.1f} s after the "
          f"fault, launcher exit code {done.returncode}")
    assert done.returncode != 0, done.output[-4000:]
    assert metrics_steps(run) == [1]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_1"]  # the last complete step


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_sigterm_to_the_launcher_saves_the_last_step_on_every_rank(kind, tiny_model_dir, addition_file, tmp_path):
    """SIGTERM to the launcher reaches every worker at a different point of its step; they stop together at
    the next step boundary, save that step once, and the run resumes from it."""
    run = tmp_path / "run"
    cfg = fault_config(tiny_model_dir, addition_file, run, steps=500)
    launch = Launch(cli(kind, write(tmp_path, cfg)))
    deadline = time.time() + TIMEOUT
    while len(metrics_steps(run)) < 2 and time.time() < deadline and launch.proc.poll() is None:
        time.sleep(0.1)
    sent = time.time()
    launch.proc.send_signal(signal.SIGTERM)
    done = finish(launch, "SIGTERM to the launcher")
    print(f"\n{kind} SIGTERM to the launcher: last process gone {done.exited_at - sent:.1f} s after the signal, "
          f"launcher exit code {done.returncode}")
    assert done.returncode != 0
    steps = metrics_steps(run)
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 2, done.output[-4000:]
    assert [p.name for p in (run / "checkpoints").iterdir()] == [f"step_{steps[-1]}"], done.output[-4000:]
    assert done.output.count("klgrpo train: terminated (SIGTERM)") == 2, done.output[-4000:]


@pytest.mark.slow
def test_a_stuck_rank_fails_the_run_after_train_dist_timeout_s(tiny_model_dir, addition_file, tmp_path):
    """Rank 1 stays alive but stops taking part (a reward that sleeps 120 s): rank 0's collective gives up after
    train.dist_timeout_s=5 instead of torch's 30 minutes, and the launcher then stops rank 1."""
    run = tmp_path / "run"
    cfg = fault_config(tiny_model_dir, addition_file, run, steps=3, kind="sleep", rank=1, call=2, seconds=120)
    cfg["train"]["dist_timeout_s"] = 5
    done = finish(Launch(cli("ddp", write(tmp_path, cfg))), "a stuck rank")
    [fault_at] = done.marks("fault injected")
    print(f"\nddp rank 1 stuck mid-step, train.dist_timeout_s=5: last process gone {done.exited_at - fault_at:.1f} s "
          f"after the fault, launcher exit code {done.returncode}")
    assert done.returncode != 0
    assert done.exited_at - fault_at < 100, "the run ended only when the stuck reward returned"  # not a speed goal
    assert "klgrpo train: error: the processes of this run lost each other" in done.output, done.output[-4000:]


@pytest.mark.slow
def test_resume_auto_under_torchrun_max_restarts_survives_two_kills_bitwise(tiny_model_dir, addition_file, tmp_path):
    """``torchrun --max-restarts 3 -m klgrpo train --resume auto``: rank 1 is SIGKILLed in the middle of a step on
    two attempts; the launcher restarts both workers, which continue from the newest checkpoint. The final
    weights equal an uninterrupted 2-process run's bitwise, and every step is logged once."""
    from safetensors.torch import load_file

    from tests.helpers.launch import torchrun_command

    steps = 6
    runs = {}
    for name, reward in [("uninterrupted", {"name": "format", "kwargs": {"pattern": "0"}}),
                         ("killed", {"name": f"{HELPERS / 'faults.py'}:kill_each_attempt",
                                     "kwargs": {"kills_file": str(tmp_path / "kills.txt"), "call": 3, "times": 2}})]:
        run = tmp_path / name
        cfg = fault_config(tiny_model_dir, addition_file, run, steps=steps)
        cfg["rewards"]["functions"] = [reward]
        cfg["train"]["save_every"] = 1
        config_file = tmp_path / f"{name}.json"
        config_file.write_text(json.dumps(cfg))
        done = finish(Launch(torchrun_command(["-m", "klgrpo", "train", "--config", str(config_file),
                                               "--resume", "auto"], max_restarts=3)), name)
        assert done.returncode == 0, done.output[-4000:]
        runs[name] = run
    kills = (tmp_path / "kills.txt").read_text().splitlines()
    assert len(kills) == 2  # killed at step 3 of the first attempt, step 2 + 3 = 5 of the second
    assert metrics_steps(runs["killed"]) == list(range(1, steps + 1))
    final = [load_file(str(r / "checkpoints" / f"step_{steps}" / "model.safetensors")) for r in runs.values()]
    assert final[0].keys() == final[1].keys()
    for name in final[0]:
        assert torch.equal(final[0][name], final[1][name]), name


@pytest.mark.slow
@pytest.mark.parametrize("sharded", [False, True])
def test_sigkill_of_rank_1_mid_save_keeps_a_complete_checkpoint(sharded, tiny_model_dir, addition_file, tmp_path):
    """Rank 1 is SIGKILLed as soon as the step-4 checkpoint's temporary folder appears (a gathered save: rank 0
    writes alone and may finish it; a sharded one: every rank writes its shards, so it cannot). Either way the
    run ends non-zero and the newest complete checkpoint loads; nothing half-written counts as one."""
    import os

    from klgrpo.store.checkpoint import clean_incomplete, list_checkpoints
    from tests.helpers.launch import rank_pid

    run = tmp_path / "run"
    cfg = fault_config(tiny_model_dir, addition_file, run, steps=400)
    cfg["train"].update(save_every=2, keep_checkpoints=0, sharded_checkpoints=sharded)
    launch = Launch(cli("fsdp2", write(tmp_path, cfg)))
    killed_at, deadline = None, time.time() + TIMEOUT
    while killed_at is None and launch.proc.poll() is None and time.time() < deadline:
        root = run / "checkpoints"
        if root.is_dir() and any(p.name.startswith(".tmp_step_4_") for p in root.iterdir()):
            pid = rank_pid(launch, 1)
            if pid:
                os.kill(pid, signal.SIGKILL)
                killed_at = time.time()
        time.sleep(0.002)
    done = finish(launch, "SIGKILL mid-save")
    assert killed_at is not None, done.output[-4000:]
    print(f"\nfsdp2 SIGKILL of rank 1 mid-save (sharded={sharded}): last process gone "
          f"{done.exited_at - killed_at:.1f} s after the kill, launcher exit code {done.returncode}")
    assert done.returncode != 0
    clean_incomplete(run)  # what the next start does
    complete = [p.name for p in list_checkpoints(run)]
    assert complete[-1] == "step_2" if sharded else complete[-1] in ("step_2", "step_4"), complete
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == complete  # no temporary folder counts
    trainer = GRPOTrainer(GRPOConfig.from_dict(cfg), log=lambda *_: None)
    trainer.resume("latest")
    assert trainer.step == int(complete[-1].removeprefix("step_"))


@pytest.mark.slow
def test_a_changed_shard_of_a_two_process_checkpoint_falls_back_on_every_rank(tiny_model_dir, addition_file,
                                                                               tmp_path):
    """FSDP2 with train.sharded_checkpoints: one shard of the newest checkpoint has a flipped byte. Every rank
    checks the same sha256 before loading anything, so both skip it together and continue from the one before;
    the run finishes with every step logged once."""
    import shutil

    run = tmp_path / "run"
    cfg = fault_config(tiny_model_dir, addition_file, run, steps=3)
    cfg["train"].update(save_every=1, keep_checkpoints=0, sharded_checkpoints=True)
    config_file = write(tmp_path, cfg)
    assert finish(Launch(cli("fsdp2", config_file)), "first run").returncode == 0
    shutil.rmtree(run / "checkpoints" / "step_3")  # the last checkpoint is whole: step_2 (sharded) is the newest
    shard = sorted((run / "checkpoints" / "step_2" / "sharded").glob("*.safetensors"))[-1]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x10
    shard.write_bytes(bytes(data))
    done = finish(Launch(cli("fsdp2", config_file, "--resume", "latest")), "resume")
    assert done.returncode == 0, done.output[-4000:]
    assert f"checkpoint step_2 cannot be loaded: {shard} cannot be read as saved" in done.output, done.output[-4000:]
    assert f"resuming from {run / 'checkpoints' / 'step_1'} instead" in done.output
    assert metrics_steps(run) == [1, 2, 3]
