"""Checkpoint save under FSDP2 on 2 CPU processes: the gathered save (full weights and AdamW moments on rank 0,
save_pretrained) against train.sharded_checkpoints (every rank writes its shards). Prints the wall time of a
save and rank 0's peak resident memory above its level before the save (sampled every 2 ms), mean of 3 saves.

    PYTHONPATH=$PWD python benchmarks/sharded_save.py [--hidden 384 --layers 8]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def worker(config_file: str, out_file: str) -> None:
    import psutil

    from klgrpo.config.schema import GRPOConfig
    from klgrpo.run.trainer import GRPOTrainer

    raw = json.loads(Path(config_file).read_text())
    results = {}
    for sharded in (False, True):
        raw["train"]["sharded_checkpoints"] = sharded
        raw["train"]["output_dir"] = str(Path(out_file).parent / f"run_{sharded}")
        trainer = GRPOTrainer(GRPOConfig.from_dict(raw), log=lambda *_: None)
        trainer.train_step()  # AdamW moments exist
        proc, times, peaks = psutil.Process(), [], []
        for i in range(3):
            trainer.grpo_step.completed = 10 + i
            base, peak, stop = proc.memory_info().rss, [0], threading.Event()

            def sample():
                while not stop.is_set():
                    peak[0] = max(peak[0], proc.memory_info().rss)
                    time.sleep(0.002)

            thread = threading.Thread(target=sample)
            thread.start()
            trainer.dist.barrier()
            t0 = time.perf_counter()
            trainer.save()
            times.append(time.perf_counter() - t0)
            stop.set()
            thread.join()
            peaks.append(max(peak[0], proc.memory_info().rss) - base)
        params = sum(p.numel() for p in trainer.model.parameters())  # a DTensor's numel is the whole tensor's
        results["sharded" if sharded else "gathered"] = {"seconds": sum(times) / 3, "peak_mib": sum(peaks) / 3 / 2**20,
                                                          "parameters": params}
    if trainer.dist.is_main:
        Path(out_file).write_text(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    from klgrpo.apps.demo.model import save_tiny_model_and_tokenizer
    from tests.helpers.launch import Launch, accelerate_command

    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        model = save_tiny_model_and_tokenizer(tmp / "model", seed=0, hidden=args.hidden, layers=args.layers, heads=4,
                                              intermediate=4 * args.hidden)
        rows = [{"prompt": f"{a:02d}+{b:02d}="} for a in range(10) for b in range(10)]
        (tmp / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        cfg = {"model": {"name_or_path": str(model), "dtype": "float32", "device": "cpu"},
               "data": {"source": str(tmp / "p.jsonl")},
               "rollout": {"group_size": 2, "prompts_per_step": 2, "max_new_tokens": 2},
               "rewards": {"functions": [{"name": "format", "kwargs": {"pattern": "0"}}]},
               "kl": {"coef": 0.0}, "train": {"steps": 100, "keep_checkpoints": 0},
               "logging": {"progress": False, "tensorboard": False, "plots": False}}
        (tmp / "cfg.json").write_text(json.dumps(cfg))
        done = Launch(accelerate_command("fsdp2", [__file__, "--worker", str(tmp / "cfg.json"),
                                                   str(tmp / "out.json")])).finish(timeout=900)
        if done.returncode != 0:
            sys.exit(done.output[-4000:])
        r = json.loads((tmp / "out.json").read_text())
    g, s = r["gathered"], r["sharded"]
    print(f"model: {g['parameters'] / 1e6:.1f} M parameters (float32), 2 processes, FSDP2, CPU")
    print(f"{'save':<10} {'seconds':>8} {'rank-0 peak MiB':>16}")
    for name, v in r.items():
        print(f"{name:<10} {v['seconds']:8.3f} {v['peak_mib']:16.1f}")
    print(f"sharded / gathered: time {s['seconds'] / g['seconds']:.2f}x, rank-0 peak memory "
          f"{s['peak_mib'] / max(g['peak_mib'], 1e-9):.2f}x")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3])
    else:
        main()
