"""What decides the KL in each release range of TRL, Unsloth, verl and OpenRLHF, as data (trl.json, written by
tools/trl_versions.py from TRL's source at every minor release; unsloth.json, read by hand from Unsloth's and
unsloth_zoo's source, each row naming the file and commit read; verl.json and openrlhf.json, written by
tools/rl_versions.py from every release tag), and the version constraints a file states.

A :class:`Profile` is one range's rules: for TRL and Unsloth in the terms of klgrpo.integrations.trl_mapping
(TRL's defaults there, the GRPOConfig fields it lacks or still has, and (Unsloth) the defaults Unsloth writes and
its own loss's KL); for verl and OpenRLHF the table's row itself (``release``), which
klgrpo.integrations.verl_mapping and openrlhf_mapping read.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from klgrpo.errors import ConfigError

HERE = Path(__file__).resolve().parent
Version = tuple[int, ...]
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
    """"0.18" -> (0, 18) (as written: ==0.18 means every 0.18.x); a post release "0.6.0.post1" -> (0, 6, 0, 1)."""
    parts = re.findall(r"\d+", text.split(".post")[0])[:3]
    if not parts:
        raise ConfigError(f"version {text!r} holds no number; write e.g. trl==0.18")
    post = re.match(r"\d+", text.split(".post")[1]) if ".post" in text and len(parts) == 3 else None
    return tuple(int(p) for p in parts) + ((int(post.group()),) if post else ())


def _bump(version: Version) -> Version:
    """The first version after every ``version.*``: (0, 18) -> (0, 19), (0, 18, 2) -> (0, 18, 3)."""
    return version[:-1] + (version[-1] + 1,)


def _padded(version: Version) -> Version:
    return version + (0,) * (3 - len(version))


def _key(version: Version) -> Version:
    """Comparable across lengths: (0, 6) -> (0, 6, 0, 0); a post release's fourth part after its release."""
    return version + (0,) * (4 - len(version))


def _label(version: Version) -> str:
    return ".".join(map(str, version[:3])) + (f".post{version[3]}" if len(version) > 3 else "")


def release_label(version: Version) -> str:
    """(1, 10, 0) -> "1.10.0"; a post release's fourth part as ".postN"."""
    return _label(version)


@dataclass(frozen=True)
class Constraint:
    """One ``op version`` clause; ``==0.18`` (fewer than three parts) matches every 0.18.x."""

    op: str
    version: Version

    def interval(self) -> tuple[Version, Version | None] | None:
        """[low, high) the clause allows, or None for != (taken as allowing every range)."""
        v = self.version
        # ==0.6.0 is that release alone (not its post releases); ==0.6 every 0.6.x
        bounds = {"==": (v, v + (1,) if len(v) == 3 else _bump(v)),
                  "~=": (v, _bump(v[:-1]) if len(v) > 1 else None), ">=": (v, None),
                  ">": (_bump(v), None), "<": ((0,), v), "<=": ((0,), _bump(v))}.get(self.op)
        return None if bounds is None else (_padded(bounds[0]), bounds[1] and _padded(bounds[1]))

    def __str__(self) -> str:
        return f"{self.op}{_label(self.version)}"


def constraints(spec: str) -> list[Constraint]:
    """``>=0.18,<0.20`` (or ``==0.18``) -> its clauses."""
    out = []
    for clause in filter(None, (c.strip() for c in spec.split(","))):
        op = next((o for o in _OPS if clause.startswith(o)), None)
        if op is None:
            raise ConfigError(f"version clause {clause!r}: begin it with one of {' '.join(_OPS)} (e.g. ==0.18)")
        out.append(Constraint(op, parse_version(clause[len(op):])))
    return out


def pins_in(text: str, package: str) -> list[Constraint]:
    """The version clauses a file states for ``package``: pins, requirements lines, ``pip install pkg==X``."""
    found = []
    for match in re.finditer(_PIN.replace("{name}", re.escape(package)), text, re.I):
        found.extend(constraints(re.sub(r"\s+|v(?=\d)", "", match.group(1))))
    return found


