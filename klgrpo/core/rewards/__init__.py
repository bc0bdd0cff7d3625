"""Reward functions: plain ``fn(prompts, completions, **columns) -> list[float]``.

Built-ins are registered by name in ``BUILTIN_REWARDS`` (exact_match, numeric_match, format); any other
function is named "module.path:function" or "path/to/file.py:function"; a ``{model: ...}`` entry is a reward
model (a sequence classifier, ``RewardModel``). ``RewardComputer`` calls every configured function on a batch
and forms the weighted total.
"""

from klgrpo.core.rewards.builtins import (
    BUILTIN_REWARDS,
    exact_match,
    extract_answer_number,
    extract_completion_number,
    format_match,
    numeric_match,
)
from klgrpo.core.rewards.computer import RewardComputer, RewardResult
from klgrpo.core.rewards.model import RewardModel, RewardModelContext
from klgrpo.core.rewards.specs import RewardModelSpec, RewardSpec
from klgrpo.core.rewards.loading import display_name, load_reward_function

__all__ = [
    "BUILTIN_REWARDS",
    "RewardComputer",
    "RewardModel",
    "RewardModelContext",
    "RewardModelSpec",
    "RewardResult",
    "RewardSpec",
    "display_name",
    "exact_match",
    "extract_answer_number",
    "extract_completion_number",
    "format_match",
    "load_reward_function",
    "numeric_match",
]
