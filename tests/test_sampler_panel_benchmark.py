"""The recorded run of benchmarks/sampler_panel.py: the matched KV loop reads chi-square 0 and ESS 1 to rounding,
the planted sampler (1.1 x the temperature) moves every divergence the documented way, and docs/benchmarks.md
quotes the numbers."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORD = json.loads((ROOT / "benchmarks/results/sampler_panel_cpu.json").read_text())


def test_matched_reads_zero_and_one_and_planted_moves():
    assert RECORD["hot"] == 1.1 and set(RECORD["models"]) == {"demo", "smollm2"}
    for name, runs in RECORD["models"].items():
        matched, planted = runs["kv_loop"], runs["kv_loop_hot"]
        assert matched["extremes"]["sampler/chi2_token"] <= 1e-6 and matched["extremes"]["sampler/chi2_seq"] <= 1e-6
        assert matched["extremes"]["sampler/ess"] >= 1 - 1e-6 and matched["warnings"] == [] and matched["goal_met"]
        for key in ("sampler/chi2_token", "sampler/chi2_seq", "sampler/kl_k3", "sampler/kl_k1"):
            assert planted["means"][key] > 100 * max(matched["means"][key], 1e-12), (name, key)
        assert planted["means"]["sampler/ess"] < matched["means"]["sampler/ess"]
        assert planted["extremes"]["sampler/ratio_p99"] > 1.0
        assert "sampler/q4/ess" in planted["logged"] and "sampler/masked_token_frac" in planted["logged"]
    smol = RECORD["models"]["smollm2"]["kv_loop_hot"]
    assert smol["goal_met"] and len(smol["warnings"]) == 1 and "below rollout.warn_ess_below 0.9" in smol["warnings"][0]
    assert RECORD["models"]["demo"]["kv_loop_hot"]["warnings"] == []  # ESS 0.99: above the default band


def test_the_docs_table_is_the_record():
    doc = (ROOT / "docs/benchmarks.md").read_text()
    for name, label in (("demo", "demo"), ("smollm2", "SmolLM2-135M")):
        for sampler in ("kv_loop", "kv_loop_hot"):
            x = RECORD["models"][name][sampler]
            m, e = x["means"], x["extremes"]
            cells = (f"| {m['sampler/chi2_token']:.2e} | {m['sampler/chi2_seq']:.2e} | {m['sampler/ess']:.4f} / "
                     f"{e['sampler/ess']:.4f} | {m['sampler/kl_k3']:.2e} | {e['sampler/ratio_p99']:.4f} | "
                     f"{len(x['warnings'])} |")
            assert any(line.startswith(f"| {label} |") and line.endswith(cells) for line in doc.splitlines()), cells
    flat = " ".join(doc.split())
    planted = {name: RECORD["models"][name]["kv_loop_hot"]["means"]["sampler/ess"] for name in RECORD["models"]}
    assert f"the ESS fell to {planted['smollm2']:.2f} (mean)" in flat
    assert f"the ESS stayed at {planted['demo']:.2f} (mean)" in flat
