"""Write docs/results/forgetting-runaway/ from the runaway sweep's folder: its table (``klgrpo sweep --table-only``),
each run's rollbacks and KL reach (from its summary.json), and the paired comparison against the published
forgetting sweep's beta 0, beta 0.01 and beta 0.01 + replay anchor runs (docs/results/forgetting/table.json; CPU
runs repeat bit for bit, so its runs at the same seeds are the pairs).

    python tools/runaway_results.py runs/runaway      # after: klgrpo sweep ... --output-dir runs/runaway --table-only

A run the folder lacks but the committed table has (an earlier session's run of the same command: CPU runs repeat bit
for bit) is kept from the committed table, marked ``"status": "earlier"``, and the header says which; the cells'
statistics and table.md are then recomputed with the sweep's own ``aggregate`` and ``table_markdown``.

tests/test_runaway_results.py recomputes the pairing from the two tables and checks what docs/ablation.md quotes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PUBLISHED = ROOT / "docs" / "results" / "forgetting" / "table.json"
TARGET = ROOT / "docs" / "results" / "forgetting-runaway"
#: The published settings the new ones are paired against: beta 0 (the sweep's baseline), beta 0.01 (the
#: rollback's own beta, without the guard) and the replay anchor at beta 0.01 (the settings beside the anchor,
#: without the guard or the auto horizon).
BASELINES = ("kl.coef=0", "kl.coef=0.01", "kl.coef=0.01,kl.replay.coef=1")


def paired(new: dict, published: dict) -> dict:
    """The new settings against each published baseline on the seeds both have (sweep_paired's comparison):
    every one against beta 0; those without the anchor against beta 0.01, those beside it against the anchor."""
    from klgrpo.apps.sweep.paired import paired_table

    base = {c["setting"]: c for c in published["cells"]}
    out = {}
    for name in BASELINES:
        cells = [c for c in new["cells"] if name == BASELINES[0] or _anchored(c["setting"]) == _anchored(name)]
        if cells:
            out[name] = paired_table({**new, "cells": [base[name]] + cells}, name)
    return out


def _anchored(setting: str) -> bool:
    return "kl.replay.coef=" in setting


def with_earlier_runs(table: dict, earlier: dict) -> dict:
    """``table`` with each run it lacks (not run yet, or absent) taken from ``earlier``, the committed table of the
    same command; the cells' statistics recomputed."""
    from klgrpo.apps.sweep.table import aggregate

    before = {(c["setting"], r["seed"]): r for c in earlier["cells"] for r in c["runs"] if "values" in r}
    kept = []
    for cell in table["cells"]:
        have = {r["seed"] for r in cell["runs"] if "values" in r}
        for (setting, seed), record in sorted(before.items(), key=lambda item: str(item[0])):
            if setting != cell["setting"] or seed in have:
                continue
            cell["runs"] = [r for r in cell["runs"] if r["seed"] != seed] + [{**record, "status": "earlier"}]
            cell["missing"] = [m for m in cell.get("missing", []) if m != seed]
            cell["seeds"].append(seed)
            kept.append(f"{setting} seed {seed}")
        keys = {k for r in cell["runs"] for k in r.get("values", {})}
        cell["stats"] = {k: aggregate([r["values"].get(k) for r in cell["runs"] if "values" in r])
                         for k in sorted(keys)}
    if kept:
        table["header"] = table["header"] + [f"- kept from the earlier run of the same command (CPU runs repeat bit "
                                             f"for bit): {'; '.join(kept)}"]
    return table


def run_records(sweep: Path, table: dict) -> list[dict]:
    """Each finished run's rollbacks (kl.on_runaway) and KL reach (adaptive controller), from its summary."""
    records = []
    earlier = {(r["setting"], r["seed"]): r for r in json.loads((TARGET / "runs.json").read_text())} \
        if (TARGET / "runs.json").exists() else {}
    for cell in table["cells"]:
        for run in cell["runs"]:
            summary_file = sweep / cell["setting"] / f"seed={run['seed']}" / "summary.json"
            if run.get("status") == "earlier":
                records.append(earlier[(cell["setting"], run["seed"])])
                continue
            if not summary_file.exists():
                continue
            summary = json.loads(summary_file.read_text())
            records.append({"setting": cell["setting"], "seed": run["seed"], "final_kl": summary["final_kl"],
                            "final_beta": summary["final_beta"], "runaway": summary.get("runaway"),
                            "kl_reach": summary.get("kl_reach")})
    return records


def main(sweep: Path) -> None:
    from klgrpo.apps.sweep.paired import paired_markdown
    from klgrpo.apps.sweep.table import table_markdown

    table = json.loads((sweep / "table.json").read_text())
    published = json.loads(PUBLISHED.read_text())
    if (TARGET / "table.json").exists():
        table = with_earlier_runs(table, json.loads((TARGET / "table.json").read_text()))
    records = run_records(sweep, table)
    TARGET.mkdir(parents=True, exist_ok=True)
    (TARGET / "table.json").write_text(json.dumps(table, indent=2))
    (TARGET / "table.md").write_text(table_markdown(table, table["header"]))
    pairs = paired(table, published)
    (TARGET / "paired.json").write_text(json.dumps(pairs, indent=1) + "\n")
    (TARGET / "paired.md").write_text("\n".join(paired_markdown(p) for p in pairs.values()))
    (TARGET / "runs.json").write_text(json.dumps(records, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
