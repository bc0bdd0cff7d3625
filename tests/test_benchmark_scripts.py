"""The benchmark scripts run, in a small mode, as a user runs them (a subprocess from the repository root): a
change of an API they call fails here, not the next time someone re-measures a published number."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_custom_loss_cost_runs_every_variant_in_a_small_mode():
    done = subprocess.run([sys.executable, "benchmarks/custom_loss_cost.py", "--model-shape", "tiny", "--rounds", "1",
                           "--warmup", "0", "--prompts", "2", "--group-size", "2", "--max-new-tokens", "4"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in done.stdout.splitlines()
            if line.startswith("| tiny")]
    assert [r[1] for r in rows] == ["trainer built-in", "trainer typed custom", "datum built-in ppo_kl",
                                    "datum custom, 1 pass", "datum custom, 2 passes"]
    flops = {r[1]: float(r[2]) for r in rows}
    assert flops["trainer typed custom"] == flops["trainer built-in"]  # the same objective, recomputed
    assert flops["datum custom, 2 passes"] > flops["datum custom, 1 pass"]  # the extra no-grad forward
