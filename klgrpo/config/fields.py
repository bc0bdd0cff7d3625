"""How a config field is declared (a default, a help text, its valid names) and how a value from YAML or the
command line becomes the field's type; klgrpo/config/schema.py declares the tree with these."""

from __future__ import annotations

import types
import typing
from dataclasses import field
from typing import Any

from klgrpo.errors import ConfigError


class Names:
    """The valid values of a field, read from their sources (tuples or registries) each time they are checked,
    so a name registered after this module was imported (a new estimator, controller, shaping) is accepted."""

    def __init__(self, *sources: Any):
        self.sources = sources

    def __iter__(self):
        for source in self.sources:
            yield from source

    def __contains__(self, value: object) -> bool:
        return any(value in source for source in self.sources)


def setting(default: Any, help: str, choices: Any = None) -> Any:
    """A config field: its default, its one-line help (`klgrpo train --help`) and its valid values (None: any)."""
    meta = {"help": help, "choices": choices}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def coerce(value: Any, typ: Any, path: str, origin: str) -> Any:
    origin_type = typing.get_origin(typ)
    if origin_type in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        return None if value is None else coerce(value, args[0], path, origin)
    bad = ConfigError(f"{path} in {origin} must be {getattr(typ, '__name__', typ)}, got {value!r}")
    if typ is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
            raise bad
        return int(value)
    if typ is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-4 (no dot) as a string: accept scientific notation
            value = float_text(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        return float(value)
    if typ is str:
        if value is None:
            return ""
        if isinstance(value, (dict, list)):
            raise bad
        return str(value)
    if typ is list:
        if isinstance(value, str):
            return [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise bad
        return value
    if typ is dict:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise bad
        return value
    return value


def float_text(text: str) -> float | str:
    """``"1e-4"``, ``"5E-6"``, ``"+2.5e3"``, ``".inf"`` -> float; anything else stays text (and is refused)."""
    cleaned = text.strip().replace("_", "")
    if cleaned.lower() in (".inf", "+.inf", "-.inf", ".nan"):
        cleaned = cleaned.replace(".", "")
    try:
        return float(cleaned)
    except ValueError:
        return text
