"""Read a config file for ``klgrpo explain``: detect its format and map it onto klgrpo's config.

    trl        a YAML/JSON mapping of TRL GRPOConfig fields (what ``trl grpo --config`` takes)
    unsloth    the same with the adaptive-KL fields (kl_adaptation_method, kl_target, ...)
    verl       verl's Hydra YAML (actor_rollout_ref:, algorithm:, ...) or key=value overrides, one per line
    openrlhf   an OpenRLHF command line (``--algo.kl.init_coef 0.01 --algo.kl.use_loss ...``) in a text file
    klgrpo     a klgrpo config (model:, kl:, loss:, ...)
"""

from __future__ import annotations

import difflib
import re
import shlex
from pathlib import Path
from typing import Any

import yaml

from klgrpo.errors import ConfigError
from klgrpo.mapping import Mapped
from klgrpo.openrlhf_mapping import map_openrlhf, parse_flags
from klgrpo.train.config import GRPOConfig, all_field_paths
from klgrpo.trl_mapping import ADAPTIVE_KL_DEFAULTS, TRL_DEFAULTS, map_trl
from klgrpo.verl_mapping import ROOTS as VERL_ROOTS
from klgrpo.verl_mapping import map_verl

FORMATS = ("trl", "verl", "openrlhf", "unsloth", "klgrpo")
KLGRPO_GROUPS = tuple(f.name for f in GRPOConfig.__dataclass_fields__.values())
_OVERRIDE = re.compile(r"^\+?[A-Za-z_][\w.]*=")
#: Types of the TRL / adaptive-KL fields whose default is None (the others: their default's type).
_NONE_DEFAULT_TYPES = {"epsilon_high": float, "delta": float, "steps_per_generation": int,
                       "off_policy_mask_threshold": float, "kl_importance_weight": str, "kl_controller": str,
                       "reward_weights": list}
#: TRL fields that change speed, memory or logging only (the rest, when set, is listed as not read).
TRL_SPEED_ONLY = ("use_vllm", "vllm_mode", "vllm_gpu_memory_utilization", "gradient_checkpointing", "bf16", "fp16",
                  "per_device_train_batch_size", "logging_steps", "output_dir", "report_to", "save_steps",
                  "save_strategy", "torch_compile", "use_liger_kernel", "ds3_gather_for_generation",
                  "dataloader_num_workers", "log_completions", "logging_dir", "run_name", "seed")


def read_text(path: str) -> tuple[str, str]:
    """(text, origin) of FILE or '-' (standard input)."""
    if path == "-":
        import sys

        return sys.stdin.read(), "<stdin>"
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{path}: no such file; pass a config file (or - for standard input)")
    try:
        return p.read_text(encoding="utf-8"), path
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not UTF-8 text; pass a YAML, JSON or command-line text file") from None


