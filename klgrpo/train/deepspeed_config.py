"""The DeepSpeed settings an ``accelerate launch`` hands every process (its ACCELERATE_DEEPSPEED_* variables and
the JSON file its ``deepspeed_config_file`` names), checked before accelerate or DeepSpeed reads them. A value
they do not accept (a ZeRO stage 7, an offload device "gpu", a file that is not a JSON object) ended in a
traceback on every rank, or in a pydantic error on one while the others waited in the process group; here each
process refuses it the same way, in one line naming the field, before any process group exists."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping

from klgrpo.errors import ConfigError

STAGES = (0, 1, 2, 3)
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
#: Top-level fields of a DeepSpeed JSON file that hold a count ("auto" lets accelerate fill it in).
_COUNTS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_FIX = "fix it (examples/accelerate/deepspeed-zero2.yaml shows a working config)"


def check_deepspeed_settings(env: Mapping[str, str] = os.environ) -> None:
    """Refuse (ConfigError) a DeepSpeed launch whose settings DeepSpeed would not accept; nothing without one."""
    if env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() not in ("1", "true", "yes"):
        return
    where = "the accelerate config's deepspeed_config"
    if (stage := env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")) is not None:
        _stage(stage.strip(), f"{where}.zero_stage")
    for var, name in (("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "offload_optimizer_device"),
                      ("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "offload_param_device")):
        if (device := env.get(var)) is not None and device not in OFFLOAD_DEVICES:
            raise ConfigError(f"{where}.{name} must be one of {', '.join(OFFLOAD_DEVICES)}, got {device!r}; {_FIX}")
    steps = env.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS")
    if steps is not None and steps != "auto" and not (steps.isdigit() and int(steps) >= 1):
        raise ConfigError(f"{where}.gradient_accumulation_steps must be a whole number >= 1, got {steps!r}; {_FIX}")
    clipping = env.get("ACCELERATE_GRADIENT_CLIPPING")
    if clipping is not None and clipping != "auto":
        _clipping(_float(clipping), f"{where}.gradient_clipping")
    path = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    if path != "none":
        check_deepspeed_file(path)


def check_deepspeed_file(path: str) -> None:
    """A deepspeed_config_file that accelerate and DeepSpeed can read: a JSON object with a zero_optimization
    object, a ZeRO stage 0-3, known offload devices, counts >= 1 and a finite clipping >= 0 ("auto" anywhere)."""
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except OSError as exc:
        raise ConfigError(f"the DeepSpeed config file {path} cannot be read ({exc.strerror or exc}); pass an "
                          f"existing deepspeed_config_file") from None
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise ConfigError(f"the DeepSpeed config file {path} is not valid JSON ({str(exc)[:80]}); {_FIX}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"the DeepSpeed config file {path} holds a {type(config).__name__}, not a JSON object; "
                          f"{_FIX}")
    zero = config.get("zero_optimization")
    if not isinstance(zero, dict):
        raise ConfigError(f"the DeepSpeed config file {path}: zero_optimization must be an object (with its "
                          f"stage), got {zero!r}; {_FIX}")
    if "stage" in zero:
        _stage(zero["stage"], f"{path}: zero_optimization.stage")
    for name in ("offload_optimizer", "offload_param"):
        offload = zero.get(name)
        if offload is None:
            continue
        device = offload.get("device", "none") if isinstance(offload, dict) else offload
        if device not in (*OFFLOAD_DEVICES, "auto"):
            raise ConfigError(f"{path}: zero_optimization.{name}.device must be one of "
                              f"{', '.join(OFFLOAD_DEVICES)}, got {device!r}; {_FIX}")
    for name in _COUNTS:
        value = config.get(name, "auto")
        if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"{path}: {name} must be a whole number >= 1 or \"auto\", got {value!r}; {_FIX}")
    clipping = config.get("gradient_clipping", "auto")
    if clipping != "auto":
        _clipping(clipping, f"{path}: gradient_clipping")


def _stage(value, field: str) -> None:
    if value == "auto":
        return
    if isinstance(value, str) and value.lstrip("-").isdigit():
        value = int(value)
    if isinstance(value, bool) or value not in STAGES:
        raise ConfigError(f"{field} must be 0, 1, 2 or 3 (the ZeRO stages), got {value!r}; {_FIX}")


def _float(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text


def _clipping(value, field: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"{field} must be a finite number >= 0, got {value!r}; {_FIX}")


__all__ = ["check_deepspeed_settings", "check_deepspeed_file"]
