"""What decides the KL in each release range of TRL, Unsloth, verl and OpenRLHF, as data (trl.json, written by
tools/trl_versions.py from TRL's source at every minor release; unsloth.json, read by hand from Unsloth's and
unsloth_zoo's source, each row naming the file and commit read; verl.json and openrlhf.json, written by
tools/rl_versions.py from every release tag), and the version constraints a file states.

Each table is read and checked once, into one row type per shape: a :class:`TRLRange` is one TRL or Unsloth range
in the terms of klgrpo.integrations.trl_mapping (TRL's defaults there, the GRPOConfig fields it lacks or still has,
and (Unsloth) the defaults Unsloth writes and its own loss's KL); an :class:`RLRange` is one verl or OpenRLHF
range, read by klgrpo.integrations.verl_mapping and openrlhf_mapping, its estimators typed as
:class:`TableEstimator` and its reward rule as :class:`RewardKL`. A row the types refuse is one line naming the
file and the row. Versions are ``packaging.version.Version``; a clause is a ``packaging.specifiers.Specifier``
with the series rule below.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from enum import Enum
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal, get_args

from packaging.specifiers import Specifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from klgrpo.errors import ConfigError

HERE = Path(__file__).resolve().parent
#: The frameworks whose release tables explain reads, and their names.
NAMES = {"trl": "TRL", "unsloth": "Unsloth", "verl": "verl", "openrlhf": "OpenRLHF"}
#: Those whose tables tools/rl_versions.py writes (one row per range, read by their mappings).
RL_FRAMEWORKS = ("verl", "openrlhf")
_OPS = ("==", "~=", ">=", "<=", "!=", ">", "<")
_CLAUSE = r"(?:==|~=|>=|<=|!=|>|<)\s*v?\d+(?:\.\d+){0,2}(?:\.post\d+)?"
_PIN = r"(?<![\w-]){name}(?:\[[\w,\s-]*\])?\s*(" + _CLAUSE + r"(?:\s*,\s*" + _CLAUSE + r")*)"
#: ``trl @ git+https://github.com/huggingface/trl.git@REF`` (open-r1's setup.py): a release tag or a commit.
_GIT_PIN = r"(?<![\w-])trl(?:\[[\w,\s-]*\])?\s*@\s*git\+https?://github\.com/huggingface/trl(?:\.git)?@([\w.]+)"


class NotInRange(ConfigError):
    """A field the release range being tried lacks: that range cannot run the file."""


def parse_version(text: str) -> Version:
    """"0.18" -> Version("0.18") (as written: ==0.18 means every 0.18.x); "v0.6.0.post1" -> a post release."""
    try:
        return Version(text.strip())
    except InvalidVersion:
        raise ConfigError(f"version {text!r} is no release number; write e.g. trl==0.18") from None


def _after_series(version: Version) -> Version:
    """The first version after every ``version.*``: 0.18 -> 0.19, 0.18.2 -> 0.18.3; 0.6.0.post1 -> 0.6.0.post2."""
    if version.post is not None:
        return Version(f"{version.base_version}.post{version.post + 1}")
    *head, last = version.release
    return Version(".".join(map(str, (*head, last + 1))))


def _just_after(version: Version) -> Version:
    """A version after ``version`` and before every later release: its first post release (or next post)."""
    return _after_series(version) if version.post is not None else Version(f"{version.base_version}.post0")


def release_label(version: Version) -> str:
    """Version("1.10.0") -> "1.10.0", as the table writes it; a post release as ".postN"."""
    return str(version)


@dataclass(frozen=True)
class Constraint:
    """One ``op version`` clause as written; :attr:`specifier` is what it allows."""

    op: str
    version: Version

    @property
    def specifier(self) -> Specifier:
        """The clause as PEP 440 reads it, a short version naming its whole series (fewer than three parts: the
        way pins are written): ==0.18 -> ==0.18.*, !=0.18 -> !=0.18.*; <=X and >X include and exclude every X.*
        (<=0.18 -> <0.19, >0.18.2 -> >=0.18.3); ~=1 -> >=1. ==0.6.0 is that release alone, not its post releases."""
        v = self.version
        series = len(v.release) < 3 and v.post is None and v.pre is None and v.dev is None
        if self.op in ("==", "!=") and series:
            return Specifier(f"{self.op}{v}.*")
        if self.op == "<=":
            return Specifier(f"<{_after_series(v)}")
        if self.op == ">":
            return Specifier(f">={_after_series(v)}")
        if self.op == "~=" and len(v.release) < 2:
            return Specifier(f">={v}")
        return Specifier(f"{self.op}{v}")

    def lowest(self) -> Version | None:
        """The lowest version the clause allows (None: no bound below; != has none either)."""
        spec = self.specifier
        return Version(spec.version.removesuffix(".*")) if spec.operator in ("==", "~=", ">=") and (
            self.op != "!=") else None

    def excluded_until(self) -> Version | None:
        """For != : the first version after the releases it takes out (None for the other operators)."""
        if self.op != "!=":
            return None
        return _after_series(self.version) if self.specifier.version.endswith(".*") else _just_after(self.version)

    def meets(self, low: Version, high: Version | None) -> bool:
        """Whether some version in [low, high) satisfies the clause; != is taken as allowing every range."""
        if self.op == "!=":
            return True
        probe = max(low, self.lowest() or low)
        return (high is None or probe < high) and self.specifier.contains(probe, prereleases=True)

    def __str__(self) -> str:
        return f"{self.op}{release_label(self.version)}"


def constraints(spec: str) -> list[Constraint]:
    """``>=0.18,<0.20`` (or ``==0.18``, ``==0.18.*``) -> its clauses."""
    out = []
    for clause in filter(None, (c.strip() for c in spec.split(","))):
        op = next((o for o in _OPS if clause.startswith(o)), None)
        if op is None or clause.startswith("==="):
            raise ConfigError(f"version clause {clause!r}: begin it with one of {' '.join(_OPS)} (e.g. ==0.18)")
        text = clause[len(op):].strip()
        wildcard = op in ("==", "!=") and text.endswith(".*")
        version = parse_version(text.removesuffix(".*") if wildcard else text)
        if wildcard and len(version.release) >= 3:
            raise ConfigError(f"version clause {clause!r}: write the series as {op}X.Y (e.g. ==0.18: every 0.18.x)")
        out.append(Constraint(op, version))
    return out


def specifier_set(clauses: list[Constraint]) -> SpecifierSet:
    """The clauses together, as packaging reads them (the series rule of :attr:`Constraint.specifier`)."""
    return SpecifierSet(",".join(str(c.specifier) for c in clauses))


def satisfiable(clauses: list[Constraint]) -> bool:
    """Whether some version satisfies every clause together (``==0.18`` with ``==0.19``, ``>=0.20,<0.19`` and
    ``==0.18,!=0.18`` do not). The lowest version they allow is the highest lower bound or, where a != takes
    that out, the first version after what a != takes out: those are the only versions to try."""
    lowest = max((low for c in clauses if (low := c.lowest()) is not None), default=Version("0"))
    tries = [lowest] + [until for c in clauses if (until := c.excluded_until()) is not None and until > lowest]
    allowed = specifier_set(clauses)
    return any(allowed.contains(version, prereleases=True) for version in tries)


def pins_in(text: str, package: str) -> list[Constraint]:
    """The version clauses a file states for ``package``: pins, requirements lines, ``pip install pkg==X``."""
    found = []
    for match in re.finditer(_PIN.replace("{name}", re.escape(package)), text, re.I):
        found.extend(constraints(re.sub(r"\s+|v(?=\d)", "", match.group(1))))
    return found


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


def _where(path: str, index: int, row: Any) -> str:
    start = row.get("from") if isinstance(row, dict) else None
    return f"{path} ranges[{index}]" + (f" (from {start})" if start else "")


def _row_version(path: str, index: int, row: dict, key: str, optional: bool = False) -> Version | None:
    text = row.get(key)
    if text is None and optional:
        return None
    if not isinstance(text, str):
        raise TableError(f"{_where(path, index, row)}: {key} must be a release number, got {text!r}")
    try:
        return Version(text)
    except InvalidVersion:
        raise TableError(f"{_where(path, index, row)}: {key} {text!r} is no release number") from None


def checked_ranges(path: str, rows: Any, make) -> tuple:
    """Each row through ``make(index, row, low, high)``; the ranges in order, each ``to`` the next ``from``."""
    if not isinstance(rows, list) or not rows:
        raise TableError(f"{path}: ranges must be a non-empty list of rows")
    out, previous_high = [], None
    for index, row in enumerate(rows):
        if not isinstance(row, dict):
            raise TableError(f"{_where(path, index, row)}: a row must be an object, got {type(row).__name__}")
        low, high = _row_version(path, index, row, "from"), _row_version(path, index, row, "to", optional=True)
        if high is not None and high <= low:
            raise TableError(f"{_where(path, index, row)}: to {row['to']} is not after from {row['from']}")
        if index and previous_high != low:
            raise TableError(f"{_where(path, index, row)}: from {row['from']} is not the previous row's to "
                             f"({rows[index - 1].get('to')}): the ranges must follow each other")
        if high is None and index != len(rows) - 1:
            raise TableError(f"{_where(path, index, row)}: to is null (open) but rows follow it")
        previous_high = high
        try:
            out.append(make(index, row, low, high))
        except TableError:
            raise
        except (KeyError, TypeError, ValueError, ConfigError) as err:
            raise TableError(f"{_where(path, index, row)}: {err.__class__.__name__}: {err}") from None
    return tuple(out)


def _names(path: str, index: int, row: dict, key: str) -> tuple[str, ...]:
    values = row[key]
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise TableError(f"{_where(path, index, row)}: {key} must be a list of strings, got {values!r}")
    return tuple(values)


@lru_cache(maxsize=None)
def _table(name: str) -> dict[str, Any]:
    return json.loads((HERE / f"{name}.json").read_text(encoding="utf-8"))


@lru_cache(maxsize=None)
def trl_profiles() -> tuple[TRLRange, ...]:
    def make(index: int, row: dict, low: Version, high: Version | None) -> TRLRange:
        path, defaults = table_path("trl"), row["defaults"]
        if not isinstance(defaults, dict) or not isinstance(defaults.get("beta"), (int, float)):
            raise TableError(f"{_where(path, index, row)}: defaults must hold TRL's beta, got {defaults!r}")
        return TRLRange("trl", low, high, dict(defaults), frozenset(_names(path, index, row, "absent")),
                        frozenset(_names(path, index, row, "removed_since")), _names(path, index, row, "read"))

    return checked_ranges(table_path("trl"), _table("trl")["ranges"], make)


@lru_cache(maxsize=None)
def unsloth_config_fields() -> dict[str, tuple[Version, str | None]]:
    """The fields Unsloth's patched GRPOConfig adds to TRL's (unsloth.json's config_fields): name -> (the first
    Unsloth release that has it, what it changes; None: speed or memory only). TRL's own GRPOConfig refuses
    them, so a file that sets one runs on Unsloth."""
    fields = _table("unsloth")["config_fields"]["fields"]
    return {name: (parse_version(row["from"]), row["does"]) for name, row in fields.items()}


@lru_cache(maxsize=None)
def unsloth_profiles() -> tuple[TRLRange, ...]:
    """Each Unsloth range paired with each TRL range its pins allow."""
    table = _table("unsloth")
    rewrites = {k: v for k, v in table["rewrites"].items() if k in ("dapo", "dr_grpo")}
    loss_read = tuple(table["loss"]["read"])

    def make(index: int, row: dict, low: Version, high: Version | None) -> list[TRLRange]:
        pins = constraints(row["trl"])
        own = {k: v for k, v in row["defaults"].items() if v is not None}
        return [TRLRange("unsloth", low, high, {**trl.defaults, **own}, trl.absent, trl.removed_since,
                         _names(table_path("unsloth"), index, row, "read") + loss_read, True, rewrites, trl)
                for trl in trl_profiles() if trl.allows(pins)]

    pairs = checked_ranges(table_path("unsloth"), table["ranges"], make)
    return tuple(profile for paired in pairs for profile in paired)


#: reward_kl as tools/rl_versions.py writes it -> the rule (OpenRLHF's names its use-loss flag: checked on load).
_REWARD_TEXTS = {"always": RewardKL.ALWAYS, "whenever actor.use_kl_loss is false": RewardKL.UNLESS_KL_LOSS,
                 "with algorithm.use_kl_in_reward": RewardKL.WITH_USE_KL_IN_REWARD}


def _reward_kl(framework: str, where: str, row: dict) -> RewardKL:
    text = row["reward_kl"]
    if framework == "openrlhf":
        use_loss = row["defaults"].get("use_loss", {}).get("flag")
        accepted = {"always": RewardKL.ALWAYS, **({f"unless {use_loss}": RewardKL.UNLESS_KL_LOSS} if use_loss else {})}
    else:
        accepted = dict(_REWARD_TEXTS)
    if text not in accepted:
        raise TableError(f"{where}: reward_kl {text!r} is none of {list(accepted)}")
    return accepted[text]


def _estimators(where: str, row: dict) -> dict[str, TableEstimator]:
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


@lru_cache(maxsize=None)
def rl_profiles(framework: str) -> tuple[RLRange, ...]:
    """verl's or OpenRLHF's ranges, typed and checked."""
    def make(index: int, row: dict, low: Version, high: Version | None) -> RLRange:
        path, defaults = table_path(framework), row["defaults"]
        where = _where(path, index, row)
        if not isinstance(defaults, dict) or framework == "openrlhf" and not all(
                isinstance(e, dict) and set(e) == {"flag", "default"} and str(e["flag"]).startswith("--")
                for e in defaults.values()):
            raise TableError(f"{where}: defaults must map "
                             + ("each KL setting to {flag, default}" if framework == "openrlhf" else "keys to values"))
        return RLRange(framework, low, high, _row_version(path, index, row, "last_read"), dict(defaults),
                       _reward_kl(framework, where, row), _estimators(where, row),
                       _names(path, index, row, "entry_points") if "entry_points" in row else (),
                       _names(path, index, row, "read"))

    return checked_ranges(table_path(framework), _table(framework)["ranges"], make)


def newest(framework: str) -> RLRange:
    """The newest range of verl's or OpenRLHF's table: the rules a config is mapped by without a range."""
    return rl_profiles(framework)[-1]


def profiles(framework: str, clauses: dict[str, list[Constraint]]) -> list[TRLRange] | list[RLRange]:
    """The ranges of ``framework`` that the clauses allow (TRL's clauses also bound Unsloth's TRL)."""
    if framework in RL_FRAMEWORKS:
        return [p for p in rl_profiles(framework) if p.allows(clauses.get(framework, []))]
    if framework == "trl":
        return [p for p in trl_profiles() if p.allows(clauses.get("trl", []))]
    return [p for p in unsloth_profiles()
            if p.allows(clauses.get("unsloth", [])) and p.trl is not None and p.trl.allows(clauses.get("trl", []))]


def spans(found: list[ReleaseRange]) -> list[str]:
    """The ranges as few labels as possible: neighbouring TRL ranges (under the same Unsloth range) joined."""
    merged: list[ReleaseRange] = []
    for p in sorted(found, key=lambda p: (p.low, p.trl.low) if getattr(p, "trl", None) else (p.low,)):
        last = merged[-1] if merged else None
        trl, last_trl = getattr(p, "trl", None), getattr(last, "trl", None)
        if last is not None and p.framework == last.framework != "unsloth" and last.high == p.low:
            merged[-1] = ReleaseRange(p.framework, last.low, p.high)
        elif (last is not None and trl and last_trl and (last.low, last.high) == (p.low, p.high)
              and last_trl.high == trl.low):
            merged[-1] = replace(p, trl=replace(trl, low=last_trl.low))
        else:
            merged.append(p)
    return [p.label for p in merged]


def parse_option(text: str) -> dict[str, list[Constraint]]:
    """``--version trl==0.18`` (several joined by spaces or ';': ``unsloth==2025.3.1;trl==0.15``; also
    ``verl==0.3``, ``openrlhf==0.5.9.post1``)."""
    out: dict[str, list[Constraint]] = {}
    for item in filter(None, re.split(r"[;\s]+", text)):
        match = re.match(r"^(trl|unsloth|verl|openrlhf)\s*(.+)$", item, re.I)
        if not match:
            raise ConfigError(f"--version {item!r}: write trl==X, unsloth==X, verl==X or openrlhf==X (e.g. "
                              "--version trl==0.18)")
        out.setdefault(match.group(1).lower(), []).extend(constraints(match.group(2)))
    return out


def imports_in(text: str) -> list[Constraint]:
    """``>=`` the first release of each TRL module the file imports that not every release has."""
    first = _table("trl")["modules_first"]
    found = []
    for module, release in first.items():
        if re.search(rf"^\s*(from\s+{re.escape(module)}(\s|\.)|import\s+{re.escape(module)}\b)", text, re.M):
            found.append(Constraint(">=", parse_version(release)))
    return found


def git_pins_in(text: str) -> list[Constraint]:
    """TRL installed from git: a release tag -> ``==`` it; a commit that trl.json's ``commits`` holds -> the range
    whose rules were read at it; another commit or a branch states no release."""
    out = []
    table = _table("trl")
    for match in re.finditer(_GIT_PIN, text, re.I):
        ref = match.group(1).lower()
        if re.fullmatch(r"v?\d+\.\d+\.\d+", ref):
            out.append(Constraint("==", parse_version(ref)))
            continue
        known = [row for sha, row in table.get("commits", {}).items() if len(ref) >= 7 and sha.startswith(ref)]
        span = next((r for r in trl_profiles() if known and r.low == parse_version(known[0]["range_from"])), None)
        if span is not None:
            out.append(Constraint(">=", span.low))
            out += [Constraint("<", span.high)] if span.high else []
    return out


def stated_in(text: str) -> dict[str, list[Constraint]]:
    """The clauses a file states for TRL, Unsloth, verl and OpenRLHF: pins (also a git install of TRL), and for
    TRL the modules it imports."""
    out = {name: found for name in NAMES if (found := pins_in(text, name))}
    if git := git_pins_in(text):
        out["trl"] = out.get("trl", []) + git
    if imported := imports_in(text):
        out["trl"] = out.get("trl", []) + imported
    return out


def outside_every_range(framework: str, clauses: list[Constraint]) -> str:
    """The one line for clauses that no range of verl's or OpenRLHF's table allows."""
    first = release_label(rl_profiles(framework)[0].low)
    return (f"{NAMES[framework]}{','.join(map(str, clauses))} is outside every {NAMES[framework]} release range "
            f"klgrpo knows ({first} and later, klgrpo/integrations/versions/{framework}.json); pass "
            f"--version {framework}==X with a release from {first} on")
