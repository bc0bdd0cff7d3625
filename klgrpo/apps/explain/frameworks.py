"""The frameworks whose release tables live beside explain (``nemo_rl.json``, ``roll.json``,
``skyrl_train.json``, ``prime_rl.json``, ``slime.json``): their release ranges as
:class:`Release` profiles, the ``--version`` clauses that name them, and their labels.

Each table holds ``name`` (as printed), ``groups`` (its config's top-level keys) and ``ranges``: rows with
``from`` / ``to`` (the next range's first release, null: open), ``defaults`` and what decides the KL there, each row
naming the files and tags read.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from klgrpo.errors import ConfigError
from klgrpo.integrations.versions import Constraint, ReleaseRange, checked_ranges, constraints, release_label

HERE = Path(__file__).resolve().parent
#: --version names -> framework (its table: HERE / f"{framework}.json").
VERSION_NAMES = {"nemo_rl": "nemo_rl", "nemo-rl": "nemo_rl", "roll": "roll", "skyrl_train": "skyrl_train",
                 "skyrl-train": "skyrl_train", "prime_rl": "prime_rl", "prime-rl": "prime_rl",
                 "slime": "slime"}
FRAMEWORKS = tuple(dict.fromkeys(VERSION_NAMES.values()))


@lru_cache(maxsize=None)
def table(framework: str) -> dict[str, Any]:
    return json.loads((HERE / f"{framework}.json").read_text(encoding="utf-8"))


def display_name(framework: str) -> str:
    return table(framework)["name"]


@dataclass(frozen=True)
class Release(ReleaseRange):
    """One release range of a framework of this folder's tables: its defaults and its row (``release``, the
    fields each framework's reader knows)."""

    defaults: dict[str, Any] = field(default_factory=dict)
    release: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return display_name(self.framework)


@lru_cache(maxsize=None)
def releases(framework: str) -> tuple[Release, ...]:
    """The table's ranges, each ``from``/``to`` a release number and each ``to`` the next ``from`` (checked on
    load: a bad row is one line naming the file and the row)."""
    def make(index: int, row: dict, low: Any, high: Any) -> Release:
        return Release(framework, low, high, dict(row.get("defaults", {})), row)

    return checked_ranges(f"klgrpo/apps/explain/{framework}.json", table(framework)["ranges"], make)


def allowed(framework: str, clauses: dict[str, list[Constraint]]) -> list[Release]:
    return [r for r in releases(framework) if r.allows(clauses.get(framework, []))]


def split_option(text: str) -> tuple[str, dict[str, list[Constraint]]]:
    """``--version``'s clauses for these frameworks (``nemo_rl==0.7.0``), and the rest of the text for
    klgrpo.integrations.versions.parse_option."""
    rest, found = [], {}
    for item in filter(None, re.split(r"[;\s]+", text)):
        match = re.match(r"^([a-z_-]+?)\s*((?:==|~=|>=|<=|!=|>|<).+)$", item, re.I)
        if match and match.group(1).lower() in VERSION_NAMES:
            found.setdefault(VERSION_NAMES[match.group(1).lower()], []).extend(constraints(match.group(2)))
        else:
            rest.append(item)
    return " ".join(rest), found


def spans(found: list[Release]) -> list[str]:
    """Neighbouring ranges joined into as few labels as possible."""
    merged: list[Release] = []
    for r in sorted(found, key=lambda r: r.low):
        if merged and merged[-1].high == r.low:
            merged[-1] = Release(r.framework, merged[-1].low, r.high)  # its label only
        else:
            merged.append(r)
    return [r.label for r in merged]


def outside(framework: str, clauses: list[Constraint]) -> ConfigError:
    first = releases(framework)[0]
    name = display_name(framework)
    return ConfigError(f"{name}{','.join(map(str, clauses))} is outside every {name} release range klgrpo knows "
                       f"({release_label(first.low)} and later, klgrpo/apps/explain/{framework}.json); pass "
                       f"--version {framework}==X with a release from {release_label(first.low)} on")
