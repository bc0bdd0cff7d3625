"""What ``klgrpo sweep`` will run, read from its command line: the --grid product, the --cell settings, the seeds,
and one Run (setting, seed, folder) each; every value is checked as ``klgrpo train`` would read it
(klgrpo/apps/sweep/command.py runs the plan)."""

from __future__ import annotations

import itertools
from pathlib import Path

from klgrpo.apps.sweep.table import Cell, Run
from klgrpo.errors import KLGRPOError

#: Owned by the sweep: a run's folder and seed.
RESERVED = ("output-dir", "train.output_dir", "train.seed", "resume", "print-config")


class SweepError(KLGRPOError):
    """A bad sweep command line."""


def split_values(text: str) -> list[str]:
    """Split on commas outside brackets and quotes: ``0,[a,b],'x,y'`` -> ['0', '[a,b]', "'x,y'"]."""
    out, depth, quote, cur = [], 0, "", ""
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
            continue
        cur += ch
    out.append(cur.strip())
    return out


def check_override(key: str, value: str, origin: str) -> None:
    """``value`` must be one that ``klgrpo train --KEY VALUE`` accepts (the field exists, the type fits)."""
    from klgrpo.config.schema import GRPOConfig

    try:
        GRPOConfig().override({key: value}, origin=origin)
    except KLGRPOError as exc:
        raise SweepError(str(exc)) from None


def check_new_key(where: str, key: str, taken: list[str], seeds_hint: str, again: str) -> None:
    """``key`` is not one the sweep sets itself (a run's folder and seed) and not given before in ``where``."""
    if key in RESERVED:
        raise SweepError(f"{where}: {key} is set by the sweep for each run; {seeds_hint}")
    if key in taken:
        raise SweepError(f"{where}: {key} {again}")


def parse_grid(args: list[str]) -> list[tuple[str, list[str]]]:
    """``["kl.coef=0,0.1", ...]`` -> [("kl.coef", ["0", "0.1"]), ...], each value checked against the field's type."""
    grid: list[tuple[str, list[str]]] = []
    for arg in args:
        key, eq, values_text = arg.partition("=")
        key = key.strip().removeprefix("--")
        if not eq or not key or not values_text.strip():
            raise SweepError(f"--grid {arg!r}: write KEY=V1,V2,... e.g. --grid kl.coef=0,0.04")
        check_new_key(f"--grid {arg!r}", key, [k for k, _ in grid], "use --seeds for seeds",
                      "is already in another --grid; list all its values in one")
        values = split_values(values_text)
        if any(v == "" for v in values):
            raise SweepError(f"--grid {arg!r}: an empty value; separate values by single commas")
        if len(set(values)) != len(values):
            raise SweepError(f"--grid {arg!r}: a value is repeated")
        for v in values:
            check_override(key, v, f"--grid {arg}")
        grid.append((key, values))
    return grid


def cells_of(grid: list[tuple[str, list[str]]]) -> list[Cell]:
    """The product of the grid in --grid order (the last key varies fastest)."""
    keys = [k for k, _ in grid]
    return [Cell(tuple(zip(keys, combo))) for combo in itertools.product(*[v for _, v in grid])]


def parse_cell(arg: str) -> Cell:
    """``"kl.controller=adaptive,kl.coef=0.04,seeds=[1]"`` -> a Cell with those overrides and seeds (1,)."""
    overrides: list[tuple[str, str]] = []
    seeds: list[int] = []
    for part in split_values(arg):
        key, eq, value = part.partition("=")
        key, value = key.strip().removeprefix("--"), value.strip()
        if not eq or not key or not value:
            raise SweepError(f"--cell {arg!r}: write KEY=VALUE,KEY=VALUE,... "
                             "e.g. --cell kl.controller=adaptive,kl.coef=0.04")
        if key == "seeds":
            seeds = parse_seeds(value[1:-1] if value.startswith("[") and value.endswith("]") else value)
            continue
        check_new_key(f"--cell {arg!r}", key, [k for k, _ in overrides], "write seeds=[...] for seeds",
                      "is given twice")
        check_override(key, value, f"--cell {arg}")
        overrides.append((key, value))
    if not overrides:
        raise SweepError(f"--cell {arg!r}: give at least one KEY=VALUE besides seeds")
    return Cell(tuple(overrides), tuple(seeds))


def plan_runs(cells: list[Cell], seeds: list[int], out: Path) -> list[Run]:
    """One run per cell and seed (a cell's own seeds, else ``seeds``), once per (setting, seed), in order."""
    runs, seen = [], set()
    for cell in cells:
        for seed in cell.seeds or seeds:
            if (cell.name, seed) not in seen:
                seen.add((cell.name, seed))
                runs.append(Run(cell, seed, out / cell.name / f"seed={seed}"))
    return runs


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in split_values(text)]
    except ValueError:
        raise SweepError(f"--seeds {text!r}: write integers separated by commas, e.g. --seeds 0,1,2") from None
    if len(set(seeds)) != len(seeds):
        raise SweepError(f"--seeds {text!r}: a seed is repeated")
    return seeds


def overrides_in(extra: list[str]) -> set[str]:
    return {a[2:].partition("=")[0] for a in extra if a.startswith("--")}
