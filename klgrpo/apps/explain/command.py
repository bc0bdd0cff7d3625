"""The ``klgrpo explain`` command: arguments, one file or run folder at a time, and what it writes.

    klgrpo explain FILE|- [--from FORMAT] [--call LINE] [--write klgrpo.yaml [--overwrite]] [--json OUT] [--strict]
    klgrpo explain --run FOLDER [--config FILE] [--warn-above X] [--warn-below X] [--json OUT] [--plot OUT.png]

Exit status: 0; 2 for bad input (one line on stderr); 3 with --strict when the token-level gradient of the first
update does not follow the reverse KL.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import yaml

from klgrpo.apps.commands import command_parser
from klgrpo.apps.explain.reading import read_text
from klgrpo.apps.explain.report import explain, format_report
from klgrpo.apps.explain.sources import FORMATS, TRL_KINDS, load_source, load_variants
from klgrpo.apps.explain.trl_fields import TRL_FIELDS_VERSION
from klgrpo.errors import ConfigError, KLGRPOError

STRICT_EXIT = 3
#: A --version SPEC is a few clauses (``unsloth==2025.9.1;trl==0.22``); one longer than the longest file name most
#: systems allow (NAME_MAX) that names no file is neither.
MAX_VERSION_SPEC = 255
#: The frameworks whose releases --version may name, per format.
RELEASES_OF = {"trl": ("trl",), "adaptive_kl": ("trl",), "unsloth": ("unsloth", "trl"), "verl": ("verl",),
               "openrlhf": ("openrlhf",), "nemo_rl": ("nemo_rl",),
               "roll": ("roll",), "skyrl_train": ("skyrl_train",), "prime_rl": ("prime_rl",),
               "slime": ("slime",)}


def _parser() -> argparse.ArgumentParser:
    p = command_parser("explain", "The verdicts come from verify-kl's exact oracles.")
    p.add_argument("files", nargs="*", metavar="FILE", help="config file(s), launch or training script(s), or - "
                                                            "for standard input")
    p.add_argument("--from", dest="source", choices=FORMATS, help="the format (default: detected)")
    p.add_argument("--version", metavar="SPEC", help="the release the file runs on, e.g. trl==0.18, trl>=0.19, "
                                                     "unsloth==2025.3.1 (several: 'unsloth==2025.9.1;trl==0.22'), "
                                                     "verl==0.3, openrlhf==0.5.9.post1, nemo_rl==0.7.0, roll==0.3.0, "
                                                     "skyrl_train==0.3.0, prime_rl==0.8.0, slime==0.3.1, "
                                                     "or a file "
                                                     "that pins it "
                                                     "(setup.py, requirements.txt); default: what the file "
                                                     "states, else every release range")
    p.add_argument("--call", type=int, metavar="LINE", help="the GRPOConfig call or launcher command that starts "
                                                            "on LINE, when a script has several")
    p.add_argument("--write", metavar="YAML", help="write the klgrpo config to YAML (one FILE)")
    p.add_argument("--overwrite", action="store_true", help="let --write, --json or --plot replace an existing file")
    p.add_argument("--json", metavar="OUT", help="write the explanation as JSON to OUT (one FILE or --run)")
    p.add_argument("--strict", action="store_true",
                   help=f"exit {STRICT_EXIT} when the token-level on-policy gradient does not follow the reverse KL")
    p.add_argument("--run", metavar="FOLDER", help="what a run's KL did, from its logs: a klgrpo run folder, a "
                                                   "TRL output_dir / checkpoint-N folder, or a verl, OpenRLHF, "
                                                   "NeMo-RL or prime-rl run's TensorBoard folder or W&B offline run")
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
    for option, value in (("--warn-above", args.warn_above), ("--warn-below", args.warn_below)):
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise ConfigError(f"{option} must be a finite number >= 0 (a KL per token), got {value}")
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
    if source not in TRL_KINDS:
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
    """The report of FILE; for TRL, Unsloth, verl and OpenRLHF, under each release range the file may run on: one
    report when their verdicts agree, else one per distinct verdict in ``report["versions"]``."""
    from klgrpo.integrations.versions import stated_in

    text, origin = read_text(path)
    versions = _stated_by(args.version) if args.version else stated_in(text)
    source, variants = load_variants(text, origin, args.source, args.call, versions)
    named = RELEASES_OF.get(source, ())
    if args.version and not set(versions) & set(named):
        raise ConfigError(f"--version {args.version} names no release of what {origin} is ({source}); "
                          + (f"pass --version {named[0]}==X" if named else "a klgrpo config has no release"))
    reports = []
    for profile, mapped in variants:  # the newest range first: the top-level verdict is its
        report = explain(source, mapped)
        report["notes"] = _version_note(source) if profile is None else []
        reports.append((profile, report))
    groups = [([p for p in found if p is not None], one) for found, one in group_by_verdict(reports)]
    report = {**groups[0][1], "origin": origin, "releases": _spans(groups[0][0]),
              "default_changes": default_changes(variants)}
    if len(groups) > 1:
        report["versions"] = [{**one, "releases": _spans(found)} for found, one in groups]
    return report


def _spans(found: list) -> list[str]:
    """The ranges' labels: klgrpo.integrations.versions' frameworks, or explain's own tables (frameworks.py)."""
    from klgrpo.apps.explain import frameworks
    from klgrpo.integrations.versions import spans

    return frameworks.spans(found) if found and isinstance(found[0], frameworks.Release) else spans(found)


