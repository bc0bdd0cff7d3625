"""The recorded run of benchmarks/old_logprobs.py: rollout.old_logprobs sampler skipped the trainer forward (none
timed), trained the same thing at the same seed, and docs/benchmarks.md quotes its numbers."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks/results/old_logprobs_cpu.json"


def _record() -> dict:
    return json.loads(RESULTS.read_text())


def test_the_sampler_mode_skips_the_forward_and_trains_the_same_thing():
    record = _record()
    assert set(record["models"]) == {"demo", "smollm2"}
    for name, s in record["models"].items():
        assert s["sampler"]["forwards"] == 0 and s["trainer"]["forwards"] > 0, name
        assert s["sampler"]["forward_mean_s"] == 0.0 < s["trainer"]["forward_mean_s"], name
        assert 0 < s["forward_share"] < 1, name
        assert s["first_batch_equal"] and s["first_grad_norm_rel"] <= record["grad_rtol"], name
        assert s["weights_rel_l2"] <= record["weights_rtol"] and s["same_result"], name


def test_the_docs_quote_the_recorded_run():
    doc = " ".join((ROOT / "docs/benchmarks.md").read_text().split())
    for name, label in (("demo", "demo"), ("smollm2", "SmolLM2-135M")):
        s = _record()["models"][name]
        row = (f"| {label} | {s['trainer']['step_mean_s']:.3f} / {s['trainer']['step_max_s']:.3f} | "
               f"{s['sampler']['step_mean_s']:.3f} / {s['sampler']['step_max_s']:.3f} | "
               f"{s['trainer']['forward_mean_s']:.3f} | {s['forward_share']:.1%} | {s['saving']:.1%} | "
               f"{s['first_grad_norm_rel']:.1e} | {s['weights_rel_l2']:.1e} |")
        assert row in doc, row
    assert f"load average {_record()['machine']['load_avg_1m']}" in doc
    models = _record()["models"]
    same = {name: models[name]["steps_same_completions"] for name in models}
    steps = _record()["shape"]["steps"]
    said = f"completions stayed the same for {same['smollm2']} of {steps} steps, the demo's for all {same['demo']}"
    assert said in doc
    for name, label in (("demo", "the demo's step"), ("smollm2", "SmolLM2's")):
        assert f"{models[name]['saving']:.1%} of {label} against" in doc
    assert all(m["saving"] > 0 for m in models.values())
