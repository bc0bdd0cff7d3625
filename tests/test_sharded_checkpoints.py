"""train.sharded_checkpoints: every process writes its own shards of the weights and AdamW moments
(torch.distributed.checkpoint into safetensors files, nothing pickled) instead of gathering them on process 0.
A resume from sharded shards continues bitwise on the same process count and loads the same weights and
moments on another (2 -> 1, 1 -> 2); the run's last checkpoint is whole, as always."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers.configs import make_config, quiet
from safetensors.torch import load_file

from klgrpo.run.trainer import GRPOTrainer

FAST = {"logging": {"progress": False, "tensorboard": False, "plots": False}}


def _state(trainer) -> dict:
    return {"weights": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
            "optimizer": trainer.optimizer.state_dict()["state"]}


def _assert_same(got: dict, expected: dict, what: str) -> None:
    assert got["weights"].keys() == expected["weights"].keys(), what
    for name, w in expected["weights"].items():
        assert torch.equal(got["weights"][name], w), (what, name)
    assert got["optimizer"].keys() == expected["optimizer"].keys(), what
    for i, moments in expected["optimizer"].items():
        for k, v in moments.items():
            assert torch.equal(torch.as_tensor(got["optimizer"][i][k]), torch.as_tensor(v)), (what, i, k)


def test_one_process_resumes_a_sharded_checkpoint_bitwise(tiny_model_dir, addition_file, tmp_path):
    run = tmp_path / "run"
    cfg = make_config(tiny_model_dir, addition_file, run, train={"steps": 2, "save_every": 1, "keep_checkpoints": 0,
                                                                 "sharded_checkpoints": True}, **FAST)
    GRPOTrainer(cfg, log=quiet).train()
    step_1, step_2 = run / "checkpoints" / "step_1", run / "checkpoints" / "step_2"
    assert (step_1 / "sharded").is_dir() and not (step_1 / "model.safetensors").exists()
    assert (step_2 / "model.safetensors").exists() and not (step_2 / "sharded").exists()  # the last is whole
    assert not list((step_1 / "sharded").glob("*.distcp")) and not (step_1 / "sharded" / ".metadata").exists()
    other = tmp_path / "other"
    shutil.copytree(step_1, other / "checkpoints" / "step_1")
    shutil.copy(run / "config.yaml", other / "config.yaml")
    GRPOTrainer(cfg.override({"train.output_dir": str(other)}), log=quiet).train(resume="latest")
    expected, got = load_file(str(step_2 / "model.safetensors")), load_file(
        str(other / "checkpoints" / "step_2" / "model.safetensors"))
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)

    # klgrpo export joins the shards into a from_pretrained folder with the weights a resume loads.
    from transformers import AutoModelForCausalLM

    from klgrpo.apps.cli import main

    assert main(["export", str(step_1), str(tmp_path / "exported")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "exported", dtype=torch.float32).state_dict()
    resumed = GRPOTrainer(cfg, log=quiet)
    resumed.resume(str(step_1))
    live = resumed.model.state_dict()
    assert exported.keys() == live.keys() and all(torch.equal(exported[k], live[k]) for k in live)
    assert main(["export", str(step_1), str(tmp_path / "exported")]) == 2  # OUT not empty: refused


@pytest.mark.slow
def test_sharded_checkpoints_under_fsdp2_resume_on_two_and_one_and_from_one(tiny_model_dir, addition_file,
                                                                             tmp_path):
    from tests.test_distributed import KINDS, WORKER, accelerate_launch, config_dict

    one_run = tmp_path / "one"
    one_cfg = make_config(tiny_model_dir, addition_file, one_run, train={"steps": 2, "save_every": 1,
                                                                         "keep_checkpoints": 0,
                                                                         "sharded_checkpoints": True}, **FAST)
    GRPOTrainer(one_cfg, log=quiet).train()
    one_at_step_1 = GRPOTrainer(one_cfg, log=quiet)
    one_at_step_1.resume(str(one_run / "checkpoints" / "step_1"))

    raw = config_dict(tiny_model_dir, "", addition_file, tmp_path / "two")
    del raw["kl"]["replay"], raw["kl"]["reference"]
    raw["train"].update(save_every=1, keep_checkpoints=0, sharded_checkpoints=True)
    (tmp_path / "cfg.json").write_text(json.dumps(raw))
    accelerate_launch(KINDS["fsdp2"], [str(WORKER), "sharded", str(tmp_path / "cfg.json"),
                                       str(one_run / "checkpoints" / "step_1"), str(tmp_path / "out.pt")])
    out = torch.load(tmp_path / "out.pt", weights_only=False)
    shards = out["layout"]["step_1"]
    assert "sharded" in shards and "model.safetensors" not in shards and "model.safetensors" in out["layout"]["step_2"]
    assert out["continued_equals_uninterrupted"]  # 2 -> 2: bitwise
    # 1 -> 2: what 2 processes hold after resuming the 1-process sharded checkpoint is what 1 process held.
    _assert_same(out["one_resumed_on_two"], _state(one_at_step_1), "1 -> 2")
    # 2 -> 1: one process resumes the 2-process sharded checkpoint with the weights and moments 2 processes hold.
    two_run_cfg = make_config(tiny_model_dir, addition_file, tmp_path / "two_on_one",
                              train={"steps": 2, "sharded_checkpoints": True}, **FAST)
    two_run_cfg = two_run_cfg.override({"kl.coef": raw["kl"]["coef"], "kl.placement": raw["kl"]["placement"],
                                        "loss.advantage_scale": "batch", "optim.max_grad_norm": 1e9,
                                        "train.micro_batch_size": 4})
    resumed = GRPOTrainer(two_run_cfg, log=quiet)
    resumed.resume(str(tmp_path / "two" / "checkpoints" / "step_1"))
    _assert_same(_state(resumed), out["two_at_step_1"], "2 -> 1")


def _flip_a_shard_byte(checkpoint) -> None:
    shard = sorted((checkpoint / "sharded").glob("*.safetensors"))[-1]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x10  # inside the last tensor: the file still parses, only its numbers changed
    shard.write_bytes(bytes(data))


def test_a_changed_shard_is_skipped_by_resume_and_refused_by_export(tiny_model_dir, addition_file, tmp_path):
    """A shard whose bytes changed since it was saved fails its sha256: ``--resume latest`` goes on from the
    checkpoint before it (one warning names the shard), ``klgrpo export`` refuses it in one line."""
    from klgrpo.apps.cli import main
    from klgrpo.errors import KLGRPOWarning

    run = tmp_path / "run"
    cfg = make_config(tiny_model_dir, addition_file, run, train={"steps": 3, "save_every": 1, "keep_checkpoints": 0,
                                                                 "sharded_checkpoints": True}, **FAST)
    GRPOTrainer(cfg, log=quiet).train()
    shutil.rmtree(run / "checkpoints" / "step_3")  # the last one is whole: make the sharded step_2 the newest
    _flip_a_shard_byte(run / "checkpoints" / "step_2")
    assert main(["export", str(run / "checkpoints" / "step_2"), str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()
    trainer = GRPOTrainer(cfg, log=quiet)
    with pytest.warns(KLGRPOWarning) as record:
        trainer.resume("latest")
    messages = [str(w.message) for w in record]
    assert any("checkpoint step_2 cannot be loaded" in m and "/sharded/" in m and "sha256" in m for m in messages)
    assert trainer.step == 1
