"""The colocated vLLM engine's cycle between rollouts, against a stand-in for ``vllm.LLM`` that records what it is
asked (no vLLM needed): when the weights are pushed, and on CUDA the sleep mode's order (sleep after each
rollout; wake the weights, push, wake the KV cache, generate). The real engine runs in tests/test_vllm.py."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from klgrpo.backends import vllm_sampler
from klgrpo.backends.sampling import SamplingParams
from klgrpo.backends.vllm_sampler import Engine, VLLMSampler


def Params():
    return SamplingParams(group_size=2, max_new_tokens=3)


class FakeLLM:
    """Records every call; generates token 7 with log-prob -0.5, G completions per prompt."""

    def __init__(self):
        self.calls = []
        self.pushed = {}

    def collective_rpc(self, method, kwargs):
        self.pushed = dict(kwargs["weights_iterator"])
        self.calls.append(("push", len(self.pushed)))

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake", tuple(tags)))

    def generate(self, prompts, sampling, use_tqdm):
        self.calls.append(("generate", len(prompts)))
        completion = types.SimpleNamespace(index=0, token_ids=[7], logprobs=[{7: types.SimpleNamespace(logprob=-0.5)}])
        return [types.SimpleNamespace(outputs=[completion] * sampling.n) for _ in prompts]


@pytest.fixture(autouse=True)
def fake_vllm_modules(monkeypatch):
    """Engine.generate imports vLLM's SamplingParams and TokensPrompt: plain stand-ins here."""
    vllm = types.ModuleType("vllm")
    vllm.SamplingParams = lambda **kw: types.SimpleNamespace(**kw)
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = lambda prompt_token_ids: prompt_token_ids
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)


def rollout(engine, model, version=0):
    engine.sync(model, version)
    ids, mask = torch.tensor([[1, 2, 3]]), torch.ones(1, 3, dtype=torch.long)
    return engine.generate(ids, mask, Params(), pad_id=0, eos_ids=[0])


def test_weights_are_pushed_once_per_change_and_the_sampled_logprobs_kept():
    model, llm = torch.nn.Linear(2, 2), FakeLLM()
    engine = Engine(llm, sleeps=False)
    ids, logp = rollout(engine, model)
    assert ids.tolist() == [[7], [7]] and logp.tolist() == [[-0.5], [-0.5]]
    rollout(engine, model)  # nothing changed: no second push
    rollout(engine, model, version=1)  # an optimizer step: the step's weights version moved
    with torch.no_grad():
        model.weight.add_(1.0)  # a load into the parameters (a resume, a rollback)
    rollout(engine, model, version=1)
    assert [c for c in llm.calls if c[0] == "push"] == [("push", 2)] * 3
    assert torch.equal(llm.pushed["weight"], model.weight)
    assert not any(c[0] in ("sleep", "wake") for c in llm.calls)  # the CPU: never asleep


def test_on_cuda_the_engine_sleeps_after_each_rollout_and_wakes_in_order():
    """Level 2 frees the weights: the next rollout pushes them again even when they did not change."""
    model, llm = torch.nn.Linear(2, 2), FakeLLM()
    engine = Engine(llm, sleeps=True)
    rollout(engine, model)
    rollout(engine, model)  # unchanged weights: pushed all the same (the sleeping engine dropped them)
    first = [("push", 2), ("generate", 1), ("sleep", 2)]  # started awake
    again = [("wake", ("weights",)), ("push", 2), ("wake", ("kv_cache",)), ("generate", 1), ("sleep", 2)]
    assert llm.calls == first + again
    assert engine.asleep == {"weights", "kv_cache"} and engine.pushes == 2


def test_a_failed_generation_still_puts_the_engine_to_sleep():
    model, llm = torch.nn.Linear(2, 2), FakeLLM()

    def broken(*_, **__):
        raise RuntimeError("out of memory")

    llm.generate = broken
    engine = Engine(llm, sleeps=True)
    with pytest.raises(RuntimeError):
        rollout(engine, model)
    assert llm.calls[-1] == ("sleep", 2) and engine.pushed is None


def test_the_engine_is_started_with_the_sleep_mode_on_cuda_only(monkeypatch):
    started = []
    vllm = sys.modules["vllm"]
    vllm.LLM = lambda **kw: started.append(kw) or FakeLLM()
    config = types.SimpleNamespace(save_pretrained=lambda folder: None, max_position_embeddings=64)
    vllm_sampler._start(config, torch.float32, torch.device("cuda"), 0.3)
    vllm_sampler._start(config, torch.float32, torch.device("cpu"), 0.01)
    assert started[0]["enable_sleep_mode"] is True and started[0]["gpu_memory_utilization"] == 0.3
    assert "enable_sleep_mode" not in started[1] and started[1]["kv_cache_memory_bytes"] > 0


def test_a_run_owns_its_engine_started_at_the_first_rollout_and_shut_down_by_close(monkeypatch):
    """No engine table in the process: each VLLMSampler starts its own at its first use, pushes the weights when
    the step's version moves, and close() lets it go (a later use starts a new one and pushes again)."""
    started = []
    monkeypatch.setattr(vllm_sampler, "_start", lambda *a: started.append(a) or FakeLLM())
    monkeypatch.setattr(vllm_sampler, "base_model", lambda model: types.SimpleNamespace(
        config=types.SimpleNamespace(to_json_string=lambda use_diff: "linear")))
    model = torch.nn.Linear(2, 2)
    first, second = VLLMSampler.open(), VLLMSampler.open()
    assert first.holds_weights and first.engine is None and not started
    assert first.sync_weights(model, 0) and not first.sync_weights(model, 0)  # started, pushed once
    assert first.sync_weights(model, 1)  # an optimizer step
    second.sync_weights(model, 1)
    assert len(started) == 2 and first.engine is not second.engine  # one engine per run
    ids, mask = torch.tensor([[1, 2, 3]]), torch.ones(1, 3, dtype=torch.long)
    drawn = first.sample(model, ids, mask, Params(), pad_id=0, eos_ids=[0])
    assert drawn.weights_version == 1 and drawn.logp.tolist() == [[-0.5], [-0.5]]
    assert first.engine.pushes == 2  # nothing new to push before the rollout
    first.close()
    assert first.engine is None
    first.sample(model, ids, mask, Params(), pad_id=0, eos_ids=[0])
    assert len(started) == 3 and first.engine.pushes == 1  # a new engine, given the weights at once
