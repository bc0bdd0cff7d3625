"""Release versions and the clauses a spec or a file states, read by packaging with the rule pins are written
in: a version of fewer than three parts names its whole series (``==0.18`` is every 0.18.x)."""

from __future__ import annotations

from dataclasses import dataclass

from packaging.specifiers import Specifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from klgrpo.errors import ConfigError

OPS = ("==", "~=", ">=", "<=", "!=", ">", "<")


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
        op = next((o for o in OPS if clause.startswith(o)), None)
        if op is None or clause.startswith("==="):
            raise ConfigError(f"version clause {clause!r}: begin it with one of {' '.join(OPS)} (e.g. ==0.18)")
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