def default_changes(variants: list) -> list[str]:
    """For each TRL objective field the file leaves unset whose default differs between the TRL release ranges
    it was mapped under: each default with the first release that holds it, oldest first, e.g.
    "use_bias_correction_kl: False from TRL 0.14.0, True from TRL 1.10.0". (Unsloth's ranges pair with TRL's and
    write their own defaults: their verdicts per range say it.)"""
    from klgrpo.integrations.versions import release_label

    ranged = sorted(((p, m) for p, m in variants if p is not None and p.framework == "trl"), key=lambda pm: pm[0].low)
    out = []
    for name in dict.fromkeys(k for _, m in ranged for k in m.defaults):
        runs: list[tuple[Any, str]] = []
        for profile, mapped in ranged:
            value = mapped.defaults.get(name, runs[-1][0] if runs else None)
            if name in mapped.defaults and (not runs or runs[-1][0] != value):
                runs.append((value, f"TRL {release_label(profile.low)}"))
        if len(runs) > 1:
            out.append(f"{name}: " + ", ".join(f"{value!r} from {first}" for value, first in runs))
    return out


def _stated_by(option: str) -> dict[str, Any]:
    """--version SPEC, or --version FILE: the pins of the project file the run installs from (setup.py,
    pyproject.toml, requirements.txt)."""
    from klgrpo.integrations.versions import parse_option, stated_in

    if not _names_a_file(option):
        from klgrpo.apps.explain.frameworks import split_option

        if len(option) > MAX_VERSION_SPEC:
            raise ConfigError(f"--version {option[:40]}... is {len(option)} characters and names no file: pass a "
                              "release spec of a few clauses (e.g. --version trl==0.18 or 'unsloth==2025.9.1;"
                              "trl==0.22') or a file that pins it (setup.py, requirements.txt)")
        try:
            rest, own = split_option(option)
            clauses = {**(parse_option(rest) if rest else {}), **own}
        except ConfigError as exc:  # a clause's own complaint, said as --version's
            text = str(exc)
            raise ConfigError(text if text.startswith("--version") else f"--version {option!r}: {text}") from None
        for framework, said in clauses.items():
            _check_satisfiable(option, framework, said)
        return clauses
    try:
        text = read_text(option)[0]
    except ConfigError as exc:  # its reason, not what explain's input files may be
        reason = str(exc).split(";")[0].removeprefix(f"{option}:").strip()
        raise ConfigError(f"--version {option}: {reason}: pass a project file that pins the release (setup.py, "
                          "pyproject.toml, requirements.txt) or a spec such as trl==0.18") from None
    found = stated_in(text)
    if not found:
        raise ConfigError(f"--version {option}: the file pins no TRL, Unsloth, verl or OpenRLHF release (trl==X, "
                          "verl==X, trl @ git+...@TAG or a commit explain knows); pass --version trl==X")
    return found


def _names_a_file(option: str) -> bool:
    """Whether --version's text is a file's path; a text no file can be named by (too long, a NUL) is none."""
    try:
        return Path(option).is_file()
    except (OSError, ValueError):
        return False


