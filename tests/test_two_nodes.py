"""Two machines, as torchrun launches them: one launcher per node (``--nnodes 2 --node_rank R``, one process each,
a static rendezvous on 127.0.0.1, gloo), the run folder on storage both nodes see. The two-node run computes
exactly what two processes on one node compute (bitwise, which tests/test_distributed.py compares with one
process); when node 1's worker is SIGKILLed in the middle of a step, node 0 stops too, and launching both nodes
again with ``--resume auto`` continues from the last checkpoint to the uninterrupted run's final weights, bit for
bit, with every step logged once. docs/distributed.md gives the same commands for real machines."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.launch import Launch, free_port, metrics_steps, torchrun_command

HELPERS = Path(__file__).parent / "helpers"
TIMEOUT = 300
STEPS = 5


def _config(model_dir, data_file, run: Path, reward: dict) -> dict:
    return {
        "model": {"name_or_path": str(model_dir), "dtype": "float32", "device": "cpu"},
        "data": {"source": str(data_file)},
        "rollout": {"group_size": 4, "prompts_per_step": 4, "max_new_tokens": 4},
        "rewards": {"functions": [reward]},
        "kl": {"coef": 0.1},
        "train": {"steps": STEPS, "output_dir": str(run), "save_every": 1, "dist_timeout_s": 60},
        "logging": {"progress": False, "tensorboard": False, "plots": False},
    }


def _node_command(node_rank: int, port: int, args: list[str]) -> list[str]:
    """What each machine runs (``--master_addr`` is node 0's address; here both are this machine)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node_rank),
            "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(port), *args]


def _two_nodes(args: list[str]):
    port = free_port()
    launches = [Launch(_node_command(rank, port, args)) for rank in (0, 1)]
    return [launch.finish(TIMEOUT) for launch in launches]


def _final_weights(run: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run / "checkpoints" / f"step_{STEPS}" / "model.safetensors"))


@pytest.mark.slow
def test_two_nodes_match_one_node_and_resume_bitwise_after_a_node_dies(tiny_model_dir, addition_file, tmp_path):
    plain = {"name": "format", "kwargs": {"pattern": "0"}}
    killer = {"name": f"{HELPERS / 'faults.py'}:kill_each_attempt",  # same rewards as "format 0"
              "kwargs": {"kills_file": str(tmp_path / "kills.txt"), "rank": 1, "call": 3, "times": 1}}
    files = {}
    for name, reward in [("one_node", plain), ("two_nodes", plain), ("killed", killer)]:
        files[name] = tmp_path / f"{name}.json"
        files[name].write_text(json.dumps(_config(tiny_model_dir, addition_file, tmp_path / name, reward)))

    one = Launch(torchrun_command(["-m", "klgrpo", "train", "--config", str(files["one_node"])])).finish(TIMEOUT)
    assert one.returncode == 0, one.output[-4000:]
    for done in _two_nodes(["-m", "klgrpo", "train", "--config", str(files["two_nodes"])]):
        assert done.returncode == 0 and not done.timed_out, done.output[-4000:]

    # Node 1's worker dies in the middle of step 3: both nodes end non-zero, step 2's checkpoint is the newest.
    args = ["-m", "klgrpo", "train", "--config", str(files["killed"]), "--resume", "auto"]
    first = _two_nodes(args)
    assert all(done.returncode != 0 and not done.timed_out for done in first), first[0].output[-4000:]
    assert metrics_steps(tmp_path / "killed") == [1, 2]
    again = _two_nodes(args)
    assert all(done.returncode == 0 for done in again), again[0].output[-4000:]
    assert "resumed from" in again[0].output and "step_2 at step 2" in again[0].output, again[0].output[-4000:]
    assert metrics_steps(tmp_path / "killed") == list(range(1, STEPS + 1))

    reference = _final_weights(tmp_path / "one_node")
    for run in ("two_nodes", "killed"):
        weights = _final_weights(tmp_path / run)
        assert weights.keys() == reference.keys()
        for key in reference:
            assert torch.equal(weights[key], reference[key]), (run, key)
