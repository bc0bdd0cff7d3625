"""The entries of the config's list settings in typed form, each list parsed and checked in one place with
one-line errors that name the entry and its key (``eval.sets[1].limit must be ...``):

    eval_set_specs(cfg.eval.sets)          -> [EvalSetSpec]                     (an evaluation or retention set)
    reward_specs(cfg.rewards.functions)    -> [RewardSpec | RewardModelSpec]    (klgrpo.core.rewards' types)

The YAML stays a list of mappings; the config holds them as written (config.yaml is what the user wrote), and
whoever uses the entries takes them through these functions.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from klgrpo.core.rewards import RewardModelSpec, RewardSpec
from klgrpo.errors import ConfigError, EntryError


@dataclass(frozen=True)
class EvalSetSpec:
    """One evaluation set: greedy completions of its prompts scored by ``reward`` against its answers.

    name: the set's name (its metric is eval/<name>); source: a prompt file or dataset, as data.source;
    prompt_column / answer_column: the columns holding the prompt and the answer; split: a hub dataset's split;
    limit: the first N rows only (0: all); reward: a reward function's name (1 = correct).
    """

    name: str
    source: str
    prompt_column: str = "prompt"
    answer_column: str = "answer"
    split: str = "test"
    limit: int = 0
    reward: str = "exact_match"

    @classmethod
    def parse(cls, entry: Any, at: str = "an evaluation set") -> "EvalSetSpec":
        """The spec of one ``eval.sets`` entry (a mapping); ``at`` names the entry in errors."""
        if isinstance(entry, cls):
            return entry
        if not isinstance(entry, dict) or not entry.get("name") or not entry.get("source"):
            raise ConfigError(f"{at} needs a name and a source, e.g. {{name: gsm8k, source: test.jsonl}}")
        keys = [f.name for f in dataclasses.fields(cls)]
        unknown = [str(k) for k in entry if k not in keys]
        if unknown:
            raise ConfigError(f"{at}: unknown key {unknown[0]!r}; an evaluation set has {', '.join(keys)}")
        values = {key: _text(entry[key], f"{at}.{key}") for key in keys if key in entry and key != "limit"}
        limit = entry.get("limit")
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
            raise ConfigError(f"{at}.limit must be an integer >= 0 (0: all rows), got {limit!r}")
        if values["name"].endswith("/entropy"):
            raise ConfigError(f"{at}.name {values['name']!r} ends in '/entropy', the suffix of a set's entropy "
                              f"metric (eval/<name>/entropy); rename the set")
        return cls(**values, limit=limit or 0)


def _text(value: Any, path: str) -> str:
    """A name, path or column: text (a number is read as its text, as YAML gives ``name: 2024``), never empty."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{path} must be a non-empty text, got {value!r}")
    return value


def eval_set_specs(entries: list) -> list[EvalSetSpec]:
    """``eval.sets`` as specs; every set has its own name (it names the metric eval/<name>)."""
    specs: list[EvalSetSpec] = []
    for i, entry in enumerate(entries):
        spec = EvalSetSpec.parse(entry, f"eval.sets[{i}]")
        earlier = next((j for j, s in enumerate(specs) if s.name == spec.name), None)
        if earlier is not None:
            raise ConfigError(f"eval.sets[{i}].name {spec.name!r} is eval.sets[{earlier}]'s too; give each set its own "
                              f"name (its metric is eval/<name>)")
        specs.append(spec)
    return specs


def reward_specs(entries: list) -> list[RewardSpec | RewardModelSpec]:
    """``rewards.functions`` as specs (RewardSpec.parse: a name, a {name, weight, kwargs} mapping or a reward
    model's {model, ...}), a bad entry refused by its path."""
    specs = []
    for i, entry in enumerate(entries):
        at = f"rewards.functions[{i}]"
        try:
            specs.append(RewardSpec.parse(entry))
        except EntryError as err:
            raise ConfigError(f"{at}.{err.key} {err.problem}") from None
        except ConfigError as err:
            raise ConfigError(f"{at}: {err.message}") from None
    return specs
