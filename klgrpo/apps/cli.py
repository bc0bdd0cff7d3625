"""The ``klgrpo`` command: train | verify-kl | explain | report | export | sweep | eval | kl | sft.

Each subcommand lives in its own module and receives the remaining arguments, so ``klgrpo train --help``
shows the training config's fields and ``klgrpo verify-kl --help`` the verifier's options. A KLGRPOError a
subcommand raises (bad input) prints here as one line, ``klgrpo NAME: error: ...``, with exit status 2.
"""

from __future__ import annotations

import sys
import warnings
from importlib import import_module

from klgrpo.apps.commands import COMMANDS
from klgrpo.apps.library_noise import silence_known_library_noise
from klgrpo.errors import KLGRPOError, KLGRPOWarning


def _usage() -> str:
    lines = ["usage: klgrpo <command> [options]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run `klgrpo <command> --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from klgrpo import __version__

        print(f"klgrpo {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"klgrpo: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = import_module(COMMANDS[name][0])
    _print_klgrpo_warnings_as_lines()
    silence_known_library_noise()  # a few named lines of transformers and DeepSpeed; every other warning prints
    try:
        return int(module.main(rest) or 0)
    except KLGRPOError as exc:  # bad input: one line naming the fix, no traceback
        print(f"klgrpo {name}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into `head` and the like: stop quietly
        sys.stderr.close()
        return 0


def _print_klgrpo_warnings_as_lines() -> None:
    """A KLGRPOWarning prints as one "warning: ..." line on stderr (not Python's file:line form); other
    warnings keep theirs."""
    default = warnings.showwarning
    if getattr(default, "prints_klgrpo_warnings", False):  # installed by an earlier call in this process
        return

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, KLGRPOWarning):
            print(f"warning: {message}", file=file or sys.stderr, flush=True)
        else:
            default(message, category, filename, lineno, file, line)

    show.prints_klgrpo_warnings = True
    warnings.showwarning = show


if __name__ == "__main__":
    raise SystemExit(main())
