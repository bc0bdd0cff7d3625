"""``klgrpo kl POLICY REFERENCE --prompts FILE [--samples N]``: the KL between two models on a list of prompts,
without training.

Completions are sampled from POLICY (N per prompt, as training samples them). At every completion token t the
exact KL over the vocabulary between the two next-token distributions at that prefix is computed,

    KL_t = sum_v pi(v | prefix_t) (log pi(v | prefix_t) - log ref(v | prefix_t))     (the trainer's kl.estimator full)

and beside it the one-sample estimates of the sampled token y_t, with l_t = log pi(y_t) - log ref(y_t):
k1 = l_t, k2 = l_t^2 / 2, k3 = exp(-l_t) + l_t - 1. Summed over a completion's tokens, KL_t gives an unbiased
estimate of the sequence-level KL(pi || ref) on these prompts (chain rule), with no sampling noise inside a
position; k1 and k3 are unbiased for it too, with the noise of one sampled token per position. The table shows
each per token (mean over all completion tokens, percentiles, max) and per sequence (mean of the sums, their
standard deviation, and the standard error of the mean). Last, both models' mean per-token entropy at the same
prefixes (exact over the vocabulary, nats).
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from klgrpo.apps.commands import command_parser, whole_number
from klgrpo.backends.hf import DTYPE_NAMES
from klgrpo.errors import ConfigError

ESTIMATES = ("full", "k1", "k2", "k3")
#: --max-new-tokens when the policy's context has room for it after the longest prompt (else that room)
DEFAULT_MAX_NEW_TOKENS = 64


def _parser() -> argparse.ArgumentParser:
    p = command_parser("kl", "KL(POLICY || REFERENCE), exact over the vocabulary at every token of completions "
                             "sampled from POLICY, with the k1/k2/k3 estimates and their spread.")
    p.add_argument("policy", metavar="POLICY", help="model folder (a checkpoint, a merged export) or hub name")
    p.add_argument("reference", metavar="REFERENCE", help="the model to compare with (e.g. the SFT model)")
    p.add_argument("--prompts", required=True, metavar="FILE",
                   help="prompts: a .jsonl/.csv/.parquet file or dataset (as data.source)")
    p.add_argument("--prompt-column", default="prompt", help="column holding the prompt (default prompt)")
    p.add_argument("--limit", type=whole_number, default=0, help="use only the first N prompts (0: all)")
    p.add_argument("--samples", type=whole_number, default=4, help="completions sampled per prompt (default 4)")
    p.add_argument("--max-new-tokens", type=whole_number, default=None,
                   help=f"completion length limit (default {DEFAULT_MAX_NEW_TOKENS}, or what POLICY's context leaves "
                        f"after the longest prompt when that is less: max_position_embeddings minus its tokens)")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="sampling temperature; both models' distributions are taken at it (default 1)")
    p.add_argument("--as-chat", action="store_true", help="apply the tokenizer's chat template (instruct models)")
    p.add_argument("--system-prompt", default="", help="system message for --as-chat prompts")
    p.add_argument("--batch-size", type=whole_number, default=32, help="completions per forward (default 32)")
    p.add_argument("--seed", type=whole_number, default=0, help="sampling seed (default 0)")
    p.add_argument("--dtype", default="float32", choices=DTYPE_NAMES, help="model dtype (default float32)")
    p.add_argument("--device", default="auto", help="device (default auto: cuda when present)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON (never over an input)")
    p.add_argument("--overwrite", action="store_true", help="let --json replace an existing file")
    return p


def main(argv: list[str]) -> int:
    from klgrpo.apps.outputs import check_output, write_text_file

    args = _parser().parse_args(argv)
    if args.json is not None:
        check_output(args.json, "--json", {"POLICY": args.policy, "REFERENCE": args.reference,
                                           "--prompts": args.prompts}, args.overwrite)
    report = measure(args)
    print(format_report(report))
    if args.json:
        write_text_file(args.json, json.dumps(report, indent=2), "--json")
        print(f"written to {args.json}")
    return 0


def _check_numbers(args) -> None:
    for name, value, low in (("--samples", args.samples, 1), ("--max-new-tokens", args.max_new_tokens, 1),
                             ("--batch-size", args.batch_size, 1), ("--limit", args.limit, 0)):
        if value is not None and value < low:  # --max-new-tokens None: derived from the context (later)
            raise ConfigError(f"{name} must be >= {low}, got {value}")
    if not args.temperature > 0:
        raise ConfigError(f"--temperature must be > 0, got {args.temperature}")


def measure(args) -> dict:
    """Sample, then per-token exact KL and k1/k2/k3; returns the JSON-ready report (per_token, per_sequence)."""
    from klgrpo.apps.models import load_model_for_inference
    from klgrpo.config.schema import ModelConfig
    from klgrpo.core.data import load_prompts
    from klgrpo.core.full_kl import completion_logprobs_and_full_kl
    from klgrpo.core.reference import FrozenCopyReference
    from klgrpo.core.rollout import SamplingParams, generate_groups

    _check_numbers(args)
    model_cfg = ModelConfig(name_or_path=args.policy, dtype=args.dtype, device=args.device)
    policy, tokenizer = load_model_for_inference(args.policy, model_cfg, field="POLICY")
    ref_cfg = ModelConfig(name_or_path=args.reference, dtype=args.dtype, device=args.device)
    ref_model, ref_tokenizer = load_model_for_inference(args.reference, ref_cfg, field="REFERENCE")
    ref_model.to(next(policy.parameters()).device)
    if policy.get_output_embeddings().weight.shape[0] != ref_model.get_output_embeddings().weight.shape[0]:
        raise ConfigError(f"POLICY and REFERENCE have different vocabularies "
                          f"({policy.get_output_embeddings().weight.shape[0]} "
                          f"vs {ref_model.get_output_embeddings().weight.shape[0]} outputs): the KL needs one "
                          f"tokenizer")
    data = load_prompts(args.prompts, prompt_column=args.prompt_column, limit=args.limit or None, field="--prompts")
    given = args.max_new_tokens is not None
    _check_prompts_fit(policy, tokenizer, ref_tokenizer, data.prompts, args)
    reference = FrozenCopyReference(ref_model)
    torch.manual_seed(args.seed)
    params = SamplingParams(group_size=args.samples, max_new_tokens=args.max_new_tokens,
                            temperature=args.temperature, system_prompt=args.system_prompt, as_chat=args.as_chat)
    per_token, per_sequence = {}, {}
    prompts_per_call = max(1, args.batch_size // args.samples)
    for start in range(0, len(data.prompts), prompts_per_call):
        rollout = generate_groups(policy, tokenizer, data.prompts[start:start + prompts_per_call], params)
        values = _token_values(policy, reference, rollout, args.temperature, completion_logprobs_and_full_kl)
        mask = rollout.completion_mask.bool()
        for name, v in values.items():
            per_token.setdefault(name, []).append(v[mask])
            per_sequence.setdefault(name, []).append((v * mask).sum(-1))
    tokens = torch.cat(per_token["full"]).numel()
    report = {
        "policy": args.policy, "reference": args.reference, "prompts_file": args.prompts,
        "prompts": len(data.prompts), "samples_per_prompt": args.samples, "max_new_tokens": args.max_new_tokens,
        "max_new_tokens_from": "--max-new-tokens" if given else (
            "default" if args.max_new_tokens == DEFAULT_MAX_NEW_TOKENS else "context"),
        "temperature": args.temperature, "seed": args.seed, "sequences": len(data.prompts) * args.samples,
        "tokens": tokens,
        "per_token": {n: _spread(torch.cat(per_token[n])) for n in ESTIMATES},
        "per_sequence": {n: _mean_std_sem(torch.cat(per_sequence[n])) for n in ESTIMATES},
        "entropy": {model: float(torch.cat(per_token[f"entropy_{model}"]).mean()) for model in ("policy", "reference")},
    }
    return report


def _check_prompts_fit(policy, tokenizer, ref_tokenizer, prompts: list, args) -> None:
    """Both models read the same ids (the reference is scored on the policy's tokens), and every prompt plus
    --max-new-tokens fits the policy's context."""
    from klgrpo.core.rollout import context_overflow, encode_prompts

    texts = encode_prompts(tokenizer, prompts, args.system_prompt, args.as_chat)
    if args.max_new_tokens is None:
        args.max_new_tokens = _default_max_new_tokens(policy, tokenizer, texts, args.prompts)
    for text in texts:
        ids, ref_ids = tokenizer(text)["input_ids"], ref_tokenizer(text)["input_ids"]
        if ids != ref_ids:
            raise ConfigError(f"POLICY and REFERENCE have different tokenizers: they encode the prompt {text[:40]!r} "
                              f"to different ids ({ids[:8]} vs {ref_ids[:8]}); the KL compares the two models on one "
                              f"tokenization: pass models that share their tokenizer")
    if (over := context_overflow(policy, tokenizer, texts, args.max_new_tokens)) is not None:
        raise ConfigError(f"--max-new-tokens {args.max_new_tokens}: prompt {over[0]} of {args.prompts} has {over[1]} "
                          f"tokens, and with the completion it needs more positions than the model's context of "
                          f"{over[2]} (max_position_embeddings); lower --max-new-tokens to at most "
                          f"{over[2] - over[1]}")


def _default_max_new_tokens(policy, tokenizer, texts: list[str], prompts_file: str) -> int:
    """DEFAULT_MAX_NEW_TOKENS, or the positions the policy's context (max_position_embeddings) leaves after the
    longest prompt when that is less (the demo model's context is 32); a prompt that fills the context is
    refused in one line."""
    from klgrpo.core.rollout import context_overflow

    if (over := context_overflow(policy, tokenizer, texts, DEFAULT_MAX_NEW_TOKENS)) is None:
        return DEFAULT_MAX_NEW_TOKENS
    index, tokens, context = over
    if tokens >= context:
        raise ConfigError(f"prompt {index} of {prompts_file} has {tokens} tokens, and the model's context is "
                          f"{context} (max_position_embeddings): no position is left for a completion; shorten "
                          f"that prompt or leave it out")
    return context - tokens


@torch.no_grad()
def _token_values(policy, reference, rollout, temperature: float, full_kl_fn) -> dict[str, torch.Tensor]:
    """{full, k1, k2, k3, entropy_policy, entropy_reference}: [B, T] float64 values at every completion position
    (masked by the caller)."""
    from klgrpo.core.forward import completion_logprobs
    from klgrpo.math.kl import kl_estimate

    rows = slice(0, rollout.size)
    ref_logp, ref_entropy = completion_logprobs(reference.forward_model, rollout, temperature, rows,
                                                with_entropy=True, fast_path=reference.fast_path)
    logp, entropy, full = full_kl_fn(policy, reference, rollout, temperature, rows, ref_logp)
    logp, ref_logp = logp.double(), ref_logp.double()
    out = {"full": full.double(), "entropy_policy": entropy.double(), "entropy_reference": ref_entropy.double()}
    for name in ("k1", "k2", "k3"):
        out[name] = kl_estimate(logp, ref_logp, name, clamp=None)
    return out


def _spread(values: torch.Tensor) -> dict[str, float]:
    from klgrpo.verify.from_run import quantile

    if values.numel() == 0:
        return {k: math.nan for k in ("mean", "p50", "p90", "p99", "max", "min")}
    s = values.sort().values
    return {"mean": float(values.mean()), "p50": quantile(s, 0.5), "p90": quantile(s, 0.9),
            "p99": quantile(s, 0.99), "max": float(s[-1]), "min": float(s[0])}


def _mean_std_sem(values: torch.Tensor) -> dict[str, float]:
    n = values.numel()
    std = float(values.std()) if n > 1 else math.nan
    return {"mean": float(values.mean()), "std": std, "sem": std / math.sqrt(n) if n > 1 else math.nan}


def _length_note(r: dict) -> str:
    return " (what the model's context leaves after the longest prompt)" \
        if r.get("max_new_tokens_from") == "context" else ""


def format_report(r: dict) -> str:
    head = (f"KL(policy || reference): {r['policy']} vs {r['reference']}\n"
            f"{r['prompts']} prompts x {r['samples_per_prompt']} completions sampled from the policy (temperature "
            f"{r['temperature']:g}, up to {r['max_new_tokens']} tokens{_length_note(r)}, seed {r['seed']}): "
            f"{r['tokens']} tokens\n"
            f"full = exact over the vocabulary at each sampled prefix; k1/k2/k3 = one-sample estimates of the "
            f"sampled token\n")
    cols = f"{'':<5} {'per token':>10} {'p50':>10} {'p90':>10} {'p99':>10} {'min':>10} {'max':>10}   " \
           f"{'per sequence':>12} {'std':>10} {'sem':>10}"
    lines = [head + cols, "-" * len(cols)]
    for name in ESTIMATES:
        t, s = r["per_token"][name], r["per_sequence"][name]
        lines.append(f"{name:<5} {t['mean']:>10.5f} {t['p50']:>10.4g} {t['p90']:>10.4g} {t['p99']:>10.4g} "
                     f"{t['min']:>10.4g} {t['max']:>10.4g}   {s['mean']:>12.5f} {s['std']:>10.4g} {s['sem']:>10.4g}")
    if "entropy" in r:
        lines.append(f"mean entropy per token at these prefixes (nats): policy {r['entropy']['policy']:.5f}, "
                     f"reference {r['entropy']['reference']:.5f}")
    return "\n".join(lines)
