"""User-facing errors.

Every error that a user's input can cause (a config field, a data file, a reward function) is a
``KLGRPOError``; the CLI prints its message as one line and exits without a traceback. Anything else
that escapes is a bug in klgrpo and keeps its traceback.
"""

from __future__ import annotations


class KLGRPOError(Exception):
    """Base class for errors caused by user input; the message is one sentence naming the fix."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class ConfigError(KLGRPOError):
    """A config field has a bad value or a combination of fields is inconsistent."""


class DataError(KLGRPOError):
    """A prompt dataset cannot be read or has a bad row or column."""


class RewardError(KLGRPOError):
    """A reward function cannot be loaded, raised, or returned something that is not one float per row."""


def first_line(exc: BaseException, limit: int | None = 200) -> str:
    """The first line of an exception's message (its type's name when empty), cut to ``limit`` characters: what a
    one-line error quotes from a library's multi-line message."""
    lines = str(exc).strip().splitlines()
    return (lines[0] if lines else type(exc).__name__)[:limit]


__all__ = ["KLGRPOError", "ConfigError", "DataError", "RewardError", "first_line"]
