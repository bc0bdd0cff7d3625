"""Kill -9 loop: SIGKILL `klgrpo train` again and again (right after a step is logged, so often while its
checkpoint is being written) and resume each time; at the end the run must equal an uninterrupted one.

Checks: every step 1..N logged exactly once in metrics.jsonl, the final weights bitwise equal to the
uninterrupted run's, no .tmp_step_* / .trash_step_* folder left, and no SIGKILL that made a resume fail.

    PYTHONPATH=$PWD python benchmarks/kill_resume.py --kills 10 --steps 40
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def rows(run: Path) -> list[int]:
    try:
        lines = (run / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line)["step"])
        except ValueError:
            pass  # a line cut by the kill (the reader skips it too)
    return out


def command(config: Path, run: Path) -> list[str]:
    argv = [sys.executable, "-m", "klgrpo", "train", "--config", str(config), "--output-dir", str(run)]
    if (run / "checkpoints").is_dir() and any(p.name.startswith("step_") for p in (run / "checkpoints").iterdir()):
        return argv + ["--resume", "latest"]
    return argv + ["--overwrite"]  # killed before its first checkpoint: start again


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)

    from _common import write_prompts

    from klgrpo.apps.demo.model import save_tiny_model_and_tokenizer

    work = Path(tempfile.mkdtemp(prefix="klgrpo-kill-"))
    model = save_tiny_model_and_tokenizer(work / "model", seed=0, hidden=32, layers=1, heads=2, intermediate=64)
    config = work / "run.yaml"
    config.write_text(json.dumps({
        "model": {"name_or_path": str(model), "dtype": "float32", "device": "cpu"},
        "data": {"source": str(write_prompts(work))},
        "rollout": {"group_size": 4, "prompts_per_step": 4, "max_new_tokens": 4},
        "rewards": {"functions": [{"name": "format", "kwargs": {"pattern": "0"}}]},
        "kl": {"coef": 0.1, "controller": "adaptive", "target": 0.01, "horizon": 100},
        "optim": {"lr": 1e-2}, "train": {"steps": args.steps, "save_every": 1, "keep_checkpoints": 2,
                                         "num_iterations": 2, "torch_threads": 1},
        "logging": {"progress": False, "tensorboard": False, "plots": False},
    }))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    reference = work / "uninterrupted"
    subprocess.run(command(config, reference), check=True, env=env, capture_output=True)

    run = work / "killed"
    kills, mid_save, failures, t0 = 0, 0, [], time.perf_counter()
    while True:
        proc = subprocess.Popen(command(config, run), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        if kills < args.kills:
            seen = len(rows(run))
            while proc.poll() is None and len(rows(run)) < seen + rng.randint(1, 3):
                time.sleep(0.005)
            time.sleep(rng.uniform(0.0, 0.05))  # inside the checkpoint write that follows the logged step, often
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                kills += 1
        code = proc.wait()
        root = run / "checkpoints"
        if code == -signal.SIGKILL and root.is_dir() and any(p.name.startswith((".tmp_", ".trash_"))
                                                             for p in root.iterdir()):
            mid_save += 1  # killed while writing or pruning a checkpoint
        err = proc.stderr.read().decode(errors="replace").strip()
        if code not in (0, -signal.SIGKILL):
            failures.append(f"exit {code}: {err.splitlines()[-1] if err else ''}")
            break
        if code == 0:
            break

    from safetensors.torch import load_file

    final = f"checkpoints/step_{args.steps}/model.safetensors"
    a, b = load_file(str(reference / final)), load_file(str(run / final)) if (run / final).exists() else {}
    equal = a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    logged = rows(run)
    leftovers = [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith((".tmp_", ".trash_"))]
    print(f"kills survived: {kills} of {args.kills} (SIGKILL, resumed each time; {mid_save} of them while a "
          f"checkpoint was being written or pruned; {time.perf_counter() - t0:.0f} s)")
    print(f"steps logged once each: {logged == list(range(1, args.steps + 1))} ({len(logged)} rows)")
    print(f"final weights bitwise equal to the uninterrupted run: {equal}")
    print(f"leftover temporary folders: {leftovers or 'none'}; failed resumes: {failures or 'none'}")
    if failures or not equal or logged != list(range(1, args.steps + 1)):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
