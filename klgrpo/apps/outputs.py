"""The files a command writes on request (``--json FILE``): checked before the work starts, written whole or not
at all, and every way that fails (a missing or read-only folder, a full disk) is one line naming the option."""

from __future__ import annotations

import os
from pathlib import Path

from klgrpo.errors import ConfigError


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
    """Write ``text`` to ``path`` through a temporary sibling renamed into place; an OSError is one line."""
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


__all__ = ["check_writable_file", "write_text_file"]
