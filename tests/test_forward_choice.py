"""model.forward: klgrpo's teacher-forced decoder (fast) and transformers' forward give the same log-probs and
gradients through the same log-prob head, the setting reaches the training forward and the reference, and auto
is the forward measured faster on the device (benchmarks/results/forward_choice_<device>.json)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from klgrpo.core.forward import FORWARDS, MEASURED_FASTER, completion_logprobs, uses_fast_forward
from tests.test_rollout_sampler import BUILDERS, _group_batch, _randomise

ROOT = Path(__file__).resolve().parents[1]


def _logp_entropy_grad(model, batch, fast: bool, weights):
    model.zero_grad()
    logp, entropy = completion_logprobs(model, batch, temperature=0.8, with_entropy=True, fast_path=fast)
    (logp * weights * batch.completion_mask).sum().backward()
    grad = torch.cat([p.grad.reshape(-1).float() for p in model.parameters() if p.grad is not None])
    return logp.detach(), entropy.detach(), grad


@pytest.mark.parametrize("arch", list(BUILDERS))
def test_float32_fast_and_transformers_forwards_agree(arch):
    """float32 weights: the two forwards' log-probs and entropies agree to 1e-5 and their gradients to 1e-5
    relative (float32 rounding of two summation orders; a wrong mask or position is off by whole units)."""
    torch.manual_seed(0)
    model = _randomise(BUILDERS[arch]())
    batch = _group_batch()
    weights = torch.randn(batch.completion_ids.shape)
    (lp_f, ent_f, g_f), (lp_t, ent_t, g_t) = (_logp_entropy_grad(model, batch, fast, weights) for fast in (True, False))
    mask = batch.completion_mask
    assert lp_f.dtype == torch.float32
    torch.testing.assert_close(lp_f[mask], lp_t[mask], rtol=0, atol=1e-5)
    torch.testing.assert_close(ent_f[mask], ent_t[mask], rtol=0, atol=1e-5)
    torch.testing.assert_close(g_f, g_t, rtol=1e-5, atol=1e-5 * g_t.abs().max().item())
    assert g_t.abs().max() > 1e-3  # not a comparison of zeros


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_bf16_fast_and_transformers_forwards_agree_within_rounding(arch):
    """bf16 weights on the CPU, float32 log-probs: the bounds tests/test_gpu.py sets on the GPU (max < 0.1 nats,
    mean < 0.02), and gradients pointing the same way (cosine > 0.99)."""
    torch.manual_seed(0)
    model = _randomise(BUILDERS[arch]()).to(torch.bfloat16)
    batch = _group_batch()
    weights = torch.randn(batch.completion_ids.shape)
    (lp_f, _, g_f), (lp_t, _, g_t) = (_logp_entropy_grad(model, batch, fast, weights) for fast in (True, False))
    mask = batch.completion_mask
    assert lp_f.dtype == torch.float32
    assert (lp_f[mask] - lp_t[mask]).abs().max() < 0.1
    assert (lp_f[mask] - lp_t[mask]).abs().mean() < 0.02
    assert torch.nn.functional.cosine_similarity(g_f, g_t, dim=0) > 0.99


@pytest.mark.parametrize("choice,fast_path,device,expected", [
    ("fast", True, "cpu", True), ("transformers", True, "cpu", False),
    ("auto", True, "cpu", MEASURED_FASTER["cpu"] == "fast"),
    ("auto", True, "xpu", True),  # no measurement: the fast path, as before model.forward existed
    ("auto", False, "cpu", False), ("transformers", False, "cuda", False),  # fast_path false: transformers
])
def test_model_forward_resolves(choice, fast_path, device, expected):
    assert uses_fast_forward(choice, fast_path, device) is expected


def test_auto_is_the_measured_faster_forward():
    """MEASURED_FASTER holds, per device type, the forward with the lower update + reference time in its results
    file, and docs/benchmarks.md's table shows those files' numbers."""
    docs = (ROOT / "docs" / "benchmarks.md").read_text()
    files = sorted((ROOT / "benchmarks" / "results").glob("forward_choice_*.json"))
    assert files
    for path in files:
        result = json.loads(path.read_text())
        assert result["command"].startswith("python benchmarks/forward_choice.py")
        totals = {name: 0.0 for name in ("fast", "transformers")}
        for row in result["rows"]:
            for name in totals:
                totals[name] += row[name]["update_s"] + row[name]["reference_s"]
            cells = [row["setting"]] + [f"{1000 * row[n][k]:.1f}" for n in ("fast", "transformers")
                                        for k in ("update_s", "reference_s")]
            assert "| " + " | ".join(cells) + " |" in docs, cells
        assert MEASURED_FASTER[result["device_type"]] == min(totals, key=totals.get), path.name


def test_fast_with_fast_path_false_is_refused(tiny_model_dir, addition_file, tmp_path):
    from klgrpo.config.validation import validate_config
    from klgrpo.errors import ConfigError
    from tests.helpers.configs import make_config

    assert FORWARDS == ("auto", "fast", "transformers")
    cfg = make_config(tiny_model_dir, addition_file, tmp_path / "r", model={"fast_path": False, "forward": "fast"})
    with pytest.raises(ConfigError, match="model.forward fast with model.fast_path false"):
        validate_config(cfg)
    validate_config(make_config(tiny_model_dir, addition_file, tmp_path / "r", model={"fast_path": False}))


@pytest.mark.parametrize("choice", ["fast", "transformers"])
def test_model_forward_reaches_the_update_and_the_reference(tiny_model_dir, addition_file, tmp_path, monkeypatch,
                                                            choice):
    """model.forward fast: the update's and the reference's log-probs go through the decoder's teacher-forced
    pass; transformers: never (the sampler is the KV loop either way)."""
    from klgrpo.backends.kv_decoder import KVSampler
    from klgrpo.run.trainer import GRPOTrainer
    from tests.helpers.configs import make_config, quiet

    calls = []
    original = KVSampler.teacher_forced_logits

    def spy(self, *args, **kwargs):
        calls.append(torch.is_grad_enabled())
        return original(self, *args, **kwargs)

    monkeypatch.setattr(KVSampler, "teacher_forced_logits", spy)
    cfg = make_config(tiny_model_dir, addition_file, tmp_path / "run", model={"forward": choice}, train={"steps": 1})
    trainer = GRPOTrainer(cfg, log=quiet)
    trainer.train()
    assert trainer.grpo_step.sampler.name == "kv_loop"
    # one no-grad call (the reference) and one with gradients (the update) per step, or none
    assert sorted(calls) == ([False, True] if choice == "fast" else [])


def test_length_chunks_minimise_padded_positions():
    """Hand-worked: prompt 2, lengths 10, 1, 9, 1 (sorted 10, 9, 1, 1). One chunk: 4 x 12 = 48 positions;
    {10, 9} + {1, 1}: 2 x 12 + 2 x 3 = 30. With a fixed cost of 10 per chunk, 58 vs 50: two chunks; with 20,
    68 vs 70: one chunk, whole rows in order (None)."""
    from klgrpo.core import forward

    lengths = torch.tensor([10, 1, 9, 1])
    for overhead, expected in ((10, [([0, 2], 10), ([1, 3], 1)]), (20, [(None, 10)])):
        forward.CHUNK_OVERHEAD_POSITIONS["test"] = overhead
        try:
            chunks = forward.length_chunks(lengths, 2, "test")
        finally:
            del forward.CHUNK_OVERHEAD_POSITIONS["test"]
        assert [(None if i is None else i.tolist(), w) for i, w in chunks] == expected
    assert forward.length_chunks(torch.tensor([0, 0]), 3, "cpu") == [(None, 1)]  # a width of at least 1


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "transformers"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_length_chunks_change_no_completion_logprob(arch, fast, monkeypatch):
    """Rows run in length-sorted chunks, each cut to its longest completion and its prompts' shared left padding
    (forced here: no fixed cost per chunk) give the log-probs, entropies and gradients of one full-width pass
    (float64: to 1e-10, gradients to float32 rounding); positions past a completion read 0."""
    from klgrpo.core import forward

    torch.manual_seed(0)
    model = _randomise(BUILDERS[arch]()).to(torch.float64)
    batch = _group_batch(group_size=3)
    mask = batch.completion_mask
    lengths = mask.sum(1)
    assert len(set(lengths.tolist())) > 1  # rows of different lengths, so there is something to cut
    weights = torch.randn(batch.completion_ids.shape, dtype=torch.float64)
    results = []
    for overhead in (10 ** 9, 0):  # one chunk; then as many as the lengths allow
        monkeypatch.setitem(forward.CHUNK_OVERHEAD_POSITIONS, "cpu", overhead)
        assert (len(forward.length_chunks(lengths, batch.prompt_len, "cpu")) > 1) == (overhead == 0)
        model.zero_grad()
        logp, entropy = completion_logprobs(model, batch, 0.8, with_entropy=True, fast_path=fast)
        (logp * weights * mask).sum().backward()
        results.append((logp.detach(), entropy.detach(),
                        torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])))
    (lp_one, ent_one, g_one), (lp_cut, ent_cut, g_cut) = results
    torch.testing.assert_close(lp_cut[mask], lp_one[mask], rtol=0, atol=1e-10)
    torch.testing.assert_close(ent_cut[mask], ent_one[mask], rtol=0, atol=1e-10)
    torch.testing.assert_close(g_cut, g_one, rtol=1e-5, atol=1e-6)
    assert (lp_cut[~mask] == 0).all() and (~mask).any()
