"""The entries of rewards.functions in typed form: a reward function (``RewardSpec``) or a reward model
(``RewardModelSpec``); ``parse_reward_entry`` tells them apart (a mapping with ``model`` is a reward model)."""

from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass, field
from typing import Any

from klgrpo.backends.hf import DTYPE_NAMES
from klgrpo.errors import ConfigError, EntryError

#: A number in scientific notation without a dot (1e-3), which YAML 1.1 leaves as text.
_SCIENTIFIC = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")
#: Column names the reward functions take as their first two arguments.
RESERVED_ARGUMENTS = ("prompts", "completions")
#: Completions a reward model scores per forward unless its entry sets batch_size.
DEFAULT_REWARD_MODEL_BATCH = 16


def finite_weight(weight: Any, who: str) -> float:
    """``weight`` as a float; YAML 1.1's text "1e-3" is read as the number; anything else not finite is refused."""
    if isinstance(weight, str) and _SCIENTIFIC.match(weight.strip()):
        weight = float(weight)
    if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight):
        raise EntryError(who, "weight", f"must be a finite number, got {weight!r}")
    return float(weight)


@dataclass
class RewardSpec:
    """One reward function in the weighted sum.

    name: a built-in name, "module.path:function" or "path/to/file.py:function".
    weight: its factor in the total reward.
    kwargs: extra keyword arguments for every call (e.g. {"pattern": "<answer>.*</answer>"} for "format").
    """

    name: str
    weight: float = 1.0
    kwargs: dict = field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name.strip():
            raise ConfigError(f"a reward function needs a non-empty name, got {self.name!r}")
        self.weight = finite_weight(self.weight, f"reward function {self.name!r}")
        if self.kwargs is None:
            self.kwargs = {}
        if not isinstance(self.kwargs, dict):
            raise EntryError(f"reward function {self.name!r}", "kwargs", f"must be a mapping of argument names to "
                             f"values, got {self.kwargs!r}")
        for reserved in RESERVED_ARGUMENTS:
            if reserved in self.kwargs:
                raise ConfigError(f"reward function {self.name!r}: {reserved!r} cannot be a kwarg (the function "
                                  f"receives the batch's {reserved} itself); remove it")

    @classmethod
    def parse(cls, entry: Any) -> "RewardSpec | RewardModelSpec":
        """A spec from a config entry: a name, a {name, weight, kwargs} mapping, or an object with those fields;
        a mapping with ``model`` is a reward model's entry (``RewardModelSpec``)."""
        if isinstance(entry, (RewardSpec, RewardModelSpec)):
            return entry
        if isinstance(entry, dict) and "model" in entry:
            return RewardModelSpec.from_entry(entry)
        if isinstance(entry, str):
            return cls(entry)
        if isinstance(entry, dict):
            unknown = set(entry) - {"name", "weight", "kwargs"}
            if unknown or "name" not in entry:
                raise ConfigError(f"a reward function entry needs 'name' and may have 'weight' and 'kwargs', got "
                                  f"{entry!r}")
            kwargs = entry.get("kwargs")
            return cls(entry["name"], entry.get("weight", 1.0), dict(kwargs) if isinstance(kwargs, dict) else kwargs)
        if hasattr(entry, "name"):
            return cls(entry.name, getattr(entry, "weight", 1.0), dict(getattr(entry, "kwargs", None) or {}))
        raise ConfigError(f"a reward function entry must be a name or a {{name, weight, kwargs}} mapping, "
                          f"got {entry!r}")


@dataclass
class RewardModelSpec:
    """A reward model in the weighted sum: a sequence classifier whose logit scores prompt + completion.

    model: a local folder or a hub name (AutoModelForSequenceClassification), with its own tokenizer.
    weight: its factor in the total reward.
    batch_size: completions per forward.
    dtype: its weights' dtype; "" takes the policy's.
    label: with a head of several labels, the one whose logit is the reward (an index or an id2label name).
    max_length: the longest input in tokens; 0 takes the model's context.
    """

    model: str
    weight: float = 1.0
    batch_size: int = DEFAULT_REWARD_MODEL_BATCH
    dtype: str = ""
    label: int | str | None = None
    max_length: int = 0

    def __post_init__(self):
        if not isinstance(self.model, str) or not self.model.strip():
            raise ConfigError(f"a reward model entry needs model: a local folder or hub name, got {self.model!r}")
        who = f"reward model {self.model!r}"
        self.weight = finite_weight(self.weight, who)
        for name, low in (("batch_size", 1), ("max_length", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise EntryError(who, name, f"must be an integer >= {low}, got {value!r}")
        if self.dtype not in ("", *DTYPE_NAMES):
            raise EntryError(who, "dtype", f"is {self.dtype!r}; choose one of: {', '.join(DTYPE_NAMES)}, or leave it "
                                           f"out for the policy's")
        label_ok = (self.label is None or (isinstance(self.label, int) and not isinstance(self.label, bool)
                                           and self.label >= 0) or (isinstance(self.label, str) and self.label))
        if not label_ok:
            raise EntryError(who, "label", f"must be a label index (0, 1, ...) or a name from the model's "
                                           f"id2label, got {self.label!r}")

    #: The keys a reward model's entry may have.
    KEYS = ("model", "weight", "batch_size", "dtype", "label", "max_length")

    @classmethod
    def from_entry(cls, entry: dict) -> "RewardModelSpec":
        unknown = sorted(set(entry) - set(cls.KEYS))
        if unknown:
            raise ConfigError(f"reward model entry {entry!r}: unknown key {', '.join(map(repr, unknown))}; a reward "
                              f"model entry has {', '.join(cls.KEYS)}")
        return cls(**entry)

    @property
    def name(self) -> str:
        return self.model

    @property
    def kwargs(self) -> dict:
        """A reward model takes no keyword arguments (the shape the weighted sum reads from every spec)."""
        return {}
