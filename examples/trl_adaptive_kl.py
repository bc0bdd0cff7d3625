"""Five adaptive-KL methods on TRL's GRPOTrainer through klgrpo.trl, on a tiny local model on the CPU.

    pip install -e ".[trl,data]"
    python examples/trl_adaptive_kl.py               # 5 methods + 1 control x 40 steps, under a minute on one core

The model is a random-init tiny Llama with the demo's character tokenizer (no download). The reward is the
fraction of '7' characters in a completion, which does not depend on the completion's length, so any change
of length between methods comes from how each method applies the KL. Per method the script prints the mean
over the last half of the steps of: the raw per-token KL, the adapted KL, beta, the reward and the mean
completion length (docs/trl.md shows a run).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import PrinterCallback

from klgrpo.apps.demo.model import quiet_progress_bars, save_tiny_model_and_tokenizer
from klgrpo.apps.demo.tokenizer import build_char_tokenizer
from klgrpo.trl import GRPOConfig, GRPOTrainer

# name -> the fields that differ from the baseline; thresholds sit inside the range this run's KL takes
METHODS = {
    "baseline": {"kl_adaptation_method": "none"},
    "clip": {"kl_adaptation_method": "clip", "kl_clip_threshold": 0.05},
    "length_normalized": {"kl_adaptation_method": "length_normalized"},
    "dynamic": {"kl_adaptation_method": "dynamic", "reward_threshold": 0.1, "dynamic_beta_decay": 0.9,
                "beta_min": 0.0, "beta_schedule_steps": 1000},
    "sigmoid": {"kl_adaptation_method": "sigmoid", "kl_target": 0.05},
    # control: length_normalized divides every token's KL by its completion's length (~10 here), so it also
    # weakens the KL ~10x; this baseline with beta x 0.1 separates "weaker KL" from "normalised by length"
    "baseline_beta/10": {"kl_adaptation_method": "none", "beta_scale": 0.1},
}
COLUMNS = ("adaptive_kl/raw_kl", "adaptive_kl/adapted_kl", "adaptive_kl/current_beta", "reward",
           "completions/mean_length")


def sevens(completions, **_):
    """Fraction of the completion's characters that are '7' (0 for an empty completion)."""
    return [c.count("7") / max(len(c), 1) for c in completions]


def prompts(n: int = 64) -> Dataset:
    return Dataset.from_dict({"prompt": [f"{a:02d}+{(7 * a) % 100:02d}=" for a in range(n)]})


def run_method(name: str, fields: dict, model_dir: str, out_dir: Path, steps: int, beta: float, seed: int) -> dict:
    fields = dict(fields)
    beta = beta * fields.pop("beta_scale", 1.0)
    args = GRPOConfig(
        output_dir=str(out_dir / name), use_cpu=True, seed=seed, max_steps=steps, learning_rate=3e-2,
        per_device_train_batch_size=16, num_generations=8, max_completion_length=12, temperature=1.0,
        beta=beta, logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True, **fields)
    trainer = GRPOTrainer(model=model_dir, reward_funcs=sevens, args=args, train_dataset=prompts(),
                          processing_class=build_char_tokenizer())
    trainer.remove_callback(PrinterCallback)  # the table below replaces the per-step log lines
    trainer.train()
    logs = [h for h in trainer.state.log_history if "adaptive_kl/current_beta" in h]
    tail = logs[len(logs) // 2:]
    row = {key: sum(h[key] for h in tail) / len(tail) for key in COLUMNS}
    row["first_length"] = logs[0]["completions/mean_length"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--beta", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of: " + ", ".join(METHODS))
    opts = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp, quiet_progress_bars():
        model_dir = str(save_tiny_model_and_tokenizer(Path(tmp) / "model", seed=opts.seed, hidden=32, layers=2,
                                                      heads=2, intermediate=64))
        rows = {}
        for name in opts.methods.split(","):
            start = time.perf_counter()
            rows[name] = run_method(name, METHODS[name], model_dir, Path(tmp), opts.steps, opts.beta, opts.seed)
            rows[name]["seconds"] = time.perf_counter() - start
    print(f"\nmeans over steps {opts.steps // 2 + 1}-{opts.steps} (beta {opts.beta}, seed {opts.seed}):")
    print(f"| {'method':<17} | raw KL  | adapted KL | beta   | reward | length (step 1 -> late) | s   |")
    print(f"|{'-' * 19}|---------|------------|--------|--------|-------------------------|-----|")
    for name, r in rows.items():
        print(f"| {name:<17} | {r[COLUMNS[0]]:.4f}  | {r[COLUMNS[1]]:.4f}     | {r[COLUMNS[2]]:.4f} | "
              f"{r['reward']:.3f}  | {r['first_length']:5.2f} -> {r[COLUMNS[4]]:5.2f}          | {r['seconds']:3.0f} |")


if __name__ == "__main__":
    main()
