"""On a CUDA device (skipped elsewhere): each sampler trains, the samplers agree token for token from one seed,
the bf16 log-prob fast path agrees with transformers, and kl.estimator full runs.

Run them with ``python -m pytest -q -m gpu tests/test_gpu.py`` on a machine with a GPU.
"""

from __future__ import annotations

import pytest
import torch

from klgrpo.backends.samplers import SAMPLERS
from klgrpo.core.forward import completion_logprobs
from klgrpo.core.rollout import SamplingParams, generate_groups
from tests.helpers.configs import make_config

pytestmark = pytest.mark.gpu


def _qwen2(dtype):
    """A small Qwen2 (GQA, q/k/v biases) on the GPU, random init with non-trivial norms and biases."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=256, max_position_embeddings=128, pad_token_id=0,
                      eos_token_id=1, bos_token_id=None, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "bias" in name or "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model.to("cuda", dtype)


def _tokenizer():
    from klgrpo.apps.demo.tokenizer import build_char_tokenizer

    return build_char_tokenizer()


@pytest.mark.parametrize("sampler", ["auto", *(s for s in SAMPLERS if s != "vllm_server")])  # that one needs a server
def test_one_training_step_on_cuda_with_each_sampler(tiny_model_dir, addition_file, tmp_path, sampler):
    from klgrpo.run.trainer import GRPOTrainer

    lines = []
    cfg = make_config(tiny_model_dir, addition_file, tmp_path / "run", model={"device": "cuda", "dtype": "float32"},
                      rollout={"sampler": sampler}, train={"steps": 1})
    trainer = GRPOTrainer(cfg, log=lines.append)
    summary = trainer.train()
    assert summary["steps"] == 1
    assert trainer.grpo_step.sampler.name == ("generate_static" if sampler == "auto" else sampler)
    assert next(trainer.model.parameters()).device.type == "cuda"
    assert any(line.startswith(f"sampler: {trainer.grpo_step.sampler.name} ") for line in lines)


def test_static_generate_draws_the_dynamic_generate_tokens_from_one_seed():
    """float32 on the GPU: the two caches give logits equal far below a sampling flip for this small model, so
    one seed draws the same tokens (a real cache bug changes them at once)."""
    model, tok = _qwen2(torch.float32), _tokenizer()
    model.config.vocab_size = len(tok)
    runs = []
    for sampler in ("generate", "generate_static"):
        torch.manual_seed(11)
        runs.append(generate_groups(model, tok, ["12+3=", "7-1=", "99+99="], SamplingParams(
            group_size=4, max_new_tokens=12, temperature=0.9, sampler=sampler)))
    dynamic, static = runs
    assert dynamic.completion_ids.shape[1] > 1
    assert torch.equal(dynamic.completion_ids, static.completion_ids)
    assert torch.equal(dynamic.completion_mask, static.completion_mask)


def test_bf16_logprob_fast_path_agrees_with_transformers():
    """bf16 weights, float32 log-probs: klgrpo's decoder against transformers' forward on the same sampled batch.
    bf16 rounds every matmul to ~3 significant digits, so the two differ by rounding, well under 0.1 nats on this
    model; a wrong mask or position shifts them by whole nats."""
    model, tok = _qwen2(torch.bfloat16), _tokenizer()
    model.config.vocab_size = len(tok)
    torch.manual_seed(0)
    batch = generate_groups(model, tok, ["12+3=", "7-1=", "99+99="], SamplingParams(
        group_size=4, max_new_tokens=12, sampler="generate"))
    with torch.no_grad():
        fast, _ = completion_logprobs(model, batch, 1.0, fast_path=True)
        ref, _ = completion_logprobs(model, batch, 1.0, fast_path=False)
    mask = batch.completion_mask
    assert fast.dtype == torch.float32 and mask.sum() > 12
    assert (fast[mask] - ref[mask]).abs().max() < 0.1
    assert (fast[mask] - ref[mask]).abs().mean() < 0.02


def test_full_vocabulary_kl_trains_on_cuda(tiny_model_dir, addition_file, tmp_path):
    """kl.estimator full on the GPU: the first step's policy is the reference (log-ratios 0 up to float32
    rounding between two forward implementations), the second step's has moved (a positive KL)."""
    import json

    from klgrpo.run.trainer import GRPOTrainer

    cfg = make_config(tiny_model_dir, addition_file, tmp_path / "run", model={"device": "cuda", "dtype": "float32"},
                      kl={"coef": 0.1, "estimator": "full"}, train={"steps": 2})
    summary = GRPOTrainer(cfg, log=lambda *_: None).train()
    assert summary["steps"] == 2
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    first, second = rows[0], rows[1]
    assert abs(first["kl/k1"]) < 1e-5 and first["kl/max"] < 1e-5
    assert 0.0 < second["kl/k3"] < 10.0 and second["kl/max"] > 0.0


def test_warm_up_leaves_no_shape_for_the_batches_to_compile():
    """On CUDA the static cache's generate compiles one kernel per cache shape: after warm_up_sampler over the
    data's prompts, batches of those prompts at every width compile nothing more (dynamo's graph count stays)."""
    from torch._dynamo.utils import counters

    from klgrpo.core.rollout import warm_up_sampler

    tok, model = _tokenizer(), _qwen2(torch.bfloat16)
    prompts = ["1+1=", "12+34=" * 8, "7-3=" * 20]  # 4, 48 and 80 tokens: widths 64 and 128
    params = SamplingParams(group_size=2, max_new_tokens=8, sampler="generate_static")
    widths = warm_up_sampler(model, tok, prompts, params, prompts_per_batch=2)
    assert widths == [64, 128]
    graphs = counters["stats"]["unique_graphs"]
    for batch in (prompts[:2], prompts[1:], prompts[::2]):
        generate_groups(model, tok, batch, params)
    assert counters["stats"]["unique_graphs"] == graphs
