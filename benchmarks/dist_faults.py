"""Seconds from a fault to the last process's exit, 2 CPU processes (gloo) under `accelerate launch`.

Cases: a run-folder refusal on rank 0; an exception and a SIGKILL on rank 1 in the middle of step 2; a SIGKILL
of rank 1 while rank 0 writes the step-1 checkpoint; rank 1 stuck (alive, out of the collectives) with
train.dist_timeout_s=5; SIGTERM to the launcher. For each: the launcher's exit code, seconds to exit, and
what the run folder kept (logged steps, complete checkpoints).

    PYTHONPATH=$PWD python benchmarks/dist_faults.py [--engines ddp fsdp2]
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.helpers.launch import Launch, accelerate_command, metrics_steps, rank_pid  # noqa: E402

FAULTS = ROOT / "tests" / "helpers" / "faults.py"
WORKER = ROOT / "tests" / "helpers" / "fault_worker.py"


def config(model, data, run, steps=3, timeout_s=60, **fault):
    return {"model": {"name_or_path": str(model), "dtype": "float32", "device": "cpu"},
            "data": {"source": str(data)},
            "rollout": {"group_size": 4, "prompts_per_step": 4, "max_new_tokens": 4},
            "rewards": {"functions": [{"name": f"{FAULTS}:fault", "kwargs": {"kind": "none", **fault}}]},
            "kl": {"coef": 0.1},
            "train": {"steps": steps, "output_dir": str(run), "dist_timeout_s": timeout_s, "save_every": 1},
            "logging": {"progress": False, "tensorboard": False, "plots": False}}


def checkpoints(run: Path) -> list[str]:
    root = run / "checkpoints"
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


def run_case(name, engine, model, data, tmp: Path) -> dict:
    run = tmp / f"{engine}-{name}"
    cfg_file = tmp / f"{engine}-{name}.json"
    args = None
    if name == "refusal on rank 0":
        run.mkdir()
        (run / "summary.json").write_text("{}")
        cfg = config(model, data, run)
        args = [str(WORKER), str(cfg_file)]
    elif name == "exception on rank 1 mid-step":
        cfg = config(model, data, run, kind="raise", rank=1, call=2)
    elif name == "SIGKILL of rank 1 mid-step":
        cfg = config(model, data, run, kind="sigkill", rank=1, call=2)
    elif name == "rank 1 stuck, dist_timeout_s=5":
        cfg = config(model, data, run, timeout_s=5, kind="sleep", rank=1, call=2, seconds=300)
    else:  # SIGKILL of rank 1 mid-save, SIGTERM to the launcher
        cfg = config(model, data, run, steps=400)
    cfg_file.write_text(json.dumps(cfg))
    launch = Launch(accelerate_command(engine, args or ["-m", "klgrpo", "train", "--config", str(cfg_file)]))
    fault_at = None
    if name == "SIGKILL of rank 1 mid-save":
        while fault_at is None and launch.proc.poll() is None:
            if list((run / "checkpoints").glob(".tmp_step_*")) if (run / "checkpoints").is_dir() else []:
                pid = rank_pid(launch, 1)
                if pid:
                    import os

                    os.kill(pid, signal.SIGKILL)
                    fault_at = time.time()
            time.sleep(0.005)
    elif name == "SIGTERM to the launcher":
        while len(metrics_steps(run)) < 3 and launch.proc.poll() is None:
            time.sleep(0.05)
        launch.proc.send_signal(signal.SIGTERM)
        fault_at = time.time()
    started = time.time()
    done = launch.finish(timeout=400)
    if fault_at is None:
        marks = done.marks("fault injected") or sorted(done.marks("refused on rank"))
        fault_at = marks[0] if marks else started
    return {"engine": engine, "case": name, "exit": done.returncode, "seconds": round(done.exited_at - fault_at, 1),
            "timed_out": done.timed_out, "steps_logged": metrics_steps(run), "checkpoints": checkpoints(run)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engines", nargs="+", default=["ddp", "fsdp2"])
    parser.add_argument("--cases", nargs="+", default=None, help="substrings of the case names to run")
    args = parser.parse_args()
    from klgrpo.apps.demo.model import save_tiny_model_and_tokenizer

    cases = ["refusal on rank 0", "exception on rank 1 mid-step", "SIGKILL of rank 1 mid-step",
             "SIGKILL of rank 1 mid-save", "rank 1 stuck, dist_timeout_s=5", "SIGTERM to the launcher"]
    cases = [c for c in cases if args.cases is None or any(part in c for part in args.cases)]
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        model = save_tiny_model_and_tokenizer(tmp / "model", seed=0, hidden=32, layers=1, heads=2, intermediate=64)
        rows = [{"prompt": f"{a:02d}+{b:02d}=", "answer": f"{a + b:03d}"} for a in range(0, 40, 3) for b in range(5)]
        data = tmp / "add.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        print("| engine | case | launcher exit | seconds to the last exit | steps logged | checkpoints |")
        print("|---|---|---|---|---|---|")
        for engine in args.engines:
            for case in cases:
                r = run_case(case, engine, model, data, tmp)
                steps = r["steps_logged"]
                shown = f"1..{steps[-1]}" if steps and steps == list(range(1, len(steps) + 1)) else str(steps)
                print(f"| {engine} | {case} | {r['exit']} | {r['seconds']}{' (TIMED OUT)' if r['timed_out'] else ''}"
                      f" | {shown if steps else 'none'} | {', '.join(r['checkpoints']) or 'none'} |", flush=True)


if __name__ == "__main__":
    main()