def _check_satisfiable(option: str, framework: str, clauses: list) -> None:
    """Refuse --version clauses for one framework that no release satisfies together (``trl==0.18;trl==0.19``,
    ``trl>=0.20,<0.19``, ``trl==0.18,!=0.18``): each range would allow one clause or another, and the verdict
    would be of a release the user did not name."""
    from klgrpo.integrations.versions import release_label, satisfiable

    if not satisfiable(clauses):
        said = ",".join(map(str, clauses))
        raise ConfigError(f"--version {option}: no {framework} release satisfies {framework}{said} (its clauses "
                          f"exclude each other); name one release, e.g. --version "
                          f"{framework}=={release_label(clauses[0].version)}")


def group_by_verdict(reports: list[tuple[Any, dict[str, Any]]]) -> list[tuple[list[Any], dict[str, Any]]]:
    """(range, report) pairs with the same verdicts (gradients, value, beta's rule, aggregation, risks) -> one
    entry with every range that gives it, in the order first seen."""
    groups: dict[str, tuple[list[Any], dict[str, Any]]] = {}
    for profile, report in reports:
        key = json.dumps([report[k] for k in ("gradient", "value", "controller", "aggregation", "risks")],
                         sort_keys=True, default=str)
        groups.setdefault(key, ([], report))[0].append(profile)
    return list(groups.values())


def _config_file(path: str) -> dict[str, Any]:
    text, origin = read_text(path)
    source, mapped = load_source(text, origin)
    return {**explain(source, mapped), "notes": _version_note(source), "origin": origin}


def _run(args: argparse.Namespace) -> int:
    from klgrpo.apps.explain.run_logs import TRACKER_KINDS, format_run, plot, read_run, summarise
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
        elif log.kind in TRACKER_KINDS:
            log.notes.append("the run's config is not in its logs: pass --config FILE (its launch script or "
                             "YAML) for the config's verdict")
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


def _print_report(report: dict[str, Any]) -> None:
    versions = report.get("versions")
    for entry in versions or [report]:
        print(format_report(report["origin"], entry))
    if not versions:
        return
    if report.get("default_changes"):
        print(f"{report['origin']}: defaults it leaves unset that changed between releases (the verdicts above "
              f"take each range's): {'; '.join(report['default_changes'])}")
    said = "; ".join(f"on {' and '.join(e['releases'])}: {_answer(e, versions)}" for e in versions)
    example = {"verl": "verl==0.3", "openrlhf": "openrlhf==0.8.5", "nemo_rl": "nemo_rl==0.7.0",
               "roll": "roll==0.3.0", "skyrl_train": "skyrl_train==0.3.0", "prime_rl": "prime_rl==0.8.0",
               "slime": "slime==0.3.1"}.get(
        report["source"], "trl==0.18")
    print(f"{report['origin']}: the answer depends on the release ({said}): which do you run? Pass --version "
          f"(e.g. --version {example}), or pin it in the file")


def _answer(entry: dict[str, Any], versions: list[dict[str, Any]]) -> str:
    """One release range's answer in a few words: the gradients and beta, and where those agree with another
    range's, the aggregation and the risks that set it apart."""
    def base(e: dict[str, Any]) -> str:
        said = f"token {e['gradient']['token_on_policy']}, sequence {e['gradient']['sequence_on_policy']}, " \
               f"beta {e['controller']}"
        return said + (f", aggregation {e['aggregation']['name']}"
                       if len({v["aggregation"]["name"] for v in versions}) > 1 else "")

    if sum(base(e) == base(entry) for e in versions) == 1:
        return base(entry)
    own = [risk.split(":")[0] for risk in entry["risks"] if not all(risk in e["risks"] for e in versions)]
    return base(entry) + "".join(f", {risk}" for risk in own)


def _explain_files(args: argparse.Namespace) -> int:
    status = 0
    for path in args.files:
        report = explain_file(path, args)
        _print_report(report)
        if args.write:
            header = "".join(f"# no counterpart: {_one_line(k)}: {_one_line(v)}\n"
                             for k, v in report["unmapped"].items())
            _write("--write", args.write, f"# klgrpo config for {_one_line(report['origin'])} (klgrpo explain)\n"
                   f"{header}" + yaml.safe_dump(report["config"], sort_keys=False))
        if args.json:
            _write("--json", args.json, json.dumps(report, indent=2) + "\n")
        verdicts = [e["gradient"]["token_on_policy"] for e in report.get("versions", [report])]
        if args.strict and any(v != "reverse" for v in verdicts):
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
