"""Reading an input of ``klgrpo explain`` within bounds: a size limit, text only, plain data only, a nesting limit.

Every refusal is one ConfigError naming the file and saying what explain reads; nothing here runs or imports
what it reads.
"""

from __future__ import annotations

import os
import re
import stat
import sys
from pathlib import Path
from typing import Any

import yaml

from klgrpo.errors import ConfigError

#: Larger inputs are no config (a launch script or training script is a few kB).
MAX_BYTES = 256 * 1024
#: Deeper mappings and lists are no config (verl's own are 4 levels deep).
MAX_DEPTH = 24
#: Values in one file (a config has hundreds); also bounds a YAML alias bomb.
MAX_VALUES = 50_000
WHAT_EXPLAIN_READS = ("a YAML or JSON config of TRL, Unsloth, verl, NeMo-RL, ROLL, SkyRL or klgrpo, a prime-rl TOML, "
                      "verl or SkyRL key=value lines, an OpenRLHF command line, a verl, OpenRLHF, SkyRL or slime "
                      "launch script, a Python script or notebook with a GRPOConfig(...) call")
READS = f"klgrpo explain reads {WHAT_EXPLAIN_READS} (and a run folder with --run)"


def refuse(origin: str, what: str) -> ConfigError:
    return ConfigError(f"{origin}: {what}; {READS}")


def on_line(found: list, line: int, origin: str, none_there: str, listed: str):
    """The item of ``found`` (each with a ``line``) that ``--call LINE`` picks, or one line naming the lines there
    are: "{origin}: no {none_there} {line}; {listed} 3, 9"."""
    chosen = [item for item in found if item.line == line]
    if not chosen:
        raise ConfigError(f"{origin}: no {none_there} {line}; {listed} "
                          f"{', '.join(str(item.line) for item in found) or '(none)'}")
    return chosen[0]


def read_text(path: str) -> tuple[str, str]:
    """(text, origin) of FILE or '-' (standard input), refused in one line unless it is small UTF-8 text."""
    if path == "-":
        return _decode(_read_stdin(), "<stdin>"), "<stdin>"
    try:
        info = os.stat(path)
    except OSError as err:
        what = "no such file" if isinstance(err, FileNotFoundError) else f"cannot be read ({err.strerror})"
        raise refuse(path, what) from None
    if stat.S_ISDIR(info.st_mode):
        raise refuse(path, "is a folder (for a run's logs: klgrpo explain --run FOLDER)")
    if not stat.S_ISREG(info.st_mode):
        raise refuse(path, "is not a regular file")
    if info.st_size > MAX_BYTES and suffix(path) == ".ipynb":
        raise ConfigError(f"{path}: is {info.st_size} bytes, more than the {MAX_BYTES} a notebook can be; its "
                          "outputs count: clear them (jupyter nbconvert --clear-output --inplace NOTEBOOK) or copy "
                          "the GRPOConfig(...) cell into a .py file")
    if info.st_size > MAX_BYTES:
        raise refuse(path, f"is {info.st_size} bytes, more than the {MAX_BYTES} a config or script can be")
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_BYTES + 1)
    except OSError as err:
        raise refuse(path, f"cannot be read ({err.strerror})") from None
    return _decode(data, path), path


def _read_stdin() -> bytes:
    buffer = getattr(sys.stdin, "buffer", None)
    if buffer is not None:
        return buffer.read(MAX_BYTES + 1)
    return sys.stdin.read(MAX_BYTES + 1).encode("utf-8", "surrogateescape")


def _decode(data: bytes, origin: str) -> str:
    if len(data) > MAX_BYTES:
        raise refuse(origin, f"is more than the {MAX_BYTES} bytes a config or script can be")
    if b"\0" in data:
        raise refuse(origin, "is a binary file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise refuse(origin, "is not UTF-8 text") from None
    if not text.strip():
        raise refuse(origin, "is empty")
    return text


class _NumberLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """YAML 1.1 with YAML 1.2's floats: ``1e-6`` and ``1.0e6`` are numbers, as OmegaConf (verl's Hydra) and
    TRL's typed parser read them; plain YAML 1.1 takes them for text."""


_NumberLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d[\d_]*(?:\.[\d_]*)?|\.\d[\d_]*)[eE][-+]?\d+$"),
    list("-+0123456789."))


def load_yaml(text: str, origin: str) -> Any:
    """The YAML (or JSON) document as plain data, or a ConfigError: a syntax error, a tag, a value that is not
    plain data (a date, bytes, a set), more than MAX_DEPTH levels or MAX_VALUES values."""
    loader = _NumberLoader
    try:
        data = yaml.load(text, Loader=loader)  # noqa: S506 - a safe loader
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        problem = getattr(err, "problem", None) or "not valid YAML"
        raise refuse(origin, f"is not valid YAML{where}: {problem}") from None
    except RecursionError:
        raise refuse(origin, f"nests deeper than {MAX_DEPTH} levels") from None
    check_plain(data, origin)
    return data


def load_toml(text: str, origin: str) -> Any:
    """A TOML document (prime-rl's configs) as plain data, or a ConfigError: a syntax error, a date or time value,
    more than MAX_DEPTH levels or MAX_VALUES values."""
    import tomllib

    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise refuse(origin, f"is not valid TOML: {err}") from None
    except RecursionError:
        raise refuse(origin, f"nests deeper than {MAX_DEPTH} levels") from None
    check_plain(data, origin)
    return data


def check_plain(data: Any, origin: str) -> None:
    """Only mappings, lists, strings, numbers, booleans and null, at most MAX_DEPTH deep and MAX_VALUES in all."""
    budget = [MAX_VALUES]
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        budget[0] -= 1
        if budget[0] < 0:
            raise refuse(origin, f"holds more than {MAX_VALUES} values")
        if depth > MAX_DEPTH:
            raise refuse(origin, f"nests deeper than {MAX_DEPTH} levels")
        if isinstance(value, dict):
            for key, item in value.items():
                if not isinstance(key, (str, int, float, bool)):
                    raise refuse(origin, f"has a key that is not a name ({type(key).__name__})")
                stack.append((item, depth + 1))
        elif isinstance(value, list):
            stack.extend((item, depth + 1) for item in value)
        elif not isinstance(value, (str, int, float, bool, type(None))):
            raise refuse(origin, f"holds a {type(value).__name__} value (a YAML tag?); configs hold plain values")


def suffix(origin: str) -> str:
    return Path(origin).suffix.lower() if origin != "<stdin>" else ""
