"""klgrpo's commands, each with its module and its one-line summary: ``klgrpo --help`` lists the summaries, and
the commands built on argparse open their own --help with the same line (``command_parser``)."""

from __future__ import annotations

import argparse

#: command -> (module whose ``main(argv)`` runs it, summary)
COMMANDS = {
    "train": ("klgrpo.apps.train", "run GRPO training (no arguments: the embedded CPU demo)"),
    "verify-kl": ("klgrpo.apps.verify_kl", "check every KL configuration's value and gradient against exact answers"),
    "explain": ("klgrpo.apps.explain", "say which KL a TRL, verl, OpenRLHF, Unsloth or klgrpo config optimises, "
                                       "and the klgrpo config that reproduces it"),
    "report": ("klgrpo.apps.report", "redraw the plots and print a summary of a run folder"),
    "export": ("klgrpo.apps.export", "write a checkpoint (also a sharded one) as a from_pretrained folder"),
    "sweep": ("klgrpo.apps.sweep.command",
              "run a grid of trainings (default: the demo) and tabulate accuracy and retention"),
    "eval": ("klgrpo.apps.evaluate", "greedy accuracy of a checkpoint or model on the eval.sets of a config"),
    "kl": ("klgrpo.apps.kl", "KL between two models on a prompt list (exact per token, with k1/k2/k3)"),
    "sft": ("klgrpo.apps.sft", "supervised fine-tuning on prompt/answer data with TRL's SFTTrainer"),
}


def command_parser(name: str, details: str = "") -> argparse.ArgumentParser:
    """The parser of ``klgrpo NAME``: its description is the command's summary as a sentence, then ``details``.
    A bad option is one KLGRPOError line (``klgrpo NAME: error: ...``), not argparse's usage dump."""
    from klgrpo.errors import KLGRPOError

    summary = COMMANDS[name][1]
    parser = argparse.ArgumentParser(prog=f"klgrpo {name}", description=" ".join(
        filter(None, [summary[0].upper() + summary[1:] + ".", details])))

    def error(message: str):
        raise KLGRPOError(f"{message.replace('argument ', '')}; see klgrpo {name} --help")

    parser.error = error
    return parser


def whole_number(text: str) -> int:
    """An integer option's value, also written as 1e9 or 64.0 (as config fields accept them)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number: {text!r}") from None
    if not value.is_integer():
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
    return int(value)
