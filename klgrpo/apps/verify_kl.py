"""``klgrpo verify-kl``: check every KL configuration's value and gradient against exact answers.

    klgrpo verify-kl                         values, token/sequence gradient tables, Monte Carlo, optimum
    klgrpo verify-kl --json out.json         the same, plus the results as JSON (schema: VerifyReport.as_dict)
    klgrpo verify-kl --samples 5000 --seed 3 Monte Carlo sample count and seed
    klgrpo verify-kl --from-run runs/demo    k1/k2/k3 statistics of the log-probs a run dumped (kl_dumps/);
                                             with --json: {"run_dir": ..., "dumps": [EstimatorStats]}
    klgrpo verify-kl --loss file.py:fn       what the KL part of your loss estimates and which KL its gradient
                                             follows (docs/custom_loss.md); with --json: CustomLossReport.as_dict

Exit status 0 when every check passes, 1 when one fails, 2 for a usage or input error.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from klgrpo.apps.commands import command_parser
from klgrpo.verify.montecarlo import DEFAULT_SAMPLES


def _parser() -> argparse.ArgumentParser:
    p = command_parser("verify-kl", "Every registered estimator x placement x sampling, by enumeration on a "
                                    "categorical and on a toy sequence model, by Monte Carlo, and by where "
                                    "exact-gradient ascent ends; or a summary of a training run's KL dumps.")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE (never over the run's "
                                                  "dumps or the --loss file; an existing FILE only with --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="let --json replace an existing file")
    p.add_argument("--samples", type=int, default=DEFAULT_SAMPLES,
                   help=f"Monte Carlo samples per check (default {DEFAULT_SAMPLES}; 0 skips Monte Carlo)")
    p.add_argument("--seed", type=int, default=0, help="Monte Carlo seed (default 0)")
    p.add_argument("--from-run", metavar="RUN_DIR",
                   help="instead of the checks, print k1/k2/k3 statistics of RUN_DIR/kl_dumps/step_*.safetensors")
    p.add_argument("--loss", metavar="FILE.py:FUNCTION",
                   help="instead of the checks, verify the KL part of your loss ('file.py:function' or "
                        "'module:function'); exit 0 when accepted, 1 when not")
    p.add_argument("--signature", choices=("auto", "typed", "datum"), default="auto",
                   help="--loss: fn(inp: LossInput) (typed) or fn(data, logprobs_list) (datum); auto reads the "
                        "required arguments")
    p.add_argument("--coef-arg", default="",
                   help="--loss, datum signature: the keyword argument holding the KL coefficient (default: the "
                        "first of kl_coef, beta, kl_beta, kl_weight, kl_coeff, coef it has)")
    return p


def _check_json_path(args) -> None:
    """--json is checked before the work, by the rule of every command's outputs (klgrpo/apps/outputs.py): never
    onto or into an input (the run's kl_dumps/, the --loss file), an existing file only with --overwrite. Its
    folder may be new (it is created when the results are written)."""
    from klgrpo.apps.outputs import overlap
    from klgrpo.core.kl_dump import DUMP_DIR
    from klgrpo.errors import ConfigError

    inputs = {}
    if args.from_run:
        inputs["--from-run"] = Path(args.from_run) / DUMP_DIR
    if args.loss and Path(args.loss.rpartition(":")[0]).is_file():
        inputs["--loss"] = args.loss.rpartition(":")[0]
    path = Path(args.json)
    if (why := overlap(path, inputs)) is not None:
        raise ConfigError(f"--json {path} {why}; pass another path")
    if path.is_dir():
        raise ConfigError(f"--json {path} is a folder; pass a file name (e.g. results.json)")
    if (path.exists() or path.is_symlink()) and not args.overwrite:
        raise ConfigError(f"--json {path} exists; pass another path, or --overwrite to replace it")


def _write_json(path: str, obj: dict) -> None:
    from klgrpo.apps.outputs import write_text_file
    from klgrpo.errors import ConfigError

    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--json {path}: cannot create its folder ({exc.strerror or exc}); pass a writable "
                          f"path") from None
    write_text_file(path, json.dumps(obj, indent=2) + "\n", "--json")


def _or_error(work):
    """work(), or None after printing a user error (a bad --loss, a run folder without dumps) as one line."""
    from klgrpo.errors import KLGRPOError

    try:
        return work()
    except KLGRPOError as exc:
        print(f"klgrpo verify-kl: {exc}", file=sys.stderr)
        return None


def _show(text: str, json_path: str | None, payload) -> None:
    print(text)
    if json_path:
        _write_json(json_path, payload())


def _regular_dumps(run_dir: str) -> None:
    """Every dump is a regular file, judged from its stat: opening a FIFO for reading waits for a writer."""
    from klgrpo.errors import ConfigError
    from klgrpo.verify.from_run import find_dumps

    for path in find_dumps(run_dir):
        if not path.is_file():
            raise ConfigError(f"KL dump {path} is not a regular file (a FIFO, a device or a folder); remove it, "
                              f"or point --from-run at a run folder whose kl_dumps/ holds the run's dumps")


def _from_run(run_dir: str, json_path: str | None) -> int:
    from klgrpo.verify.from_run import analyse_run, format_stats

    def analyse():
        _regular_dumps(run_dir)
        return analyse_run(run_dir)

    stats = _or_error(analyse)
    if stats is None:
        return 2
    _show(format_stats(stats), json_path, lambda: {"run_dir": str(run_dir), "dumps": [asdict(s) for s in stats]})
    return 0


def _custom_loss(args) -> int:
    from klgrpo.core.loss_api import load_loss_function
    from klgrpo.core.threads import torch_threads
    from klgrpo.verify.custom_loss import format_custom_report, verify_custom_loss

    def verify():
        fn = load_loss_function(args.loss, what="--loss")
        with torch_threads(1):
            return verify_custom_loss(fn, args.loss, args.signature, args.coef_arg)

    report = _or_error(verify)
    if report is None:
        return 2
    _show(format_custom_report(report), args.json, report.as_dict)
    return 0 if report.accepted_on_policy else 1


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.samples < 0:
        print("klgrpo verify-kl: --samples must be >= 0 (0 skips the Monte Carlo check)", file=sys.stderr)
        return 2
    if args.json and _or_error(lambda: _check_json_path(args) or True) is None:
        return 2
    if args.from_run:
        return _from_run(args.from_run, args.json)
    if args.loss:
        return _custom_loss(args)

    from klgrpo.verify.report import format_report, run_all

    start = time.perf_counter()
    report = run_all(samples=args.samples, seed=args.seed, monte_carlo=args.samples > 0)
    wall = time.perf_counter() - start
    report.seconds["total"] = wall
    print(format_report(report))
    print(f"wall time {wall:.1f} s (exact {report.seconds['exact']:.1f}, Monte Carlo "
          f"{report.seconds['monte_carlo']:.1f}, optimum {report.seconds['optimum']:.1f})")
    if args.json:
        _write_json(args.json, report.as_dict())
    return 0 if report.passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
