"""The recorded run of benchmarks/staleness.py (rollout.max_staleness 1 against 0 on SmolLM2-135M, 2 CPU threads in
all): each K = 1 batch came from the weights one update back, the generation was hidden behind the update, the
ratios are the record's own, and docs/benchmarks.md quotes them."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORD = json.loads((ROOT / "benchmarks/results/staleness_cpu.json").read_text())
#: the same through klgrpo's vLLM server on the same cores (benchmarks/staleness.py --sampler vllm_server)
SERVER = json.loads((ROOT / "benchmarks/results/staleness_vllm_server_cpu.json").read_text())


def test_the_record_is_consistent():
    assert RECORD["threads"] == 2 and RECORD["group"] == 8 and set(RECORD["lengths"]) == {"64", "128"}
    assert SERVER["sampler"] == "vllm_server" and SERVER["group"] == 8 and set(SERVER["lengths"]) == {"64", "128"}
    for record, (length, r) in [*((RECORD, x) for x in RECORD["lengths"].items()),
                                *((SERVER, x) for x in SERVER["lengths"].items())]:
        k0, k1 = r["runs"]["k0"], r["runs"]["k1"]
        assert len(k0) == len(k1) == record["seeds"]
        assert all(run["staleness"] == [0.0] * record["steps"] for run in k0)
        assert all(run["staleness"] == [0.0] + [1.0] * (record["steps"] - 1) for run in k1)
        ratios = [b["steps_per_second"] / a["steps_per_second"] for a, b in zip(k0, k1)]
        assert ratios == r["speedups"] and statistics.fmean(ratios) == r["speedup_mean"]
        # most of the generation was hidden behind the update: the trainer waited for under 60% of what K = 0 spent
        # generating (all of it at 64 tokens through the generation process)
        wait = {k: statistics.fmean(x["generate_wait_mean"] for x in r["runs"][k]) for k in ("k0", "k1")}
        assert wait["k1"] < 0.6 * wait["k0"], (length, wait)


def test_the_docs_quote_the_record():
    flat = " ".join((ROOT / "docs/benchmarks.md").read_text().split())
    for length, r in [*RECORD["lengths"].items(), *SERVER["lengths"].items()]:
        assert (f"{length} tokens: K=1 / K=0 steps per second {r['speedup_mean']:.2f}x (worst seed "
                f"{r['speedup_min']:.2f}x)") in flat
        for k in ("k0", "k1"):
            runs = r["runs"][k]
            row = (f"| {length} | {k[1]} | {statistics.fmean(x['steps_per_second'] for x in runs):.4f} | "
                   f"{max(x['step_seconds_max'] for x in runs):.1f} | "
                   f"{statistics.fmean(x['generate_wait_mean'] for x in runs):.1f} | "
                   f"{statistics.fmean(x['update_seconds_mean'] for x in runs):.1f} | "
                   f"{statistics.fmean(x['final_reward'] for x in runs):.3f} |")
            assert row in flat, row
    update = {k: statistics.fmean(x["update_seconds_mean"] for x in RECORD["lengths"]["64"]["runs"][k])
              for k in ("k0", "k1")}
    assert f"the update takes {update['k1']:.1f} s instead of {update['k0']:.1f} s" in flat
    ratios = [x for r in RECORD["lengths"].values() for x in r["speedups"]]
    assert f"ratios spread from {min(ratios):.2f}x to {max(ratios):.2f}x" in flat
