"""klgrpo with vLLM colocated (rollout.sampler vllm) against TRL's GRPOTrainer with vLLM colocated (use_vllm=True,
vllm_mode="colocate"): seconds per step and TRL / klgrpo, on one GPU. benchmarks/gpu_check.py runs it as its
part (l); not measured yet (no GPU was at hand when it was written).

Models: Qwen2.5-0.5B's and Qwen2.5-1.5B's shapes (benchmarks/_common.py MODEL_SHAPES qwen0.5b, qwen1.5b) with
random weights built and saved here, bf16; the same folder for both trainers. Each cell (shape, completion tokens
256 / 1024, group 8 / 16, ``--prompts`` prompts per step) trains each trainer for ``--warmup`` + ``--steps``
steps in one process (klgrpo's engine is built once per process, TRL builds its own per trainer) and keeps the
mean of the last ``--steps``. A random model rarely emits EOS: every completion runs to the limit, in both.
Needs a CUDA device, vllm and trl; elsewhere it says which is missing and measures nothing.
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = ("qwen0.5b", "qwen1.5b")
TOKENS = (256, 1024)
GROUPS = (8, 16)
MEMORY_FRACTION = 0.3  # each trainer's engine: a share of the GPU, the rest for training


def skip_reason(device: str) -> str | None:
    """Why this machine cannot run the comparison, or None where it can."""
    if device != "cuda":
        return f"needs a CUDA device (device is {device}): klgrpo+vLLM against TRL+vLLM is a GPU measurement"
    missing = [p for p in ("vllm", "trl") if importlib.util.find_spec(p) is None]
    return f"needs {' and '.join(missing)} installed" if missing else None


def run(device: str, work: Path, prompts: int = 8, warmup: int = 1, steps: int = 3) -> dict:
    """Every cell's seconds per step for both trainers and TRL / klgrpo; ``{"skipped": why}`` without a GPU."""
    reason = skip_reason(device)
    if reason:
        return {"skipped": reason}
    from benchmarks._common import save_model, write_prompts

    data = write_prompts(work)
    cells = []
    for shape in SHAPES:
        model_dir = save_model(shape, work / shape, dtype="bfloat16")
        for tokens in TOKENS:
            for group in GROUPS:
                cell = {"shape": shape, "tokens": tokens, "group": group, "prompts": prompts}
                cell["klgrpo_s_per_step"] = klgrpo_seconds(model_dir, data, work, cell, warmup, steps)
                cell["trl_s_per_step"] = trl_seconds(model_dir, data, work, cell, warmup, steps)
                cell["trl_over_klgrpo"] = cell["trl_s_per_step"] / cell["klgrpo_s_per_step"]
                print(f"[gpu_vllm] {shape} {tokens} tokens G {group}: klgrpo {cell['klgrpo_s_per_step']:.2f} s, "
                      f"TRL {cell['trl_s_per_step']:.2f} s, TRL / klgrpo {cell['trl_over_klgrpo']:.2f}", flush=True)
                cells.append(cell)
    return {"memory_fraction": MEMORY_FRACTION, "warmup": warmup, "steps": steps, "cells": cells}


def klgrpo_seconds(model_dir: Path, data: Path, work: Path, cell: dict, warmup: int, steps: int) -> float:
    from benchmarks._common import REWARD_SPEC
    from klgrpo.config.schema import GRPOConfig
    from klgrpo.run.metrics import read_metrics
    from klgrpo.run.trainer import GRPOTrainer

    out = work / "klgrpo" / f"{cell['shape']}-{cell['tokens']}-{cell['group']}"
    cfg = GRPOConfig.from_dict({
        "model": {"name_or_path": str(model_dir), "dtype": "bfloat16", "device": "cuda"},
        "data": {"source": str(data)}, "rewards": {"functions": [REWARD_SPEC]},
        "rollout": {"sampler": "vllm", "vllm": {"memory_fraction": MEMORY_FRACTION}, "group_size": cell["group"],
                    "prompts_per_step": cell["prompts"], "max_new_tokens": cell["tokens"], "temperature": 1.0},
        "kl": {"coef": 0.04}, "optim": {"lr": 1e-6},
        "train": {"steps": warmup + steps, "output_dir": str(out), "seed": 0},
        "logging": {"progress": False, "tensorboard": False, "plots": False}})
    GRPOTrainer(cfg, log=lambda *_: None).train()  # its engine is shut down with the run
    rows = [r for r in read_metrics(out) if "time/step" in r]
    return statistics.fmean(r["time/step"] for r in rows[warmup:])


def trl_seconds(model_dir: Path, data: Path, work: Path, cell: dict, warmup: int, steps: int) -> float:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from benchmarks._common import has_zero
    from klgrpo.core.data import load_prompts

    times: list[float] = []

    class StepTimes(TrainerCallback):
        def on_step_begin(self, *_, **__):
            torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, *_, **__):
            torch.cuda.synchronize()
            times.append(time.perf_counter() - self.t0)

    rows = load_prompts(str(data))
    args = GRPOConfig(
        output_dir=str(work / "trl"), per_device_train_batch_size=cell["prompts"] * cell["group"],
        num_generations=cell["group"], max_completion_length=cell["tokens"], temperature=1.0, learning_rate=1e-6,
        beta=0.04, bf16=True, use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=MEMORY_FRACTION,
        max_steps=warmup + steps, report_to="none", logging_steps=1, save_strategy="no", seed=0, disable_tqdm=True,
        dataloader_num_workers=0, log_completions=False, model_init_kwargs={"dtype": torch.bfloat16})
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=[has_zero], args=args,
                          train_dataset=Dataset.from_dict({"prompt": rows.prompts}),
                          processing_class=AutoTokenizer.from_pretrained(model_dir), callbacks=[StepTimes()])
    trainer.train()
    del trainer
    torch.cuda.empty_cache()
    return statistics.fmean(times[warmup:])
