"""model.forward auto's evidence: klgrpo's teacher-forced decoder (fast) against transformers' forward on the same
batch, as the update runs it (log-probs, then their backward) and as the reference runs it (no gradient).

    python benchmarks/forward_choice.py                       # CPU, the small shape (~1 min on 2 busy cores)
    python benchmarks/forward_choice.py --device cuda --model-shape qwen0.5b --settings 8x8x64,8x8x256,8x8x1024

Both forwards feed the same blocked log-prob head (klgrpo.math.logprobs); only the model pass differs. Each
setting is prompts x G x completion tokens, the completions full length (no padding); the variants run
interleaved, medians over --repeats after one warm-up. --out writes the JSON results file whose per-device
winner (lower update + reference in total) klgrpo.core.forward.MEASURED_FASTER holds (a test checks it).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import machine_info, median, prepare_assets, print_table, set_threads  # noqa: E402

FORWARDS = ("fast", "transformers")


def synthetic_batch(n: int, g: int, t: int, vocab: int, device, prompt_len: int = 6):
    """n prompts x g completions of t random tokens, each prompt repeated over its group (as a rollout has it)."""
    import torch

    from klgrpo.core.rollout import RolloutBatch

    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, vocab, (n, prompt_len), generator=gen).repeat_interleave(g, 0)
    completion = torch.randint(3, vocab, (n * g, t), generator=gen)
    cmask = torch.ones_like(completion, dtype=torch.bool)
    return RolloutBatch(input_ids=torch.cat([prompts, completion], 1).to(device),
                        attention_mask=torch.ones(n * g, prompt_len + t, dtype=torch.long, device=device),
                        completion_ids=completion.to(device), completion_mask=cmask.to(device),
                        truncated=cmask[:, 0].to(device), prompt_len=prompt_len, group_size=g,
                        prompts=[""] * (n * g), completions=[""] * (n * g))


def _timed(fn, device: str) -> float:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def measure(model, batch, device: str, repeats: int) -> dict:
    """{forward: {update_s, reference_s}}: medians over ``repeats`` interleaved rounds after one warm-up."""
    import torch

    from klgrpo.core.forward import completion_logprobs

    def update(fast):
        logp, _ = completion_logprobs(model, batch, 1.0, with_entropy=True, fast_path=fast)
        logp.sum().backward()
        model.zero_grad(set_to_none=True)

    def reference(fast):
        with torch.inference_mode():
            completion_logprobs(model, batch, 1.0, fast_path=fast)

    times = {(f, k): [] for f in FORWARDS for k in ("update_s", "reference_s")}
    for round_ in range(repeats + 1):
        for name in (FORWARDS if round_ % 2 == 0 else FORWARDS[::-1]):
            fast = name == "fast"
            for key, fn in (("update_s", update), ("reference_s", reference)):
                seconds = _timed(lambda: fn(fast), device)
                if round_:
                    times[(name, key)].append(seconds)
    return {f: {k: median(times[(f, k)]) for k in ("update_s", "reference_s")} for f in FORWARDS}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-shape", default="small")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="", help="default: float32 on the CPU, bfloat16 on CUDA")
    parser.add_argument("--settings", default="2x8x32,2x8x128,2x16x128", help="prompts x G x tokens, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--workdir", default="")
    parser.add_argument("--out", default="", help="write the JSON results file here")
    args = parser.parse_args(argv)
    set_threads(args.threads)
    import torch
    from transformers import AutoModelForCausalLM

    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, _ = prepare_assets(args.model_shape, Path(args.workdir or tmp), dtype)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(args.device)
    model.train()
    rows = []
    for setting in args.settings.split(","):
        n, g, t = (int(x) for x in setting.split("x"))
        batch = synthetic_batch(n, g, t, model.config.vocab_size, args.device)
        rows.append({"setting": f"{args.model_shape}, {n} x {g}, {t} tokens", **measure(model, batch, args.device,
                                                                                       args.repeats)})
        print(f"  {rows[-1]}", file=sys.stderr, flush=True)
    result = {"command": "python benchmarks/forward_choice.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "device_type": torch.device(args.device).type, "dtype": dtype,
              "attn_implementation": model.config._attn_implementation, "machine": machine_info(), "rows": rows}
    print_table(["setting", "fast update ms", "fast reference ms", "transformers update ms",
                 "transformers reference ms"],
                [[r["setting"]] + [1000 * r[f][k] for f in FORWARDS for k in ("update_s", "reference_s")]
                 for r in rows])
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
