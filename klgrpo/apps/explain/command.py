"""The ``klgrpo explain`` command: arguments, one file or run folder at a time, and what it writes.

    klgrpo explain FILE|- [--from FORMAT] [--call LINE] [--write klgrpo.yaml [--overwrite]] [--json OUT] [--strict]
    klgrpo explain --run FOLDER [--config FILE] [--warn-above X] [--warn-below X] [--json OUT] [--plot OUT.png]

Exit status: 0; 2 for bad input (one line on stderr); 3 with --strict when the token-level gradient of the first
update does not follow the reverse KL.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from klgrpo.apps.commands import command_parser
from klgrpo.apps.explain.reading import read_text
from klgrpo.apps.explain.report import explain, format_report
from klgrpo.apps.explain.sources import FORMATS, load_source
from klgrpo.apps.explain.trl_fields import TRL_FIELDS_VERSION
from klgrpo.errors import ConfigError, KLGRPOError

STRICT_EXIT = 3


def _parser() -> argparse.ArgumentParser:
    p = command_parser("explain", "The verdicts come from verify-kl's exact oracles.")
    p.add_argument("files", nargs="*", metavar="FILE", help="config file(s), launch or training script(s), or - "
                                                            "for standard input")
    p.add_argument("--from", dest="source", choices=FORMATS, help="the format (default: detected)")
    p.add_argument("--call", type=int, metavar="LINE", help="the GRPOConfig call or launcher command that starts "
                                                            "on LINE, when a script has several")
    p.add_argument("--write", metavar="YAML", help="write the klgrpo config to YAML (one FILE)")
    p.add_argument("--overwrite", action="store_true", help="let --write, --json or --plot replace an existing file")
    p.add_argument("--json", metavar="OUT", help="write the explanation as JSON to OUT (one FILE or --run)")
    p.add_argument("--strict", action="store_true",
                   help=f"exit {STRICT_EXIT} when the token-level on-policy gradient does not follow the reverse KL")
    p.add_argument("--run", metavar="FOLDER", help="what a run's KL did, from its logs: a klgrpo run folder or a "
                                                   "TRL output_dir / checkpoint-N folder")
    p.add_argument("--config", metavar="FILE", help="with --run: the run's config, explained beside the logs "
                                                    "(default: a klgrpo run's config.yaml)")
    p.add_argument("--warn-above", type=float, help="with --run: the drifting band (default: kl.warn_above)")
    p.add_argument("--warn-below", type=float, help="with --run: the not-learning band (default: kl.warn_below)")
    p.add_argument("--plot", metavar="PNG", help="with --run: draw KL, beta and reward against the step")
    return p


def _check_arguments(args: argparse.Namespace) -> None:
    if args.run is not None:
        if args.files or args.write or args.strict or args.call is not None:
            raise ConfigError("--run takes no FILE, --write, --strict or --call; pass the run's config with --config")
    else:
        if not args.files:
            raise ConfigError("pass a FILE (or - for standard input), or --run FOLDER")
        if args.config or args.plot or args.warn_above is not None or args.warn_below is not None:
            raise ConfigError("--config, --plot, --warn-above and --warn-below go with --run FOLDER")
        if (args.write or args.json) and len(args.files) != 1:
            raise ConfigError("--write and --json take one FILE; explain the files one at a time")
    inputs = [*args.files, *([args.config] if args.config else []), *([args.run] if args.run else [])]
    for option, out in (("--write", args.write), ("--json", args.json), ("--plot", args.plot)):
        if out is not None:
            _check_output(option, out, inputs, args.overwrite)


def _check_output(option: str, out: str, inputs: list[str], overwrite: bool) -> None:
    """Before anything is computed: the one rule of every command's outputs (klgrpo/apps/outputs.py): not an
    input, nor inside one (a run folder), and an existing file replaced only with --overwrite."""
    from klgrpo.apps.outputs import check_output

    if out and Path(out).is_dir():
        raise ConfigError(f"{option} {out!r} is a folder; pass a file path")
    parent = Path(out).parent if str(Path(out).parent) else Path(".")
    if out and not parent.is_dir():
        raise ConfigError(f"{option} {out}: the folder {parent} does not exist; create it or pick another path")
    check_output(out, option, inputs, overwrite)


def _write(option: str, out: str, text: str) -> None:
    from klgrpo.apps.outputs import write_text_file

    write_text_file(out, text, option)


def _one_line(text: str) -> str:
    """A YAML comment stays one line whatever a key holds."""
    return " ".join(str(text).split())


def _version_note(source: str) -> list[str]:
    """Which TRL's fields and defaults were used, when the installed TRL is another release."""
    if source not in ("trl", "unsloth"):
        return []
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("trl")
    except PackageNotFoundError:
        return []
    if installed.split(".")[:2] == TRL_FIELDS_VERSION.split(".")[:2]:
        return []
    return [f"TRL {installed} is installed; explain used TRL {TRL_FIELDS_VERSION}'s fields and defaults"]


def explain_file(path: str, args: argparse.Namespace) -> dict[str, Any]:
    text, origin = read_text(path)
    source, mapped = load_source(text, origin, args.source, args.call)
    report = explain(source, mapped)
    report["notes"] = _version_note(source)
    report["origin"] = origin
    return report


def _config_file(path: str) -> dict[str, Any]:
    text, origin = read_text(path)
    source, mapped = load_source(text, origin)
    return {**explain(source, mapped), "notes": _version_note(source), "origin": origin}


def _run(args: argparse.Namespace) -> int:
    from klgrpo.apps.explain.run_logs import format_run, plot, read_run, summarise
    from klgrpo.config.schema import GRPOConfig

    log = read_run(args.run)
    if args.config:
        static = _config_file(args.config)
        settings = GRPOConfig.from_dict(static["config"], origin=args.config).kl
    elif log.config_file is not None:
        static = _config_file(str(log.config_file))
        settings = GRPOConfig.from_yaml(log.config_file).kl
    else:
        static, settings = None, GRPOConfig().kl
        if log.kind == "trl":
            log.notes.append("training_args.bin is a pickle and is not read: pass --config FILE for the run's "
                             "settings")
    summary = summarise(log, settings, {"warn_above": args.warn_above, "warn_below": args.warn_below})
    summary["config_verdict"] = static
    print(format_run(summary))
    if static is not None:
        print(format_report(static["origin"], static))
    if args.plot:
        plot(log, Path(args.plot))
    if args.json:
        _write("--json", args.json, json.dumps(summary, indent=2) + "\n")
    return 0


def _explain_files(args: argparse.Namespace) -> int:
    status = 0
    for path in args.files:
        report = explain_file(path, args)
        print(format_report(report["origin"], report))
        if args.write:
            header = "".join(f"# no counterpart: {_one_line(k)}: {_one_line(v)}\n"
                             for k, v in report["unmapped"].items())
            _write("--write", args.write, f"# klgrpo config for {_one_line(report['origin'])} (klgrpo explain)\n"
                   f"{header}" + yaml.safe_dump(report["config"], sort_keys=False))
        if args.json:
            _write("--json", args.json, json.dumps(report, indent=2) + "\n")
        if args.strict and report["gradient"]["token_on_policy"] != "reverse":
            status = STRICT_EXIT
    return status


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        _check_arguments(args)
        return _run(args) if args.run is not None else _explain_files(args)
    except KLGRPOError as err:
        print(f"klgrpo explain: {err}", file=sys.stderr)
        return 2
