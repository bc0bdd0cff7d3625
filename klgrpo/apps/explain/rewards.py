"""The reward functions of a config as ``klgrpo explain`` lists them: each ``rewards.functions`` entry in typed
form (``RewardSpec.parse``: nothing is imported or loaded), a reward model with the settings it will score with."""

from __future__ import annotations

from typing import Any

from klgrpo.core.rewards.builtins import BUILTIN_REWARDS
from klgrpo.core.rewards.specs import RewardModelSpec, RewardSpec


def reward_entries(functions: list, as_chat: bool) -> list[dict[str, Any]]:
    """One dict per entry of ``functions``; ``as_chat`` (data.as_chat) decides how a reward model's input is
    rendered."""
    return [_entry(RewardSpec.parse(entry), as_chat) for entry in functions]


def _entry(spec: RewardSpec | RewardModelSpec, as_chat: bool) -> dict[str, Any]:
    if isinstance(spec, RewardModelSpec):
        return {"kind": "reward model", "model": spec.model, "weight": spec.weight, "batch_size": spec.batch_size,
                "dtype": spec.dtype or "the policy's",
                "label": "single logit" if spec.label is None else spec.label,
                "max_length": spec.max_length or "the model's context", "rendering": rendering(as_chat)}
    kind = "built-in" if spec.name in BUILTIN_REWARDS else "function"
    return {"kind": kind, "name": spec.name, "weight": spec.weight, **({"kwargs": spec.kwargs} if spec.kwargs else {})}


def rendering(as_chat: bool) -> str:
    """How the reward model reads prompt + completion (core/rewards/model.py)."""
    if as_chat:
        return "its own chat template (data.as_chat), the completion as the assistant's turn"
    return "prompt + completion concatenated (prompts given as chat messages: its own chat template)"


def format_entry(entry: dict[str, Any]) -> str:
    """One line of the report."""
    if entry["kind"] != "reward model":
        kwargs = f", kwargs {entry['kwargs']}" if entry.get("kwargs") else ""
        return f"{entry['kind']} {entry['name']}, weight {entry['weight']:g}{kwargs}"
    return (f"reward model {entry['model']}, weight {entry['weight']:g}, batch_size {entry['batch_size']}, dtype "
            f"{entry['dtype']}, label {entry['label']}, max_length {entry['max_length']}; input: "
            f"{entry['rendering']}")
