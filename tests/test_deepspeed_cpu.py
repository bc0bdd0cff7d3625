"""DeepSpeed ZeRO-2 and ZeRO-3 on 2 CPU processes over gloo (DeepSpeed's CPU accelerator, no CUDA), through
``accelerate launch`` with the shipped examples/accelerate/deepspeed-zero2.yaml and -zero3.yaml.

Against one process on the same global batch, with 2 micro-batches per rank (so DeepSpeed accumulates before it
reduces): the same completions from the same seed (ZeRO-3: sampled from the gathered weights), the same reference
log-probs (ZeRO-3: a partitioned reference), and after one update the same loss, gradient norm, metrics and
weights. Then a 2-step run with the default reference (the starting policy; under ZeRO-3 loaded again rather than
deep-copied from the partitioned policy): finite numbers logged, one checkpoint that from_pretrained loads, a
resume to step 3, evaluations before, during and after training (rank 0 alone generating) that equal one
process evaluating the same weights; and a resume of that run's last checkpoint holds its weights and updates
them like one process resuming the same checkpoint (AdamW's moments included). Slow (one launch per stage,
~20 s on an idle machine; before the first, a session fixture compiles DeepSpeed's shared-memory op where it is
not built: minutes); skipped where DeepSpeed is not installed."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from klgrpo.config.schema import GRPOConfig
from klgrpo.run.metrics import read_metrics
from klgrpo.run.trainer import GRPOTrainer
from klgrpo.train.deepspeed_op import BUILD_BUDGET_S, OpBuildError, ensure_shm_op, is_built, shm_op_folder
from tests.helpers.dist_worker import update_metrics
from tests.test_distributed import (
    EVAL_REWARD,
    ROOT,
    WORKER,
    accelerate_launch,
    check_evaluations_match_one_process,
    config_dict,
    single_process_update,
)

# find_spec, not importorskip: collecting the default suite should not import DeepSpeed (seconds)
NO_DEEPSPEED = importlib.util.find_spec("deepspeed") is None
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(NO_DEEPSPEED, reason="DeepSpeed is not installed (pip install 'klgrpo[deepspeed]')")]
CONFIGS = {2: ROOT / "examples" / "accelerate" / "deepspeed-zero2.yaml",
           3: ROOT / "examples" / "accelerate" / "deepspeed-zero3.yaml"}


@pytest.fixture(scope="session")
def shm_op_built():
    """DeepSpeed's shared-memory op compiled before the first launch (minutes on a fresh or busy machine), so
    that the launch's time limit covers the launch; skipped with the reason where it passes its budget."""
    try:
        ensure_shm_op(budget_s=BUILD_BUDGET_S, log=lambda line: print(line, file=sys.stderr, flush=True))
    except OpBuildError as exc:
        pytest.skip(str(exc))
    assert is_built(shm_op_folder())  # what each rank of the launch then finds: ninja has nothing left to do


def test_every_process_asks_for_the_same_build_of_the_shared_memory_op(tmp_path):
    """A plain process and a launched rank (the launcher's variables) write the same ninja file for the op, so
    the op one of them built is the one every later process loads, without compiling again. A compiler named
    differently ($CXX) changes it: the comparison would see a difference in the build command."""
    def build_file(name, **env):
        out = tmp_path / name
        run_env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"), PYTHONPATH=str(ROOT), **env)
        subprocess.run([sys.executable, str(ROOT / "tests" / "helpers" / "shm_build_file.py"), str(out)],
                       env=run_env, check=True, capture_output=True, timeout=120)
        return out.read_text()

    plain = build_file("plain.ninja")
    rank = build_file("rank.ninja", RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", OMP_NUM_THREADS="1",
                      ACCELERATE_USE_CPU="1", ACCELERATE_USE_DEEPSPEED="true", CUDA_VISIBLE_DEVICES="",
                      PYTHONHASHSEED="7")
    assert rank == plain
    assert " -O2 -fopenmp " in plain and "-march" not in plain  # the op's flags are fixed: no CPU probe
    assert build_file("cxx.ninja", CXX="g++") != plain  # planted difference: the comparison can fail


