"""The step-memory check: a low estimate of the peak bytes one step needs beyond the loaded weights (the rollout's
key/value cache, the update's logits and saved layer inputs), against the memory left where the step runs (CUDA's
free memory; on the CPU the least of the host's available memory, the address-space limit and the cgroup limit).
A step that cannot fit is refused before the first rollout, in one line naming the settings to lower."""

from __future__ import annotations

from typing import Any

from klgrpo.backends.hf import attention_head_size, config_int
from klgrpo.errors import ConfigError

#: A klgrpo.config.schema.GRPOConfig (read by field name only).
GRPOConfig = Any


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def estimate_step_memory(cfg: GRPOConfig, model_config, dtype_bytes: int, longest_prompt: int,
                         world_size: int = 1) -> tuple[int, int]:
    """Low estimates of the peak bytes one step of this rank needs beyond the loaded weights, (rollout, update):
    the two phases never hold their tensors at the same time (the rollout's cache is freed before the update).

    rollout: every sequence of the rank at once (train.micro_batch_size does not split it); the sampler's key/value
        cache holds, per layer, keys and values of (longest prompt + rollout.max_new_tokens) positions per sequence
        (klgrpo's KV loop allocates all of them before the first token; generate's cache grows to that).
    update, per micro-batch: the logits of the completion positions (the forward keeps only those: logits_to_keep)
        in the model's dtype, twice: token_logprobs keeps them for the backward, which allocates a gradient of the
        same shape before it frees them; plus, per layer and position, what autograd keeps for the backward: the
        layer's input (RMSNorm/LayerNorm need it, with gradient checkpointing too), the attention's keys and
        values (its backward reads them) and the MLP's gate and up projections (the gated activation's backward
        reads both; 0 for a config without intermediate_size).
    Everything else (queries, attention scores, the optimizer's moments) is left out: a refused step does not fit
    once a batch holds the longest prompt and completions of full length, and one that passes may still need
    more.
    """
    r = cfg.rollout
    sequences = r.prompts_per_step * r.group_size // world_size
    micro = min(cfg.train.micro_batch_size or sequences, sequences)
    positions = longest_prompt + r.max_new_tokens

    def field(name: str, default: int = 0) -> int:
        return config_int(model_config, name, default)

    layers, vocab = field("num_hidden_layers"), field("vocab_size")
    hidden, heads = field("hidden_size"), field("num_attention_heads", 1)
    kv_width = field("num_key_value_heads", heads) * attention_head_size(model_config)
    rollout = sequences * positions * layers * 2 * kv_width * dtype_bytes
    kept_per_position = hidden + 2 * kv_width + 2 * field("intermediate_size")
    update = micro * (2 * r.max_new_tokens * vocab + positions * layers * kept_per_position) * dtype_bytes
    return rollout, update


def available_memory_bytes(device) -> int | None:
    """Free memory where the step runs: CUDA's free device memory, or on the CPU the least of the host's
    available physical memory (MemAvailable, else the free pages), what this process's address-space limit
    (RLIMIT_AS, ``ulimit -v``) leaves and what its cgroup's memory limit leaves (a container's); None where it
    cannot be known (MPS, other devices)."""
    if device.type == "cuda":
        import torch

        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    found = [v for v in (_host_available(), address_space_left(), cgroup_memory_left()) if v is not None]
    return min(found) if found else None


def _host_available() -> int | None:
    import os

    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def address_space_left(status: str = "/proc/self/status") -> int | None:
    """RLIMIT_AS's soft limit minus this process's virtual size (VmSize); None without a limit."""
    try:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    except (ImportError, OSError, ValueError):
        return None
    if limit == resource.RLIM_INFINITY or limit < 0:
        return None
    return max(limit - (_status_kib(status, "VmSize:") or 0) * 1024, 0)


def cgroup_memory_left(root: str = "/sys/fs/cgroup", own: str = "/proc/self/cgroup") -> int | None:
    """This process's cgroup memory limit minus its usage (cgroup v2 memory.max / memory.current, else v1's
    memory.limit_in_bytes / memory.usage_in_bytes); None without a limit or a readable cgroup."""
    from pathlib import Path

    path = ""
    try:
        for line in Path(own).read_text().splitlines():
            if line.startswith("0::"):
                path = line[3:].strip().lstrip("/")
    except OSError:
        pass
    for folder, limit_file, usage_file in ((Path(root) / path, "memory.max", "memory.current"),
                                           (Path(root), "memory.max", "memory.current"),
                                           (Path(root) / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes")):
        try:
            limit = (folder / limit_file).read_text().strip()
            usage = int((folder / usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if not limit.isdigit() or int(limit) >= 2 ** 60:  # "max", or v1's "no limit" (about 2**63)
            return None
        return max(int(limit) - usage, 0)
    return None


def _status_kib(status: str, key: str) -> int | None:
    try:
        with open(status) as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_step_memory(cfg: GRPOConfig, model, longest: int, world_size: int = 1, device=None,
                      available_bytes: int | None = None, reward_model_bytes: int = 0) -> None:
    """Refuse, before the first rollout, a step that cannot fit (estimate_step_memory) in the memory left on
    ``device`` (``available_bytes`` if given): without it such a run grinds in swap or dies without a word.
    ``longest``: the tokens of the longest prompt (core.rollout.longest_prompt_tokens). ``reward_model_bytes``: the
    weights of the reward models, loaded after this check and held through every phase."""
    weight = next(model.parameters())
    device = device or weight.device
    available = available_bytes if available_bytes is not None else available_memory_bytes(device)
    if available is None:
        return
    model_config = getattr(model, "config", None)
    if hasattr(model_config, "get_text_config"):  # a multimodal model's language part holds these fields
        model_config = model_config.get_text_config()
    rollout, update = estimate_step_memory(cfg, model_config, weight.dtype.itemsize, longest, world_size)
    r, gib = cfg.rollout, 2 ** 30
    sequences = f"rollout.prompts_per_step={r.prompts_per_step} x rollout.group_size={r.group_size} sequences"
    length = f"of up to {longest} prompt + rollout.max_new_tokens={r.max_new_tokens} tokens"
    free = f"but {available / gib:.2f} GiB are free on {device}"
    _need(reward_model_bytes <= available,
          f"the reward models' weights need {reward_model_bytes / gib:.2f} GiB {free}; give a reward model a "
          f"smaller dtype (dtype in its rewards.functions entry) or use a smaller one")
    rm = f" (with the reward models' {reward_model_bytes / gib:.2f} GiB)" if reward_model_bytes else ""
    _need(rollout + reward_model_bytes <= available,
          f"the rollout needs at least {(rollout + reward_model_bytes) / gib:.2f} GiB{rm} {free}: {sequences} "
          f"{length}, all sampled at once; lower them (fewer sequences per step, shorter completions); "
          f"train.micro_batch_size splits only the update, not the rollout")
    _need(update + reward_model_bytes <= available,
          f"the update needs at least {(update + reward_model_bytes) / gib:.2f} GiB{rm} {free}: {sequences} {length}; "
          f"set train.micro_batch_size (sequences per forward/backward) or use fewer sequences per step")
