"""Memory growth per training step: the Python heap (tracemalloc) and the RSS at checkpoints of a long run.

A run keeps nothing per step (the metrics go to metrics.jsonl; the summary needs only the last row and the
mean step time): the heap slope should be ~0 bytes/step. The previous trainer kept every metrics row in a
list; ``--keep-rows`` simulates that list beside the run to show what the slope looked like with it.

    PYTHONPATH=$PWD python benchmarks/memory_slope.py --steps 3000
    PYTHONPATH=$PWD python benchmarks/memory_slope.py --steps 3000 --keep-rows   # the old behaviour
"""

from __future__ import annotations

import argparse
import resource
import sys
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def slope(xs: list[float], ys: list[float]) -> float:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--keep-rows", action="store_true", help="also keep every metrics row (the old trainer)")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    from _common import scratch_folder, write_prompts

    from klgrpo.apps.demo.model import save_tiny_model_and_tokenizer
    from klgrpo.config.schema import GRPOConfig
    from klgrpo.run import trainer as trainer_module

    work = scratch_folder("klgrpo-mem-")
    model = save_tiny_model_and_tokenizer(work / "model", seed=0, hidden=32, layers=1, heads=2, intermediate=64)
    cfg = GRPOConfig.from_dict({
        "model": {"name_or_path": str(model), "dtype": "float32", "device": "cpu"},
        "data": {"source": str(write_prompts(work))},
        "rollout": {"group_size": 2, "prompts_per_step": 2, "max_new_tokens": 2},
        "rewards": {"functions": [{"name": "format", "kwargs": {"pattern": "0"}}]},
        "kl": {"coef": 0.1}, "optim": {"lr": 1e-3},
        "train": {"steps": args.steps, "output_dir": str(work / "run")},
        "logging": {"progress": False, "tensorboard": False, "plots": False},
    })
    trainer = trainer_module.GRPOTrainer(cfg, log=lambda *_: None)
    kept, samples = [], []
    real_step = trainer.run.train_step
    every = max(args.steps // 20, 1)

    def measured_step():
        metrics, observation = real_step()
        if args.keep_rows:
            kept.append(dict(metrics))
        if trainer.step % every == 0 and trainer.step >= args.steps // 5:  # after the warm-up allocations
            samples.append((trainer.step, tracemalloc.get_traced_memory()[0], rss_mb()))
        return metrics, observation

    trainer.run.train_step = measured_step
    tracemalloc.start()
    trainer.train()
    steps = [s for s, _, _ in samples]
    heap = slope(steps, [h for _, h, _ in samples])
    rss = slope(steps, [r * 2**20 for _, _, r in samples])
    print(f"steps {args.steps}, keep_rows {args.keep_rows}: heap {samples[0][1] / 2**20:.2f} -> "
          f"{samples[-1][1] / 2**20:.2f} MiB, RSS {samples[0][2]:.1f} -> {samples[-1][2]:.1f} MiB")
    print(f"slope: heap {heap:.0f} bytes/step, RSS {rss:.0f} bytes/step (least squares over steps "
          f"{steps[0]}..{steps[-1]})")


if __name__ == "__main__":
    main()