@dataclass(frozen=True)
class Profile:
    """One release range's rules. ``defaults`` override klgrpo.integrations.trl_mapping.TRL_DEFAULTS."""

    framework: str
    low: Version
    high: Version | None
    defaults: dict[str, Any] = field(default_factory=dict)
    absent: frozenset[str] = frozenset()
    removed_since: frozenset[str] = frozenset()
    read: tuple[str, ...] = ()
    unweighted_kl: bool = False  # Unsloth's own loss: k3 without the importance ratio, whatever the config says
    rewrites: dict[str, dict[str, Any]] = field(default_factory=dict)
    trl: Profile | None = None
    release: dict[str, Any] | None = None  # verl and OpenRLHF: the table's row

    @property
    def label(self) -> str:
        name = NAMES[self.framework]
        span = (f"{name} {_label(self.low)} or later" if self.high is None
                else f"{name} >= {_label(self.low)}, < {_label(self.high)}")
        return f"{span} (with TRL >= {_label(self.trl.low)}, < {_label(self.trl.high)})" if (
            self.trl and self.trl.high) else f"{span} (with TRL {_label(self.trl.low)} or later)" if self.trl else span

    def allows(self, clauses: list[Constraint]) -> bool:
        for clause in clauses:
            bounds = clause.interval()
            if bounds is None:
                continue
            low, high = bounds
            if high is not None and _key(high) <= _key(self.low) or (
                    self.high is not None and _key(low) >= _key(self.high)):
                return False
        return True


@lru_cache(maxsize=None)
def _table(name: str) -> dict[str, Any]:
    return json.loads((HERE / f"{name}.json").read_text(encoding="utf-8"))


@lru_cache(maxsize=None)
def trl_profiles() -> tuple[Profile, ...]:
    out = []
    for row in _table("trl")["ranges"]:
        out.append(Profile("trl", parse_version(row["from"]), parse_version(row["to"]) if row["to"] else None,
                           dict(row["defaults"]), frozenset(row["absent"]), frozenset(row["removed_since"]),
                           tuple(row["read"])))
    return tuple(out)


@lru_cache(maxsize=None)
def unsloth_config_fields() -> dict[str, tuple[Version, str | None]]:
    """The fields Unsloth's patched GRPOConfig adds to TRL's (unsloth.json's config_fields): name -> (the first
    Unsloth release that has it, what it changes; None: speed or memory only). TRL's own GRPOConfig refuses
    them, so a file that sets one runs on Unsloth."""
    fields = _table("unsloth")["config_fields"]["fields"]
    return {name: (parse_version(row["from"]), row["does"]) for name, row in fields.items()}


@lru_cache(maxsize=None)
def unsloth_profiles() -> tuple[Profile, ...]:
    """Each Unsloth range paired with each TRL range its pins allow."""
    table = _table("unsloth")
    rewrites = {k: v for k, v in table["rewrites"].items() if k in ("dapo", "dr_grpo")}
    out = []
    for row in table["ranges"]:
        low, high = parse_version(row["from"]), parse_version(row["to"]) if row["to"] else None
        for trl in trl_profiles():
            if not trl.allows(constraints(row["trl"])):
                continue
            own = {k: v for k, v in row["defaults"].items() if v is not None}
            out.append(Profile("unsloth", low, high, {**trl.defaults, **own}, trl.absent, trl.removed_since,
                               tuple(row["read"]) + tuple(table["loss"]["read"]), True, rewrites, trl))
    return tuple(out)


@lru_cache(maxsize=None)
def rl_profiles(framework: str) -> tuple[Profile, ...]:
    """verl's or OpenRLHF's ranges, each holding its table row."""
    return tuple(Profile(framework, parse_version(row["from"]), parse_version(row["to"]) if row["to"] else None,
                         dict(row["defaults"]), read=tuple(row["read"]), release=row)
                 for row in _table(framework)["ranges"])


