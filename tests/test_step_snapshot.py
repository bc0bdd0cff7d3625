"""A GRPOStep's in-memory snapshot (what a kl.on_runaway rollback restores) and its rescale (what the rollback then
changes), on a step alone, without a trainer or a run around it."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from helpers.configs import make_config, quiet

from klgrpo.store.checkpoint import rng_state
from klgrpo.train.building import seed_everything
from klgrpo.train.distributed import Distributed
from klgrpo.train.engine import Engine
from klgrpo.train.step_build import build_step

VOLATILE = ("time/",)  # wall-clock timings differ between any two steps


def _step(cfg, run_dir):
    seed_everything(cfg.train.seed)
    cfg.validate()
    return build_step(cfg, Distributed(cfg.train.dist_timeout_s), Engine(), run_dir, log=quiet)


def _metrics(metrics):
    return {k: v for k, v in metrics.items() if not k.startswith(VOLATILE)}


def _live(step) -> dict:
    """Copies of everything a restore must bring back, read from the live objects themselves."""
    live = {
        "weights": step.model.state_dict(),
        "reference": step.reference.model.state_dict(),
        "optimizer": step.optimizer.state_dict(),
        "scheduler": step.scheduler.state_dict(),
        "controller": step.controller.state_dict(),
        "entropy_controller": step.entropy_controller.state_dict(),
        "data": step.prompt_order.state_dict(),
        "rng": rng_state(),
        "completed": step.completed,
        "batch": (step.batch.iterations_done, step.batch.rollout.completion_ids) if step.batch else None,
    }
    return _copy(live)


def _copy(tree):
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, np.ndarray):
        return tree.copy()
    if isinstance(tree, dict):
        return {k: _copy(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_copy(v) for v in tree)
    return tree


def _differences(a, b, where="") -> list[str]:
    """The paths at which two ``_live`` trees differ: tensors bit for bit (dtype included), numbers exactly."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        return [] if same else [where]
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return [] if np.array_equal(a, b) else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where} keys"]
        return [d for k in a for d in _differences(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where} length"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [where]


@pytest.fixture
def snapshot_config(tiny_model_dir, addition_file, tmp_path):
    # num_iterations 2: after 3 steps a half-used batch is pending; kl.sync_every 2 with alpha 0.5: the reference has
    # weights of its own (synced at step 2) that a restore must bring back; the adaptive controller and a linear
    # schedule with a warm-up make beta and the lr change every step.
    return make_config(
        tiny_model_dir,
        addition_file,
        tmp_path / "run",
        train={"num_iterations": 2, "steps": 10},
        kl={"coef": 0.1, "controller": "adaptive", "target": 0.01, "horizon": 100, "sync_every": 2, "sync_alpha": 0.5},
        optim={"schedule": "linear", "warmup_steps": 2},
    )


def test_a_restore_brings_back_every_part_bit_for_bit_and_the_snapshot_serves_again(snapshot_config, tmp_path):
    step = _step(snapshot_config, tmp_path / "run")
    for _ in range(3):
        step.advance()
    assert step.reference.synced and step.batch is not None and step.batch.iterations_done == 1
    before = _live(step)
    snapshot = step.snapshot()
    expected, _ = step.advance()
    after_one = _live(step)
    for _ in range(2):  # moves everything on: weights, moments, schedule, beta, data position, RNG, reference
        step.advance()
    moved = _differences(_live(step), before)
    for part in ("/weights", "/reference", "/optimizer", "/scheduler", "/controller", "/data", "/rng", "/completed"):
        assert any(d.startswith(part) for d in moved), f"{part} did not move: the check below would prove nothing"

    version = step.weights_version
    step.restore(snapshot)
    assert _differences(_live(step), before) == []
    assert step.weights_version == version + 1  # a sampler holding its own weights pushes them again
    got, _ = step.advance()  # the step from the restored state is the step taken from the original one
    assert _metrics(got) == _metrics(expected)
    assert _differences(_live(step), after_one) == []

    # AdamW updated the restored moments in place: the snapshot kept its own copies, so it restores again.
    step.restore(snapshot)
    assert _differences(_live(step), before) == []


def test_a_restore_brings_back_the_python_and_numpy_rng_too(snapshot_config, tmp_path):
    step = _step(snapshot_config, tmp_path / "run")
    snapshot = step.snapshot()
    expected = (random.random(), np.random.rand(), torch.rand(3))
    step.restore(snapshot)
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[:2] == expected[:2] and torch.equal(got[2], expected[2])


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")  # no optimizer step here
def test_rescale_multiplies_beta_the_lr_and_the_schedule_it_follows(tiny_model_dir, addition_file, tmp_path):
    # lr 0.05, a linear schedule over 8 steps after 2 warm-up steps: at step 0 the warm-up's lr is 0.
    cfg = make_config(
        tiny_model_dir,
        addition_file,
        tmp_path / "run",
        train={"steps": 8},
        kl={"coef": 0.01},
        optim={"lr": 0.05, "schedule": "linear", "warmup_steps": 2},
    )
    step = _step(cfg, tmp_path / "run")
    group = step.optimizer.param_groups[0]
    assert (group["lr"], group["initial_lr"], step.scheduler.base_lrs) == (0.0, 0.05, [0.05])

    # Factors that are powers of two, so every product is exact: 0.01 x 2 = 0.02, 0.05 x 0.25 = 0.0125.
    assert step.rescale(2.0, 0.25) == (0.02, 0.0125)
    assert step.controller.value == 0.02 and step.kl_term().coef == 0.02
    assert (group["lr"], group["initial_lr"], step.scheduler.base_lrs) == (0.0, 0.0125, [0.0125])
    step.scheduler.step()  # warm-up step 1 of 2: half the new base
    assert step.scheduler.get_last_lr() == [0.00625] and group["lr"] == 0.00625
    for _ in range(3):  # step 4: the linear decay's (8 - 4) / (8 - 2) of the new base
        step.scheduler.step()
    assert group["lr"] == pytest.approx(0.0125 * 4 / 6, rel=1e-12)

    # a second rescale compounds: 0.02 x 2, 0.0125 x 0.5; the lr of this step x 0.5 too
    lr_now = group["lr"]
    assert step.rescale(2.0, 0.5) == (0.04, 0.00625)
    assert group["lr"] == lr_now * 0.5 and group["initial_lr"] == 0.00625
