"""benchmarks/results/vllm_cpu.json and vllm_cpu_first_run.json (benchmarks/vllm_cpu.py, two runs on the same
2-core machine under a load average of 6-7): the figures docs/benchmarks.md quotes, and ``rollout.sampler: auto``
following them on the CPU (vllm only where it is faster in every run)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from klgrpo.backends.samplers import auto_sampler

ROOT = Path(__file__).resolve().parents[1]
RUNS = [json.loads((ROOT / "benchmarks" / "results" / name).read_text())
        for name in ("vllm_cpu_first_run.json", "vllm_cpu.json")]


def test_each_verdict_is_its_runs_faster_sampler():
    for run in RUNS:
        seconds = run["generate_seconds"]
        assert set(seconds) == {"kv_loop", "vllm"} and all(v > 0 for v in seconds.values())
        assert run["faster"] == min(seconds, key=seconds.get)
        assert 0 < run["completion_tokens"] <= run["prompts"] * run["group"] * run["new_tokens"]
        assert run["mismatch_float32"]["logp_diff_max"] < 1e-4


def test_auto_picks_vllm_only_where_every_run_measured_it_faster(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    vllm_always_faster = all(run["faster"] == "vllm" for run in RUNS)
    assert not vllm_always_faster  # the runs disagree: kv_loop stays the CPU's automatic choice
    assert auto_sampler(model) == "kv_loop"


def test_docs_quote_the_results_files():
    doc = " ".join((ROOT / "docs" / "benchmarks.md").read_text().split())
    for run in RUNS:
        s, mismatch = run["generate_seconds"], run["mismatch_float32"]
        for figure in (f"{s['kv_loop']:.2f} s", f"{s['vllm']:.2f} s", f"{run['vllm_engine_start_seconds']:.0f} s",
                       f"{mismatch['logp_diff_max']:.1e}"):
            assert figure in doc, figure
