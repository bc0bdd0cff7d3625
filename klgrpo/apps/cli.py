"""The ``klgrpo`` command: train | verify-kl | report | export | sweep.

Each subcommand lives in its own module and receives the remaining arguments, so ``klgrpo train --help``
shows the training config's fields and ``klgrpo verify-kl --help`` the verifier's options.
"""

from __future__ import annotations

import sys
from importlib import import_module

SUBCOMMANDS = {
    "train": ("klgrpo.apps.train", "run GRPO training (no arguments: the embedded CPU demo)"),
    "verify-kl": ("klgrpo.apps.verify_kl", "check every KL configuration's value and gradient against exact answers"),
    "report": ("klgrpo.apps.report", "redraw the plots and print a summary of a run folder"),
    "export": ("klgrpo.apps.export", "write a checkpoint (also a sharded one) as a from_pretrained folder"),
    "sweep": ("klgrpo.apps.sweep", "run a grid of trainings (default: the demo) and tabulate accuracy and retention"),
}


def _usage() -> str:
    lines = ["usage: klgrpo <command> [options]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
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
    if name not in SUBCOMMANDS:
        print(f"klgrpo: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = import_module(SUBCOMMANDS[name][0])
    try:
        return int(module.main(rest) or 0)
    except BrokenPipeError:  # output piped into `head` and the like: stop quietly
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
