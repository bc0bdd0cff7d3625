"""A GRPOStep on its own, without a GRPOTrainer or a run: built, stepped, saved into a folder and loaded into a
freshly built step, which then continues exactly as the original (weights, optimizer moments, controller, data
position, pending batch and RNG all come back: the next step's metrics and weights are bit for bit the same)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.configs import make_config, quiet

from klgrpo.store.checkpoint import STATE_FILE, CheckpointLoadError
from klgrpo.train.building import seed_everything
from klgrpo.train.distributed import Distributed
from klgrpo.train.engine import Engine
from klgrpo.train.step_build import build_step

VOLATILE = ("time/",)  # wall-clock timings differ between any two runs


def _step(cfg, run_dir):
    seed_everything(cfg.train.seed)
    cfg.validate()
    return build_step(cfg, Distributed(cfg.train.dist_timeout_s), Engine(), run_dir, log=quiet)


def _metrics(metrics):
    return {k: v for k, v in metrics.items() if not k.startswith(VOLATILE)}


@pytest.fixture
def config(tiny_model_dir, addition_file, tmp_path):
    # num_iterations 2: after 3 steps a half-used batch is pending, which the checkpoint must carry too.
    return make_config(tiny_model_dir, addition_file, tmp_path / "run", train={"num_iterations": 2},
                       kl={"coef": 0.1, "controller": "adaptive", "target": 0.01, "horizon": 100})


def test_a_step_saved_and_loaded_alone_continues_bitwise(config, tmp_path):
    original = _step(config, tmp_path / "run")
    for _ in range(3):
        original.advance()
    folder = tmp_path / "ckpt"
    folder.mkdir()
    original.save(folder, run_state={"note": "the run's own part"})
    expected, _ = original.advance()

    restored = _step(config, tmp_path / "run")
    seed_everything(12345)  # another RNG state: the checkpoint must bring back the original's
    state = restored.load(folder)
    assert restored.completed == 3 and state["note"] == "the run's own part"
    assert restored.batch is not None and restored.batch.iterations_done == 1  # the pending batch's second use
    got, _ = restored.advance()
    assert _metrics(got) == _metrics(expected)
    for (name, a), (_, b) in zip(original.model.state_dict().items(), restored.model.state_dict().items()):
        assert torch.equal(a, b), name
    assert restored.controller.value == original.controller.value


def test_the_state_file_holds_each_key_once(config, tmp_path):
    step = _step(config, tmp_path / "run")
    step.advance()
    folder = tmp_path / "ckpt"
    folder.mkdir()
    step.save(folder)
    tree = json.loads((folder / STATE_FILE).read_text())["tree"]
    assert "rng" not in tree and len(tree["rng_by_rank"]) == 1 and tree["step"] == 1


def test_a_checkpoint_without_its_weights_is_refused_naming_the_file(config, tmp_path):
    step = _step(config, tmp_path / "run")
    folder = tmp_path / "ckpt"
    folder.mkdir()
    step.save(folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointLoadError, match="model.safetensors is missing"):
        _step(config, tmp_path / "run").load(folder)


def test_a_checkpoint_in_the_earlier_layout_still_loads_bitwise(config, tmp_path):
    """Checkpoints written before the step owned its checkpoint held rank 0's RNG under "rng" (and some no
    "rng_by_rank"): they load, and continue as the step that wrote them."""
    from klgrpo.store.checkpoint import STATE_STEM, WEIGHTS_SUMS
    from klgrpo.store.state_io import load_state, read_state_doc, save_state

    original = _step(config, tmp_path / "run")
    original.advance()
    folder = tmp_path / "ckpt"
    folder.mkdir()
    original.save(folder)
    expected, _ = original.advance()
    tree = load_state(folder, STATE_STEM)
    tree["rng"] = tree.pop("rng_by_rank")[0]
    save_state(folder, STATE_STEM, tree, extra={WEIGHTS_SUMS: read_state_doc(folder, STATE_STEM)[WEIGHTS_SUMS]})

    restored = _step(config, tmp_path / "run")
    restored.load(folder)
    got, _ = restored.advance()
    assert _metrics(got) == _metrics(expected)
