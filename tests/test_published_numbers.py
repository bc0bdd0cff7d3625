"""Numbers the README and docs quote come from committed results files written by the commands that produced
them: each quoted figure is read back from its file here (a rerun that changes a file must change the docs)."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_demo_gain_is_the_seed_sweeps():
    table = json.loads((ROOT / "docs" / "results" / "demo_seeds" / "table.json").read_text())
    (cell,) = table["cells"]
    stats = cell["stats"]["addition/change"]
    seed0 = next(r for r in cell["runs"] if r["seed"] == 0)["values"]["addition/change"]
    readme = " ".join(ROOT.joinpath("README.md").read_text().split())
    quoted = (f"the trained skill gains {stats['mean']:+.1f} ± {stats['std']:.1f} points over seeds "
              f"{min(cell['seeds'])}-{max(cell['seeds'])}, from {stats['min']:+.1f} to {stats['max']:+.1f}, and "
              f"seed 0, what `klgrpo train` runs, gains {seed0:+.1f}")
    assert quoted in readme
    assert "klgrpo sweep --grid kl.replay.coef=1 --seeds 0,1,2" in (ROOT / "docs/results/demo_seeds/table.md").read_text()


def test_custom_loss_cost_table_is_the_results_file():
    results = (ROOT / "benchmarks" / "results" / "custom_loss_cost_cpu.md").read_text()
    docs = (ROOT / "docs" / "benchmarks.md").read_text()
    rows = re.findall(r"^\| (tiny|small) +\| ([^|]+?) +\| ([\d.]+) +\| ([\d.]+) +\| ([\d.]+) +\| ([\d.]+) +\| ([\d.]+) +\|$",
                      results, flags=re.M)
    assert len(rows) == 10
    for shape, loss, *numbers in rows:
        label = loss.replace("ppo_kl", "`ppo_kl`").replace("2 passes", "2 passes (hosted route)")
        assert f"| {shape} | {label} | {' | '.join(numbers)} |" in docs, (shape, loss)
