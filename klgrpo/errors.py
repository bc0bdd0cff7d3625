"""User-facing errors and warnings.

Every error that a user's input can cause (a config field, a data file, a reward function) is a
``KLGRPOError``; the CLI prints its message as one line and exits without a traceback. Anything else
that escapes is a bug in klgrpo and keeps its traceback. A legal but questionable choice is a
``KLGRPOWarning`` through Python's ``warnings`` (:func:`warn`), never a printed line.
"""

from __future__ import annotations

import warnings


class KLGRPOError(Exception):
    """Base class for errors caused by user input; the message is one sentence naming the fix."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class ConfigError(KLGRPOError):
    """A config field has a bad value or a combination of fields is inconsistent."""


class EntryError(ConfigError):
    """A bad key of one entry of a list setting (a reward function, a reward model): ``who: key problem``. The
    config, which knows where the entry sits, names it by its path instead (``rewards.functions[0].weight ...``)."""

    def __init__(self, who: str, key: str, problem: str):
        super().__init__(f"{who}: {key} {problem}")
        self.key, self.problem = key, problem


class DataError(KLGRPOError):
    """A prompt dataset cannot be read or has a bad row or column."""


class RewardError(KLGRPOError):
    """A reward function cannot be loaded, raised, or returned something that is not one float per row."""


def first_line(exc: BaseException, limit: int | None = 200) -> str:
    """The first line of an exception's message (its type's name when empty), cut to ``limit`` characters: what a
    one-line error quotes from a library's multi-line message."""
    lines = str(exc).strip().splitlines()
    return (lines[0] if lines else type(exc).__name__)[:limit]


class KLGRPOWarning(UserWarning):
    """A legal but questionable setting, or a problem klgrpo worked around: raised through Python's ``warnings``
    (filter or record it like any warning; ``klgrpo`` commands print it as one ``warning: ...`` line)."""


def warn(message: str) -> None:
    """Issue ``message`` as a KLGRPOWarning, attributed to the caller's caller (the code that chose the setting
    or triggered the problem)."""
    warnings.warn(message, KLGRPOWarning, stacklevel=3)


__all__ = ["KLGRPOError", "ConfigError", "EntryError", "DataError", "RewardError", "KLGRPOWarning", "first_line",
           "warn"]


class NonFiniteError(KLGRPOError):
    """Training produced NaN or infinite values it could not skip past (train/guard.py), or weights about to be
    checkpointed hold them (store/checkpoint.py)."""
