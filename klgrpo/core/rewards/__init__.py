"""Reward functions: plain ``fn(prompts, completions, **columns) -> list[float]``.

Built-ins are registered by name in ``BUILTIN_REWARDS`` (exact_match, numeric_match, format); any other
function is named "module.path:function" or "path/to/file.py:function"; a ``{model: ...}`` entry is a reward
model (a sequence classifier, ``RewardModel``). ``RewardComputer`` calls every configured function on a batch
and forms the weighted total.

The names below are imported when first used, so that the config (which lists the built-ins' names) reads
``klgrpo.core.rewards.builtins`` without loading torch.
"""

from __future__ import annotations

import importlib

#: public name -> the module of this package that defines it
_HOMES = {
    "BUILTIN_REWARDS": "builtins", "exact_match": "builtins", "extract_answer_number": "builtins",
    "extract_completion_number": "builtins", "format_match": "builtins", "numeric_match": "builtins",
    "RewardComputer": "computer", "RewardResult": "computer", "RewardModel": "model",
    "RewardModelContext": "model", "RewardModelSpec": "specs", "RewardSpec": "specs",
    "display_name": "loading", "load_reward_function": "loading",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
