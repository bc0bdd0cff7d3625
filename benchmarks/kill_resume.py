"""Kill-and-resume loop: stop `klgrpo train` again and again and resume each time; at the end the run must equal an
uninterrupted one.

SIGKILL (the default): right after a step is logged, so often while its checkpoint is being written; the next
session resumes from the newest complete checkpoint. SIGTERM (--signal term, a scheduler's preemption): at a
random moment inside a step (generation, the update, the optimizer step, the logging); the run saves the last
complete step, exits 143, and the next session runs `--resume latest`. --runs repeats the whole loop in fresh
folders; --report-to turns experiment trackers on (tensorboard, or trackio / wandb in offline mode / mlflow when
installed: their stores go under the work folder).

Checks, per run: every step 1..N logged exactly once in metrics.jsonl, the final weights bitwise equal to the
uninterrupted run's, no .tmp_step_* / .trash_step_* folder left, and no stop that made a resume fail.

    PYTHONPATH=$PWD python benchmarks/kill_resume.py --kills 10 --steps 40
    PYTHONPATH=$PWD python benchmarks/kill_resume.py --signal term --runs 20 --kills 1 --report-to tensorboard
    PYTHONPATH=$PWD python benchmarks/kill_resume.py --max-staleness 1 --kills 5 --steps 20   # generating ahead
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

SIGNALS = {"kill": signal.SIGKILL, "term": signal.SIGTERM}
#: what a session stopped by each signal exits with (SIGTERM before the trainer's handler is in place: -15)
STOPPED = {"kill": {-signal.SIGKILL}, "term": {143, -signal.SIGTERM}}


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
    return argv + ["--overwrite"]  # stopped before its first checkpoint: start again


def write_config(work: Path, steps: int, report_to: list[str], hidden: int = 32, layers: int = 1,
                 save_every: int = 1, max_staleness: int = 0) -> Path:
    from _common import write_prompts

    from klgrpo.apps.demo.model import save_tiny_model_and_tokenizer

    model = save_tiny_model_and_tokenizer(work / "model", seed=0, hidden=hidden, layers=layers, heads=2,
                                          intermediate=2 * hidden)
    config = work / "run.yaml"
    config.write_text(json.dumps({
        "model": {"name_or_path": str(model), "dtype": "float32", "device": "cpu"},
        "data": {"source": str(write_prompts(work))},
        "rollout": {"group_size": 4, "prompts_per_step": 4, "max_new_tokens": 4, "max_staleness": max_staleness,
                    **({"sampler": "kv_loop", "sampler_correction": "token_mask"} if max_staleness else {})},
        "rewards": {"functions": [{"name": "format", "kwargs": {"pattern": "0"}}]},
        "kl": {"coef": 0.1, "controller": "adaptive", "target": 0.01, "horizon": 100},
        "optim": {"lr": 1e-2}, "train": {"steps": steps, "save_every": save_every, "keep_checkpoints": 2,
                                         "num_iterations": 1 if max_staleness else 2, "torch_threads": 1},
        "logging": {"progress": False, "tensorboard": "tensorboard" in report_to, "plots": False,
                    "report_to": report_to, "project": "kill-resume"},
    }))
    return config


def tracker_env(work: Path) -> dict[str, str]:
    """Every tracker's store under the work folder, offline (nothing leaves the machine)."""
    return dict(os.environ, PYTHONUNBUFFERED="1", WANDB_MODE="offline", WANDB_SILENT="true",
                TRACKIO_DIR=str(work / "trackio"), MLFLOW_TRACKING_URI=f"sqlite:///{work / 'mlflow.db'}")