def newest(framework: str) -> dict[str, Any]:
    """The newest range's row of verl's or OpenRLHF's table: the rules a config is mapped by without a range."""
    return _table(framework)["ranges"][-1]


def profiles(framework: str, clauses: dict[str, list[Constraint]]) -> list[Profile]:
    """The ranges of ``framework`` that the clauses allow (TRL's clauses also bound Unsloth's TRL)."""
    if framework in RL_FRAMEWORKS:
        return [p for p in rl_profiles(framework) if p.allows(clauses.get(framework, []))]
    if framework == "trl":
        return [p for p in trl_profiles() if p.allows(clauses.get("trl", []))]
    return [p for p in unsloth_profiles()
            if p.allows(clauses.get("unsloth", [])) and p.trl is not None and p.trl.allows(clauses.get("trl", []))]


def spans(found: list[Profile]) -> list[str]:
    """The ranges as few labels as possible: neighbouring TRL ranges (under the same Unsloth range) joined."""
    merged: list[Profile] = []
    for p in sorted(found, key=lambda p: (p.low, p.trl.low if p.trl else ())):
        last = merged[-1] if merged else None
        if last is not None and p.framework == last.framework != "unsloth" and last.high == p.low:
            merged[-1] = Profile(p.framework, last.low, p.high)
        elif (last is not None and p.trl and last.trl and (last.low, last.high) == (p.low, p.high)
              and last.trl.high == p.trl.low):
            merged[-1] = Profile(p.framework, p.low, p.high, trl=Profile("trl", last.trl.low, p.trl.high))
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
        span = next((r for r in table["ranges"] if known and r["from"] == known[0]["range_from"]), None)
        if span is not None:
            out.append(Constraint(">=", parse_version(span["from"])))
            out += [Constraint("<", parse_version(span["to"]))] if span["to"] else []
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
    first = rl_profiles(framework)[0]
    return (f"{NAMES[framework]}{','.join(map(str, clauses))} is outside every {NAMES[framework]} release range "
            f"klgrpo knows ({_label(first.low)} and later, klgrpo/integrations/versions/{framework}.json); pass "
            f"--version {framework}==X with a release from {_label(first.low)} on")


@dataclass(frozen=True)
class TableEstimator:
    """An estimator formula of verl.json / openrlhf.json in klgrpo's terms: its ``kl.estimator`` (None: klgrpo
    has none), the value cap the release applies (None: none), and why there is no counterpart."""

    estimator: str | None
    cap: float | None = None
    why: str = ""


#: (the value's estimator, the gradient's) as tools/rl_versions.py names them -> klgrpo's kl.estimator.
_KLGRPO_ESTIMATORS = {("k1", "k1"): "k1", ("k2", "k2"): "k2", ("k3", "k3"): "k3", ("k1", "k2"): "k1_st",
                      ("k3", "k2"): "k3_st"}


def table_estimator(formula: str) -> TableEstimator:
    """"k3 = exp(-l) - 1 + l, clamped to [-10, 10]" -> k3 capped at 10; "...; gradient of k2" -> the value's
    straight-through form; "abs = |l|", "raises NotImplementedError": no counterpart, with why."""
    match = re.fullmatch(r"(\w+) = [^,;]+(?:, clamped to \[-([\d.e+]+), [\d.e+]+\])?(?:; gradient of (\w+))?",
                         formula)
    if match is None:
        return TableEstimator(None, why=formula)
    value, cap, gradient = match.group(1), match.group(2), match.group(3) or match.group(1)
    name = _KLGRPO_ESTIMATORS.get((value, gradient))
    why = "" if name else f"{formula}: klgrpo has no such estimator"
    return TableEstimator(name, float(cap) if cap else None, why)