def deepspeed_config(model_dir, reference_dir, data_file, out):
    cfg = config_dict(model_dir, reference_dir, data_file, out)  # 2 prompts x 4 completions per rank
    cfg["train"]["micro_batch_size"] = 4  # 2 micro-batches per rank
    cfg["kl"].pop("replay")  # refused with DeepSpeed (one line, see docs/distributed.md)
    return cfg


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_on_two_cpu_processes_matches_one_process_and_resumes(stage, shm_op_built, perturbed_model_dir,
                                                                   tiny_model_dir, addition_file, tmp_path):
    cfg_dict = deepspeed_config(perturbed_model_dir, tiny_model_dir, addition_file, tmp_path / "run")
    batch, completions, metrics, _, weights = single_process_update(cfg_dict, tmp_path)
    (tmp_path / "cfg.json").write_text(json.dumps(cfg_dict))
    train_dict = deepspeed_config(perturbed_model_dir, tiny_model_dir, addition_file, tmp_path / "train_run")
    train_dict["kl"].pop("reference")  # the default: the reference is the policy's starting weights
    train_dict["eval"] = {"every": 1, "sets": [  # rank 0 generates alone (ZeRO-3: no DeepSpeed hook may remain)
        {"name": "first", "source": str(addition_file), "limit": 6, "reward": EVAL_REWARD},
        {"name": "second", "source": str(addition_file), "limit": 3, "reward": EVAL_REWARD}]}
    (tmp_path / "train.json").write_text(json.dumps(train_dict))
    accelerate_launch(CONFIGS[stage], [str(WORKER), "deepspeed", str(tmp_path / "cfg.json"),
                                       str(tmp_path / "batch.pt"), str(tmp_path / "out.pt"),
                                       str(tmp_path / "train.json"), str(tmp_path / "train_out.json"),
                                       str(tmp_path / "resumed.pt")])
    out = torch.load(tmp_path / "out.pt", weights_only=False)
    assert (out["kind"], out["world_size"]) == ("deepspeed", 2)
    assert out["completions"] == completions  # same seed, same weights: the same tokens
    # ZeRO-3's reference runs transformers' forward, one process klgrpo's fast path (as FSDP2 in test_distributed)
    torch.testing.assert_close(out["ref_logp"], batch.ref_logp, rtol=0, atol=2e-4)
    check_same_update(out["metrics"], out["weights"], metrics, weights)
    # What a vLLM engine is pushed, each parameter gathered on its own (ZeRO-3), is the full state dict bitwise.
    assert sorted(out["whole_weights"]) == sorted(out["weights"])
    assert all(torch.equal(out["whole_weights"][n], w) for n, w in out["weights"].items())
    check_run_and_resume(train_dict, perturbed_model_dir, json.loads((tmp_path / "train_out.json").read_text()),
                         torch.load(tmp_path / "resumed.pt", weights_only=False), batch, tmp_path)
    check_evaluations_match_one_process(train_dict, perturbed_model_dir)


def check_same_update(got_metrics, got_weights, metrics, weights):
    """DeepSpeed's gradient norm is its own computation over the partitions; the rest is klgrpo's. The weight
    tolerance is test_distributed's: AdamW's first step moves a weight by up to lr = 1e-2, and entries whose
    gradient is near 0 turn float32 rounding of the gradient into up to ~2e-5 there; a micro-batch or rank
    missing from the gradient moves entries the wrong way, by ~1e-2."""
    assert got_metrics.keys() == metrics.keys()
    for k, v in metrics.items():
        assert got_metrics[k] == pytest.approx(v, rel=1e-4, abs=1e-6), k
    assert got_weights.keys() == weights.keys()
    for name, w in weights.items():
        torch.testing.assert_close(got_weights[name], w, rtol=0, atol=1e-4, msg=name)


def check_run_and_resume(train_dict, base_model_dir, train_out, resumed, batch, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run = tmp_path / "train_run"
    assert train_out["kind"] == "deepspeed" and train_out["summary"]["world_size"] == 2
    assert train_out["checkpoints_after_run"] == ["step_2"]
    rows = [r for r in read_metrics(run) if "train/loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]  # 2 steps, then resumed on 2 processes to step 3
    for row in rows:
        assert all(math.isfinite(row[k]) for k in ("train/loss", "grad_norm", "kl/k3", "entropy")), row
    # Step 1 samples from the starting weights, which the reference holds (ZeRO-3: loaded again, partitioned):
    # the KL is float32 rounding (~1e-14), where a reference off by one update would give ~1e-2.
    assert rows[0]["kl/k3"] < 1e-6 < rows[1]["kl/k3"]
    base = AutoModelForCausalLM.from_pretrained(base_model_dir, dtype=torch.float32).state_dict()
    for step in (2, 3):
        loaded = AutoModelForCausalLM.from_pretrained(run / "checkpoints" / f"step_{step}", dtype=torch.float32)
        assert {k: v.shape for k, v in loaded.state_dict().items()} == {k: v.shape for k, v in base.items()}
        assert any(not torch.equal(v, base[k]) for k, v in loaded.state_dict().items())  # it trained

    # The resume holds the checkpoint's weights and AdamW moments (gathered from the ranks' partitions into the
    # single-process layout), and its update equals one process resuming the same checkpoint.
    ckpt = run / "checkpoints" / "step_3"
    saved = load_file(str(ckpt / "model.safetensors"))
    assert all(torch.equal(resumed["resumed"][k], v) for k, v in saved.items())
    one = dict(train_dict, train={**train_dict["train"], "output_dir": str(tmp_path / "one")})
    single = GRPOTrainer(GRPOConfig.from_dict(one), log=lambda *_: None)
    single.resume(str(ckpt))
    moments = single.optimizer.state_dict()["state"]
    assert len(moments) == len(resumed["moments"]) == len(list(single.model.parameters()))
    for i, s in moments.items():
        assert float(s["step"]) == float(resumed["moments"][i]["step"]) == 3.0
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(resumed["moments"][i][k], s[k]) and s[k].abs().sum() > 0, (i, k)
    metrics = update_metrics(single, batch)
    check_same_update(resumed["metrics"], resumed["weights"], metrics, single.model.state_dict())