def interrupted_run(config: Path, run: Path, env: dict, args, rng: random.Random, step_seconds: float) -> dict:
    """One run stopped ``args.kills`` times and resumed each time; returns what it counted."""
    kills, mid_save, failures = 0, 0, []
    while True:
        proc = subprocess.Popen(command(config, run), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        if kills < args.kills:
            seen = len(rows(run))
            while proc.poll() is None and len(rows(run)) < seen + rng.randint(1, 3):
                time.sleep(0.005)
            # kill: inside the checkpoint write that follows the logged step, often; term: anywhere in a step
            time.sleep(rng.uniform(0.0, 0.05) if args.signal == "kill" else rng.uniform(0.0, 1.5 * step_seconds))
            if proc.poll() is None:
                proc.send_signal(SIGNALS[args.signal])
                kills += 1
        code = proc.wait()
        root = run / "checkpoints"
        if code in STOPPED[args.signal] and root.is_dir() and any(p.name.startswith((".tmp_", ".trash_"))
                                                                  for p in root.iterdir()):
            mid_save += 1  # stopped while writing or pruning a checkpoint
        err = proc.stderr.read().decode(errors="replace").strip()
        if code not in STOPPED[args.signal] | {0}:
            (run.parent / f"{run.name}.failure.txt").write_text(err)
            failures.append(f"exit {code}: {err.splitlines()[-1] if err else ''}")
            break
        if code == 0 or (root / f"step_{args.steps}").is_dir():
            break  # finished (a stop after the last checkpoint leaves nothing to resume)
    return {"kills": kills, "mid_save": mid_save, "failures": failures}


def compare(reference: Path, run: Path, steps: int) -> dict:
    from safetensors.torch import load_file

    final = f"checkpoints/step_{steps}/model.safetensors"
    a, b = load_file(str(reference / final)), load_file(str(run / final)) if (run / final).exists() else {}
    equal = a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    leftovers = [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith((".tmp_", ".trash_"))]
    return {"equal": bool(equal), "logged_once": rows(run) == list(range(1, steps + 1)), "rows": len(rows(run)),
            "leftovers": leftovers}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kills", type=int, default=10, help="stops per run")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--signal", choices=sorted(SIGNALS), default="kill")
    parser.add_argument("--runs", type=int, default=1, help="interrupted runs, each in a fresh folder")
    parser.add_argument("--report-to", nargs="*", default=[], help="trackers on (tensorboard, trackio, wandb, mlflow)")
    parser.add_argument("--hidden", type=int, default=32, help="the tiny model's width (wider: a longer AdamW step)")
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--save-every", type=int, default=1,
                        help="checkpoint every N steps (SIGTERM saves the last complete step in any case)")
    parser.add_argument("--work", default="", help="work folder (default: a new temporary one)")
    parser.add_argument("--max-staleness", type=int, default=0,
                        help="rollout.max_staleness: generation while training, batches issued ahead (K)")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    from _common import scratch_folder

    work = Path(args.work) if args.work else scratch_folder("klgrpo-kill-")
    work.mkdir(parents=True, exist_ok=True)
    config = write_config(work, args.steps, args.report_to, args.hidden, args.layers, args.save_every,
                          args.max_staleness)
    env = tracker_env(work)
    reference = work / "uninterrupted"
    subprocess.run(command(config, reference), check=True, env=env, capture_output=True)
    step_seconds = json.loads((reference / "summary.json").read_text())["seconds_per_step"]

    bad = 0
    for index in range(args.runs):
        t0 = time.perf_counter()
        run = work / f"stopped_{index}"
        counts = interrupted_run(config, run, env, args, rng, step_seconds)
        result = compare(reference, run, args.steps)
        ok = result["equal"] and result["logged_once"] and not counts["failures"] and not result["leftovers"]
        bad += not ok
        print(f"run {index}: {counts['kills']} of {args.kills} {args.signal.upper()}s survived "
              f"({counts['mid_save']} while a checkpoint was being written or pruned; "
              f"{time.perf_counter() - t0:.0f} s); steps logged once each: {result['logged_once']} "
              f"({result['rows']} rows); final weights bitwise equal to the uninterrupted run: {result['equal']}; "
              f"leftover temporary folders: {result['leftovers'] or 'none'}; "
              f"failed resumes: {counts['failures'] or 'none'}", flush=True)
    trackers = ", ".join(args.report_to) or "none"
    print(f"{args.runs - bad} of {args.runs} runs equal the uninterrupted one (signal {args.signal}, "
          f"trackers: {trackers}, {args.kills} stop(s) per run, {args.steps} steps)")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
