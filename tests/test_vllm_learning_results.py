"""benchmarks/results/vllm_learning_cpu.json (benchmarks/vllm_learning.py: the demo's task at head_dim 64, 20 steps,
seeds 0-2, once with kv_loop and once with vllm): the file is what the script computes from its runs, and
docs/benchmarks.md and docs/vllm.md quote it."""

from __future__ import annotations

import importlib.util
import json
import math
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULT = json.loads((ROOT / "benchmarks" / "results" / "vllm_learning_cpu.json").read_text())


def _script():
    spec = importlib.util.spec_from_file_location("vllm_learning", ROOT / "benchmarks" / "vllm_learning.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _docs(name: str) -> str:
    return " ".join((ROOT / "docs" / name).read_text().split())


def test_every_seed_ran_both_samplers_from_the_same_start():
    assert RESULT["seeds"] == [0, 1, 2] and RESULT["steps"] == 20 and RESULT["window"] == 5
    assert RESULT["model"] == {"hidden": 128, "heads": 2, "layers": 2}  # head_dim 64
    for seed in RESULT["seeds"]:
        pair = {r["sampler"]: r for r in RESULT["runs"] if r["seed"] == seed}
        assert set(pair) == {"kv_loop", "vllm"}
        assert pair["kv_loop"]["before"] == pair["vllm"]["before"]  # the same SFT model
        assert pair["kv_loop"]["sft"] == pair["vllm"]["sft"]
    for run in RESULT["runs"]:
        w = RESULT["window"]
        assert len(run["rewards"]) == RESULT["steps"]
        assert math.isclose(run["reward_first"], statistics.fmean(run["rewards"][:w]), abs_tol=1e-12)
        assert math.isclose(run["reward_last"], statistics.fmean(run["rewards"][-w:]), abs_tol=1e-12)


def test_the_summary_is_computed_from_the_runs():
    expected = _script().summarize(RESULT["runs"], RESULT["seeds"])
    assert json.loads(json.dumps(expected)) == RESULT["summary"]


def test_the_docs_quote_the_table_and_the_per_seed_differences():
    summary, docs = RESULT["summary"], _docs("benchmarks.md")
    for sampler in ("kv_loop", "vllm"):
        r = summary[sampler]
        row = (f"| {sampler} | {r['reward_gain']:+.3f} | {r['addition_change']:+.1f} | {r['subtraction_change']:+.1f} "
               f"| {r['wall_s']['mean']:.1f}, {r['wall_s']['max']:.1f} |")
        assert row in docs, row
    diffs = summary["vllm_minus_kv_loop"]
    for key, name in (("addition_change", "addition"), ("subtraction_change", "subtraction")):
        values = ", ".join(f"{diffs[str(s)][key]:+.1f}" for s in RESULT["seeds"][:-1])
        last = f"{diffs[str(RESULT['seeds'][-1])][key]:+.1f}"
        assert f"{name} {values} and {last} points" in docs
    worst = max(abs(d[k]) for d in diffs.values() for k in ("addition_change", "subtraction_change"))
    assert f"agree within {worst:.1f} points at every seed" in docs
    assert f"differ by at most {worst:.1f} points" in _docs("vllm.md")
    # the claim "learns like" rests on this: within one binomial standard error of a difference on 200 prompts
    standard_error = 100 * math.sqrt(2 * 0.4 * 0.6 / 200)
    assert worst <= standard_error and f"on 200 prompts ({standard_error:.1f} points near 40%)" in docs
    both = summary["kv_loop"]["addition_change"]
    assert f"addition +{both:.1f} points on average with both" in _docs("vllm.md")
    assert f"{summary['vllm']['addition_change']:.1f}" == f"{both:.1f}" and both > 0


def test_the_docs_name_the_seed_whose_warm_start_fell_short():
    short = sorted({(r["seed"], r["sft"]["final_val_accuracy"]) for r in RESULT["runs"]
                    if not r["sft"]["reached_target"]})
    assert [seed for seed, _ in short] == [1]
    assert f"Seed 1's SFT warm start stopped at its 1500-step cap below the demo's 30% on addition " \
           f"({100 * short[0][1]:.1f}%" in _docs("benchmarks.md")
