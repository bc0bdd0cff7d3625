"""The row types of the release tables, one per shape (:class:`TRLRange` for TRL and Unsloth, :class:`RLRange`
for verl and OpenRLHF; explain's own tables subclass :class:`ReleaseRange`), and the checks each row passes when
its table loads: a row they refuse is one line naming the file and the row."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Literal, get_args

from packaging.version import InvalidVersion, Version

from klgrpo.errors import ConfigError
from klgrpo.integrations.versions.clauses import Constraint, release_label

#: The frameworks whose release tables explain reads, and their names.
NAMES = {"trl": "TRL", "unsloth": "Unsloth", "verl": "verl", "openrlhf": "OpenRLHF"}


@dataclass(frozen=True)
class ReleaseRange:
    """The releases [low, high) of one framework (high None: open) that one row of its table covers."""

    framework: str
    low: Version
    high: Version | None

    @property
    def name(self) -> str:
        return NAMES[self.framework]

    @property
    def span(self) -> str:
        low = release_label(self.low)
        return (f"{self.name} {low} or later" if self.high is None
                else f"{self.name} >= {low}, < {release_label(self.high)}")

    @property
    def label(self) -> str:
        return self.span

    def allows(self, clauses: list[Constraint]) -> bool:
        """Whether each clause allows some release of the range."""
        return all(clause.meets(self.low, self.high) for clause in clauses)


@dataclass(frozen=True)
class TRLRange(ReleaseRange):
    """One TRL range, or one Unsloth range paired with a TRL range its pins allow (``trl``). ``defaults``
    override klgrpo.integrations.trl_mapping.TRL_DEFAULTS."""

    defaults: dict[str, Any] = field(default_factory=dict)
    absent: frozenset[str] = frozenset()
    removed_since: frozenset[str] = frozenset()
    read: tuple[str, ...] = ()
    unweighted_kl: bool = False  # Unsloth's own loss: k3 without the importance ratio, whatever the config says
    rewrites: dict[str, dict[str, Any]] = field(default_factory=dict)
    trl: TRLRange | None = None

    @property
    def label(self) -> str:
        if self.trl is None:
            return self.span
        trl = self.trl
        return (f"{self.span} (with TRL >= {release_label(trl.low)}, < {release_label(trl.high)})" if trl.high
                else f"{self.span} (with TRL {release_label(trl.low)} or later)")


#: klgrpo's kl.estimator names a verl or OpenRLHF formula can be (each checked against klgrpo.math.kl.ESTIMATORS).
KLEstimator = Literal["k1", "k2", "k3", "k1_st", "k3_st"]
#: The formulas tools/rl_versions.py names a release's function by (l = log pi - log ref).
SourceFormula = Literal["k1", "k2", "k3", "abs"]
#: (the value's formula, the gradient's) -> klgrpo's kl.estimator.
_KLGRPO_ESTIMATORS: dict[tuple[str, str], KLEstimator] = {
    ("k1", "k1"): "k1", ("k2", "k2"): "k2", ("k3", "k3"): "k3", ("k1", "k2"): "k1_st", ("k3", "k2"): "k3_st"}
_FORMULA = re.compile(r"(\w+) = [^,;]+(?:, clamped to \[-([\d.e+]+), [\d.e+]+\])?(?:; gradient of (\w+))?")


@dataclass(frozen=True)
class TableEstimator:
    """An estimator of verl.json / openrlhf.json in klgrpo's terms: its ``kl.estimator`` (None: klgrpo has none),
    the value cap the release applies (None: none), why there is no counterpart, whether the release's function
    raises instead, and the formula as the table states it (printed, not compared)."""

    estimator: KLEstimator | None
    cap: float | None = None
    why: str = ""
    raises: bool = False
    formula: str = field(default="", compare=False)


def table_estimator(formula: str) -> TableEstimator:
    """A formula as tools/rl_versions.py writes it -> its typed form (read once, when the table loads):
    "k3 = exp(-l) - 1 + l, clamped to [-10, 10]" -> k3 capped at 10; "...; gradient of k2" -> the value's
    straight-through form; "abs = |l|", "raises NotImplementedError": no counterpart, with why."""
    if formula.startswith("raises "):
        return TableEstimator(None, why=formula, raises=True, formula=formula)
    match = _FORMULA.fullmatch(formula)
    if match is None or match.group(1) not in get_args(SourceFormula) or (
            match.group(3) or match.group(1)) not in get_args(SourceFormula):
        return TableEstimator(None, why=formula, formula=formula)
    value, cap, gradient = match.group(1), match.group(2), match.group(3) or match.group(1)
    name = _KLGRPO_ESTIMATORS.get((value, gradient))
    why = "" if name else f"{formula}: klgrpo has no such estimator"
    return TableEstimator(name, float(cap) if cap else None, why, formula=formula)


class RewardKL(Enum):
    """When a verl or OpenRLHF range puts the KL into the reward (its table's ``reward_kl``)."""

    ALWAYS = "always"
    UNLESS_KL_LOSS = "unless the KL is in the loss"  # verl 0.2-0.3 (actor.use_kl_loss), OpenRLHF's use_loss flag
    WITH_USE_KL_IN_REWARD = "with algorithm.use_kl_in_reward"  # verl 0.4 on


@dataclass(frozen=True)
class RLRange(ReleaseRange):
    """One verl or OpenRLHF range: its KL defaults (verl: dotted key -> value; OpenRLHF: what -> {flag,
    default}), when the KL goes into the reward, its estimators by the release's names, its trainer modules
    (verl) and the tags read."""

    last_read: Version | None = None
    defaults: dict[str, Any] = field(default_factory=dict)
    reward_kl: RewardKL = RewardKL.ALWAYS
    estimators: dict[str, TableEstimator] = field(default_factory=dict)
    entry_points: tuple[str, ...] = ()
    read: tuple[str, ...] = ()


class TableError(ConfigError):
    """A release table that does not hold what its row type needs (a packaging fault, not the user's)."""


def table_path(name: str) -> str:
    """Where a table of this folder lives, as its refusals name it."""
    return f"klgrpo/integrations/versions/{name}.json"


def row_place(path: str, index: int, row: Any) -> str:
    start = row.get("from") if isinstance(row, dict) else None
    return f"{path} ranges[{index}]" + (f" (from {start})" if start else "")


def row_version(path: str, index: int, row: dict, key: str, optional: bool = False) -> Version | None:
    text = row.get(key)
    if text is None and optional:
        return None
    if not isinstance(text, str):
        raise TableError(f"{row_place(path, index, row)}: {key} must be a release number, got {text!r}")
    try:
        return Version(text)
    except InvalidVersion:
        raise TableError(f"{row_place(path, index, row)}: {key} {text!r} is no release number") from None


def checked_ranges(path: str, rows: Any, make) -> tuple:
    """Each row through ``make(index, row, low, high)``; the ranges in order, each ``to`` the next ``from``."""
    if not isinstance(rows, list) or not rows:
        raise TableError(f"{path}: ranges must be a non-empty list of rows")
    out, previous_high = [], None
    for index, row in enumerate(rows):
        if not isinstance(row, dict):
            raise TableError(f"{row_place(path, index, row)}: a row must be an object, got {type(row).__name__}")
        low, high = row_version(path, index, row, "from"), row_version(path, index, row, "to", optional=True)
        if high is not None and high <= low:
            raise TableError(f"{row_place(path, index, row)}: to {row['to']} is not after from {row['from']}")
        if index and previous_high != low:
            raise TableError(f"{row_place(path, index, row)}: from {row['from']} is not the previous row's to "
                             f"({rows[index - 1].get('to')}): the ranges must follow each other")
        if high is None and index != len(rows) - 1:
            raise TableError(f"{row_place(path, index, row)}: to is null (open) but rows follow it")
        previous_high = high
        try:
            out.append(make(index, row, low, high))
        except TableError:
            raise
        except (KeyError, TypeError, ValueError, ConfigError) as err:
            raise TableError(f"{row_place(path, index, row)}: {err.__class__.__name__}: {err}") from None
    return tuple(out)


def row_names(path: str, index: int, row: dict, key: str) -> tuple[str, ...]:
    values = row[key]
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise TableError(f"{row_place(path, index, row)}: {key} must be a list of strings, got {values!r}")
    return tuple(values)


#: reward_kl as tools/rl_versions.py writes it -> the rule (OpenRLHF's names its use-loss flag: checked on load).
_REWARD_TEXTS = {"always": RewardKL.ALWAYS, "whenever actor.use_kl_loss is false": RewardKL.UNLESS_KL_LOSS,
                 "with algorithm.use_kl_in_reward": RewardKL.WITH_USE_KL_IN_REWARD}


def reward_rule(framework: str, where: str, row: dict) -> RewardKL:
    text = row["reward_kl"]
    if framework == "openrlhf":
        use_loss = row["defaults"].get("use_loss", {}).get("flag")
        accepted = {"always": RewardKL.ALWAYS, **({f"unless {use_loss}": RewardKL.UNLESS_KL_LOSS} if use_loss else {})}
    else:
        accepted = dict(_REWARD_TEXTS)
    if text not in accepted:
        raise TableError(f"{where}: reward_kl {text!r} is none of {list(accepted)}")
    return accepted[text]


def estimators_of(where: str, row: dict) -> dict[str, TableEstimator]:
    from klgrpo.math.kl import ESTIMATORS

    found = {}
    for name, formula in row["estimators"].items():
        if not isinstance(formula, str):
            raise TableError(f"{where}: estimators.{name} must be the formula's text, got {formula!r}")
        typed = table_estimator(formula)
        if typed.estimator is not None and typed.estimator not in ESTIMATORS:
            raise TableError(f"{where}: estimators.{name} {formula!r} names "
                             f"{typed.estimator}, no estimator of klgrpo.math.kl")
        found[name] = typed
    if not found:
        raise TableError(f"{where}: estimators is empty")
    return found
