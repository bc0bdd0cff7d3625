"""Caches that several processes ask for at once (every rank of `accelerate launch`): the demo's assets and the
replay anchor's cache are built by one process while the others wait on a lock of the folder, then load what it
wrote. The in-process tests hold the lock themselves so that both contenders are certainly waiting when it is
released (flock locks of two open() calls exclude each other between threads as between processes); the
2-process test runs the real launcher (about 5 s)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from klgrpo.apps.demo.assets import DemoSettings, ModelSizes, prepare_demo_assets
from klgrpo.apps.demo.sft import SFTSettings
from klgrpo.store.state_io import folder_lock
from klgrpo.train.replay import CACHE_FILE, AnchorModels, ReplayAnchor
from tests.test_replay import _setup, subtraction_file  # noqa: F401 (a fixture)

TINY_DEMO = DemoSettings(model=ModelSizes(hidden=16, layers=1, heads=2, intermediate=32, max_positions=16),
                         sft=SFTSettings(max_steps=4, eval_every=2, batch_size=16), n_replay=100)


def _contend(folder, work, marker: str, n: int = 2):
    """Run ``work(log)`` in ``n`` threads while this thread holds the lock of ``folder``; release it once every
    thread has logged ``marker`` (it is waiting). Returns each thread's (log lines, result)."""
    logs = [[] for _ in range(n)]
    results = [None] * n

    def run(i):
        results[i] = work(logs[i].append)

    with folder_lock(folder):
        threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for _ in range(1200):  # a safety bound, not a speed test
            if all(any(marker in line for line in lines) for lines in logs):
                break
            time.sleep(0.05)
        else:
            pytest.fail(f"the threads did not wait on the lock: {logs}")
    for t in threads:
        t.join()
    return logs, results


def test_folder_lock_tells_a_waiter_and_lets_it_in_after(tmp_path):
    calls = []
    with folder_lock(tmp_path, on_wait=lambda: calls.append("first waited")):
        pass
    assert calls == []  # free: no waiting
    assert list(tmp_path.iterdir()) == []  # nothing written into the folder


def test_demo_assets_asked_for_at_once_are_built_once(tmp_path):
    root = tmp_path / "demo"
    root.mkdir()
    logs, assets = _contend(root, lambda log: prepare_demo_assets(seed=0, cache_dir=tmp_path, log=log,
                                                                  settings=TINY_DEMO), "waiting for another")
    built = [any("building tokenizer" in line for line in lines) for lines in logs]
    assert sorted(built) == [False, True], logs
    loader = logs[built.index(False)]
    assert any("built by another process" in line for line in loader), loader
    assert assets[0].model_dir == assets[1].model_dir
    assert [p.name for p in root.iterdir()] == [assets[0].cache_dir.name]  # no temporary folder left


def test_replay_cache_asked_for_at_once_is_sampled_once(tiny_model_dir, addition_file, subtraction_file,  # noqa: F811
                                                        tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    pieces = [_setup(tiny_model_dir, addition_file, subtraction_file, run) for _ in range(2)]
    turn = iter(pieces)
    lock = threading.Lock()

    def build(log):
        with lock:
            cfg, model, tok, ref = next(turn)
        return ReplayAnchor.build(cfg, AnchorModels(model, tok, ref), run, log=log)

    logs, anchors = _contend(run, build, "waiting for another process to write")
    assert sum("sampled" in line for lines in logs for line in lines) == 1, logs
    assert torch.equal(anchors[0].cache.input_ids, anchors[1].cache.input_ids)
    assert torch.equal(anchors[0].cache.ref_logp, anchors[1].cache.ref_logp)
    assert sorted(p.name for p in run.iterdir()) == sorted([CACHE_FILE, "replay_cache.safetensors"])


@pytest.mark.slow  # two processes under torchrun, about 16 s
def test_two_ranks_build_the_demo_assets_and_the_replay_cache_once(tmp_path):
    """`accelerate launch --num_processes 2` (DDP, gloo): every rank asks for the demo assets and builds a trainer
    with the replay anchor (each rank of DDP builds one); one rank builds each, the other loads it."""
    from pathlib import Path

    from tests.helpers.launch import Launch, accelerate_command, launch_env

    script = Path(__file__).parent / "helpers" / "shared_cache_worker.py"
    launch = Launch(accelerate_command("ddp", [str(script), str(tmp_path / "cache"), str(tmp_path / "run")]),
                    env=launch_env(CUDA_VISIBLE_DEVICES=""))
    done = launch.finish(timeout=300)
    assert done.returncode == 0 and not done.timed_out, done.output[-4000:]
    out = done.output  # the ranks' lines may interleave; each message is one write
    assert out.count("demo assets: building tokenizer") == 1, out[-4000:]
    assert out.count("replay anchor: sampled") == 1, out[-4000:]
    assert "rank 0: done" in out and "rank 1: done" in out
