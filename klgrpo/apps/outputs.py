"""What a command writes, checked before the work starts, by one rule for every command:

- an output path may not be, contain or sit inside one of the command's inputs (both resolved through symbolic
  links: a link named as the output is judged by what it points at);
- an existing file is replaced only with ``--overwrite``;
- a refusal writes nothing (every check runs before the first byte is written).

Files are then written whole or not at all (a temporary sibling renamed into place, never through a link), and
every way that fails (a missing or read-only folder, a full disk) is one line naming the option.

    check_output(path, option, inputs, overwrite)              a file the command writes (--json, --plot, ...)
    check_output(path, option, inputs, overwrite, folder=True) a folder it writes into (--output-dir, OUT)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

from klgrpo.errors import ConfigError


def _resolved(path: str | os.PathLike) -> Path:
    return Path(os.path.abspath(os.path.realpath(path)))


def _inputs(inputs: dict[str, object] | Iterable) -> list[tuple[str, str]]:
    """(label, path) of the inputs that are on this machine (a hub name or an empty field is not a path)."""
    pairs = inputs.items() if isinstance(inputs, dict) else ((str(p), p) for p in inputs)
    return [(label, str(p)) for label, p in pairs
            if p and str(p) != "-" and (Path(str(p)).exists() or Path(str(p)).is_symlink())]


def overlap(path: str | os.PathLike, inputs, folder: bool = False, writes: Iterable[str] | None = None) -> str | None:
    """Why writing ``path`` would touch an input (None: it would not). ``writes``: for a folder, the names in it
    the command writes or deletes (None: any), so an input elsewhere in the folder is left out of the rule."""
    target = _resolved(path)
    for label, source in _inputs(inputs):
        src = _resolved(source)
        what = source if label == source else f"{label} {source}"
        if target == src:
            return f"is {what}, an input of this command"
        if src in target.parents:
            return f"is inside {what}, an input of this command"
        if folder and target in src.parents:
            first = src.relative_to(target).parts[0]
            if writes is None or first in writes:
                return f"holds {what}, an input of this command that it would write over"
    return None


def check_output(path: str | os.PathLike, option: str, inputs=(), overwrite: bool = False, *,
                 folder: bool = False, writes: Iterable[str] | None = None) -> None:
    """Refuse (one ConfigError line) an output ``path`` of ``option`` that breaks the rule above or cannot be
    written; for a file also a folder or an existing file without ``overwrite``."""
    if not str(path).strip():
        raise ConfigError(f"{option} is empty; pass {'a folder' if folder else 'a file'} path")
    if (why := overlap(path, inputs, folder, writes)) is not None:
        raise ConfigError(f"{option} {path} {why}; pass another path")
    if folder:
        return
    check_writable_file(str(path), option)
    if (Path(path).exists() or Path(path).is_symlink()) and not overwrite:
        raise ConfigError(f"{option} {path} exists; pass another path, or --overwrite to replace it")


def check_writable_file(path: str, option: str) -> None:
    """``path`` can be written: its folder exists and is writable, and it is not a folder itself."""
    target = Path(path)
    folder = target.parent
    if str(path).strip() == "" or target.is_dir():
        raise ConfigError(f"{option} {path!r} is not a file name; pass {option} FILE (e.g. results.json)")
    if not folder.is_dir():
        raise ConfigError(f"{option} {path}: the folder {folder} does not exist; create it or pass another path")
    if not os.access(folder, os.W_OK | os.X_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise ConfigError(f"{option} {path}: cannot write there (permission denied); pass a writable path")


def write_text_file(path: str, text: str, option: str) -> None:
    """Write ``text`` to ``path`` through a temporary sibling renamed into place (a link at ``path`` is
    replaced, never written through); an OSError is one line. The caller ran ``check_output`` first."""
    check_writable_file(path, option)
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, target)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise ConfigError(f"{option} {path}: cannot write it ({exc.strerror or exc}); pass a writable path with "
                          f"free space") from None


__all__ = ["check_output", "overlap", "check_writable_file", "write_text_file"]
