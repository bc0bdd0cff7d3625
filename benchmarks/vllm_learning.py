"""Does a run that samples with vLLM learn like one that samples with kv_loop? The embedded demo's task and
settings (an SFT-warmed tiny Llama learns addition, KL to the SFT reference with the adaptive beta, the replay
anchor on subtraction) with the model resized to hidden 128 in 2 heads of 64 (vLLM's CPU attention refuses the
demo's head_dim 16; one head of 64 at the demo's hidden 64 failed its SFT warm start at one seed of three),
``--steps`` steps per run, the same seeds for both samplers.

Run in the vLLM environment (.ci/vllm builds one):

    VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python benchmarks/vllm_learning.py \\
        --out benchmarks/results/vllm_learning_cpu.json

Per run: the mean training reward of the first and of the last ``--window`` steps, greedy accuracy on the
200-prompt addition and subtraction test sets before and after, the final KL and the run's wall time. Per
sampler: the means over the seeds; per seed: vllm's reward gain and accuracy change minus kv_loop's. The two
samplers draw different random completions from the same distribution (vLLM's own generator, seeded from the
run's), so the runs are not equal token for token; "learns like" means the gains agree within the spread that
seeds alone give. tests/test_vllm_learning_results.py reads the results file.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from benchmarks._common import machine_info, scratch_folder  # noqa: E402

SAMPLERS = ("kv_loop", "vllm")
#: the demo's model resized so each attention head has 64 dimensions
HIDDEN, HEADS = 128, 2
SETS = ("addition", "subtraction")
#: what each run records of its seed's SFT warm start (whether it reached the demo's 30% on addition)
SFT_FIELDS = ("steps", "reached_target", "final_val_accuracy")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--window", type=int, default=5, help="steps averaged at the start and at the end")
    parser.add_argument("--memory-fraction", type=float, default=0.01, help="the engine's KV cache, a share of RAM")
    parser.add_argument("--cache-dir", type=Path, default=None, help="the demo assets' cache (default: klgrpo's)")
    parser.add_argument("--sft-max-steps", type=int, default=None,
                        help="cap the SFT warm start (the small mode's; default: the demo's)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    args.seeds = [int(s) for s in args.seeds.split(",")]
    if args.steps < 2 * args.window:
        parser.error(f"--steps {args.steps} must be at least twice --window {args.window}")
    result = run(args)
    print(table(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


def run(args) -> dict:
    from dataclasses import replace

    from klgrpo.apps.demo.assets import DemoSettings, ModelSizes, prepare_demo_assets

    settings = DemoSettings(model=ModelSizes(hidden=HIDDEN, heads=HEADS))
    if args.sft_max_steps is not None:
        settings = replace(settings, sft=replace(settings.sft, max_steps=args.sft_max_steps))
    root = scratch_folder("vllm-learning-")
    runs = []
    for seed in args.seeds:
        assets = prepare_demo_assets(seed=seed, cache_dir=args.cache_dir, log=lambda *_: None, settings=settings)
        for sampler in SAMPLERS:
            runs.append({"seed": seed, "sampler": sampler, "sft": {k: assets.sft_stats[k] for k in SFT_FIELDS},
                         **train(assets, seed, sampler, args, root / f"{sampler}-{seed}")})
    return {"machine": machine_info(), "model": {"hidden": settings.model.hidden, "heads": HEADS,
                                                 "layers": settings.model.layers},
            "steps": args.steps, "window": args.window, "seeds": args.seeds, "runs": runs,
            "summary": summarize(runs, args.seeds)}


def train(assets, seed: int, sampler: str, args, out: Path) -> dict:
    from klgrpo.apps.demo_run import demo_config
    from klgrpo.run.metrics import read_metrics
    from klgrpo.run.trainer import GRPOTrainer

    cfg = demo_config(assets, seed).override({
        "rollout.sampler": sampler, "rollout.vllm.memory_fraction": args.memory_fraction,
        "train.steps": args.steps, "train.output_dir": str(out), "train.save_every": 0,
        "train.max_wall_seconds": 0, "eval.every": 0, "logging.progress": False, "logging.plots": False,
        "logging.tensorboard": False})
    start = time.perf_counter()
    summary = GRPOTrainer(cfg, log=lambda *_: None).train()
    wall = time.perf_counter() - start
    rewards = [r["train/reward"] for r in read_metrics(out) if "train/reward" in r]
    return {"reward_first": statistics.fmean(rewards[:args.window]),
            "reward_last": statistics.fmean(rewards[-args.window:]), "rewards": rewards,
            "before": {s: summary["eval_before"][s] for s in SETS},
            "after": {s: summary["eval_after"][s] for s in SETS}, "final_kl": summary.get("final_kl"), "wall_s": wall}


def summarize(runs: list[dict], seeds: list[int]) -> dict:
    """Per sampler the means over the seeds; per seed vllm minus kv_loop (reward gain, accuracy changes in
    points)."""
    def gain(r):
        return r["reward_last"] - r["reward_first"]

    def change(r, s):
        return 100 * (r["after"][s] - r["before"][s])

    out = {}
    for sampler in SAMPLERS:
        rows = [r for r in runs if r["sampler"] == sampler]
        out[sampler] = {"reward_gain": statistics.fmean(gain(r) for r in rows),
                        **{f"{s}_change": statistics.fmean(change(r, s) for r in rows) for s in SETS},
                        "wall_s": {"mean": statistics.fmean(r["wall_s"] for r in rows),
                                   "max": max(r["wall_s"] for r in rows)}}
    pairs = {seed: {r["sampler"]: r for r in runs if r["seed"] == seed} for seed in seeds}
    out["vllm_minus_kv_loop"] = {
        str(seed): {"reward_gain": gain(p["vllm"]) - gain(p["kv_loop"]),
                    **{f"{s}_change": change(p["vllm"], s) - change(p["kv_loop"], s) for s in SETS}}
        for seed, p in pairs.items()}
    return out


def table(result: dict) -> str:
    s = result["summary"]
    lines = [f"demo task, hidden {result['model']['hidden']}, {result['model']['heads']} head(s), "
             f"{result['steps']} steps, seeds {result['seeds']}; reward gain = mean of the last "
             f"{result['window']} steps - mean of the first {result['window']}",
             "| sampler | reward gain | addition change (pts) | subtraction change (pts) | wall s mean | max |",
             "|---" * 6 + "|"]
    for sampler in SAMPLERS:
        r = s[sampler]
        lines.append(f"| {sampler} | {r['reward_gain']:+.3f} | {r['addition_change']:+.1f} | "
                     f"{r['subtraction_change']:+.1f} | {r['wall_s']['mean']:.1f} | {r['wall_s']['max']:.1f} |")
    for seed, d in s["vllm_minus_kv_loop"].items():
        lines.append(f"seed {seed}: vllm - kv_loop: reward gain {d['reward_gain']:+.3f}, addition "
                     f"{d['addition_change']:+.1f} pts, subtraction {d['subtraction_change']:+.1f} pts")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