def _flatten(data: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _overrides(text: str) -> dict[str, Any] | None:
    """key=value lines (comments and blank lines skipped) -> {key: YAML value}, or None if not that format."""
    lines = [line.strip() for line in text.splitlines()]
    lines = [line for line in lines if line and not line.startswith("#")]
    if not lines or not all(_OVERRIDE.match(line) for line in lines):
        return None
    out = {}
    for line in lines:
        key, value = line.lstrip("+").split("=", 1)
        out[key.strip()] = yaml.safe_load(value) if value.strip() else None
    return out


def _parse(text: str, origin: str) -> tuple[str, Any]:
    """("mapping" | "overrides" | "flags", parsed) by the text's shape."""
    overrides = _overrides(text)
    if overrides is not None:
        return "overrides", overrides
    tokens = shlex.split(text.replace("\\\n", " "), comments=True)
    if any(token.startswith("--") for token in tokens):
        return "flags", tokens
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        data = None
    if not isinstance(data, dict) or not data:
        raise ConfigError(f"{origin} is none of the formats klgrpo explain reads (a YAML or JSON mapping of TRL, "
                          "Unsloth, verl or klgrpo fields, verl key=value lines, an OpenRLHF command line)")
    return "mapping", data


def _candidates(shape: str, data: Any) -> list[str]:
    if shape == "flags":
        return ["openrlhf"]
    if shape == "overrides":
        return ["verl"]
    top = set(data)
    nested = all(isinstance(value, dict) for value in data.values())
    found = []
    if nested and top <= set(KLGRPO_GROUPS):
        found.append("klgrpo")
    if top & set(VERL_ROOTS) and {key.split(".")[0] for key in top} <= set(VERL_ROOTS):
        found.append("verl")
    if not nested:
        found.append("unsloth" if top & set(ADAPTIVE_KL_DEFAULTS) else "trl")
    return found


def load_source(text: str, origin: str, source: str | None = None) -> tuple[str, Mapped]:
    """(format, mapped config) of the text; ``source`` forces the format."""
    shape, data = _parse(text, origin)
    if source is None:
        found = _candidates(shape, data)
        if len(found) != 1:
            keys = ", ".join(sorted(map(str, data)))[:80] if shape == "mapping" else shape
            raise ConfigError(f"{origin} could be {' or '.join(found) or 'none of the formats'} (top-level keys: "
                              f"{keys}); pass --from {'|'.join(found or FORMATS)}")
        source = found[0]
    if source == "openrlhf":
        if shape != "flags":
            raise ConfigError(f"{origin} holds no --flags; an OpenRLHF config is its command line")
        return source, map_openrlhf(parse_flags(data, origin), origin)
    if shape == "flags":
        raise ConfigError(f"{origin} is a command line; only --from openrlhf reads one")
    if source == "verl":
        return source, map_verl(data if shape == "overrides" else _flatten(data), origin)
    if shape == "overrides":
        raise ConfigError(f"{origin} holds key=value lines; only --from verl reads them")
    if source == "klgrpo":
        return source, _klgrpo(data, origin)
    return source, _trl(data, origin, adaptive=source == "unsloth")


def _trl(data: dict, origin: str, adaptive: bool) -> Mapped:
    known = _trl_field_names(adaptive)
    for key, value in data.items():
        if key not in known:
            close = difflib.get_close_matches(str(key), sorted(known), n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            what = "TRL GRPOConfig or adaptive-KL" if adaptive else "TRL GRPOConfig"
            raise ConfigError(f"{origin}: unknown {what} field {key!r}{hint}")
        _check_trl_type(key, value, origin)
    mapped = map_trl(data)
    read = set(TRL_DEFAULTS) | set(ADAPTIVE_KL_DEFAULTS)
    mapped.ignored = [key for key in data if key in TRL_SPEED_ONLY]
    for key in data:
        if key not in read and key not in TRL_SPEED_ONLY and key not in mapped.unmapped:
            mapped.unmapped[key] = "not read by the mapping: check that it does not change the objective"
    return mapped


def _trl_field_names(adaptive: bool) -> set[str]:
    try:
        import dataclasses

        import trl
    except ImportError:
        raise ConfigError('reading a TRL config needs TRL\'s field names: pip install "klgrpo[trl]"') from None
    names = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    return names | set(ADAPTIVE_KL_DEFAULTS) if adaptive else names


def _check_trl_type(key: str, value: Any, origin: str) -> None:
    defaults = {**TRL_DEFAULTS, **ADAPTIVE_KL_DEFAULTS}
    if key not in defaults or value is None or key == "scale_rewards":
        return
    kind = _NONE_DEFAULT_TYPES.get(key) or type(defaults[key])
    kinds = (int, float) if kind in (int, float) else (kind,)
    if isinstance(value, bool) and kind is not bool or not isinstance(value, kinds) or \
            kind is int and isinstance(value, float) and not value.is_integer():
        name = {bool: "true or false", str: "a name", list: "a list", int: "an integer"}.get(kind, "a number")
        raise ConfigError(f"{origin}: {key} must be {name}, got {value!r}")


def _klgrpo(data: dict, origin: str) -> Mapped:
    cfg = GRPOConfig.from_dict(data, origin=origin)  # unknown keys and wrong types: one line each
    values = dict(_flatten(cfg.to_dict()))
    keys = [path for path, _ in all_field_paths() if path.startswith(("kl.", "loss.", "train.num_iterations"))]
    return Mapped(config={key: values[key] for key in keys}, off_policy=cfg.train.num_iterations > 1)
