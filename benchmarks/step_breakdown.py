"""Where a klgrpo step's time goes (time/generate, time/reference, time/old_logp, time/update, time/step), and
what the KL costs: kl.coef 0 (monitor off: no reference model at all) against kl.coef 0.04, with
num_iterations 1 and 4.

    python benchmarks/step_breakdown.py                       # tiny and small Llama on the CPU
    python benchmarks/step_breakdown.py --device cuda --model-shape qwen0.5b   # GPU: Qwen2.5-0.5B's shape

Method: one GRPOTrainer per variant (GRPOConfig.from_dict, train_step(): the public API), all built first and
then driven round-robin, one generated batch (num_iterations steps) per variant per round, so every variant
sees the same machine load; medians over rounds after warm-up, and the KL overhead is also the median of the
per-round ratios (KL / no KL measured seconds apart).

Goals:
  KL overhead: step time with KL / without <= 1 + 0.35 x (update share of the step without KL), i.e. the KL
  may add at most 35% of the policy's forward+backward time (a reference forward has no backward, so it costs a
  fraction of that).
  num_iterations > 1: the reference is paid once per generated batch (time/reference only on generating steps).

Also measured, as one more interleaved variant: klgrpo's KV-cached sampling loop (klgrpo/backends/kv_decoder.py) against
transformers generate (model.fast_path=false). The changes this script once prototyped (P1-P5 in
docs/benchmarks.md: old_logp from the first update, fused AdamW, one-pass logp + entropy, logits_to_keep, the
reference under inference_mode) are all in klgrpo now; benchmarks/speedup.py compares whole revisions.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (  # noqa: E402
    add_common_args,
    gpu_preset,
    klgrpo_config,
    median,
    prepare_assets,
    print_machine,
    print_table,
    quiet,
    resolve_dtype,
    set_threads,
    sync_timer_on_cuda,
    verdict,
)

PHASES = ("time/generate", "time/reward", "time/reference", "time/old_logp", "time/update", "time/step")


def run_shape(shape: str, args, root: Path) -> list[dict]:
    from klgrpo.run.trainer import GRPOTrainer

    dtype = resolve_dtype(args)
    model_dir, data = prepare_assets(shape, root, dtype)
    variants = [  # (label, coef, num_iterations, config extras)
        ("no KL, mu=1", 0.0, 1, {}),
        ("KL 0.04, mu=1", 0.04, 1, {}),
        ("no KL, mu=4", 0.0, 4, {}),
        ("KL 0.04, mu=4", 0.04, 4, {}),
        ("KL 0.04, mu=1, transformers generate", 0.04, 1, {"model": {"fast_path": False}}),
    ]
    if args.core_only:
        variants = variants[:4]
    trainers = []
    for label, coef, mu, extra in variants:
        cfg = klgrpo_config(model_dir, data, root / "runs" / shape / label.replace(" ", "_"), device=args.device,
                            dtype=dtype, prompts=args.prompts, group_size=args.group_size,
                            max_new_tokens=args.max_new_tokens, coef=coef, num_iterations=mu, threads=args.threads,
                            **extra)
        t = GRPOTrainer(cfg, log=quiet)
        assert (t.reference is None) == (coef == 0.0)
        trainers.append(t)
    records: dict[str, list[list[dict]]] = {label: [] for label, *_ in variants}  # per round: the batch's steps
    for r in range(args.warmup + args.rounds):
        for (label, _, mu, _), t in zip(variants, trainers):
            steps = [t.train_step() for _ in range(mu)]
            if r >= args.warmup:
                records[label].append(steps)
        print(f"  {shape}: round {r + 1}/{args.warmup + args.rounds} done", file=sys.stderr, flush=True)
    out = []
    for label, coef, mu, _ in variants:
        rounds = records[label]
        gen_steps = [steps[0] for steps in rounds]
        reuse_steps = [s for steps in rounds for s in steps[1:]]
        row = {"shape": shape, "variant": label, "mu": mu, "coef": coef}
        for k in PHASES:
            row[k] = median([s.get(k) for s in gen_steps])
        row["reuse_step"] = median([s["time/step"] for s in reuse_steps]) if reuse_steps else float("nan")
        row["per_step_mean"] = [sum(s["time/step"] for s in steps) / len(steps) for steps in rounds]
        row["per_step"] = median(row["per_step_mean"])
        row["ref_on_reuse_steps"] = sum("time/reference" in s for s in reuse_steps)
        row["ref_on_gen_steps"] = sum("time/reference" in s for s in gen_steps)
        row["n_gen"] = len(gen_steps)
        row["mean_length"] = median([s["completions/mean_length"] for s in gen_steps])
        out.append(row)
    return out


def _paired(a: dict, b: dict) -> float:
    """Median over rounds of a's mean step time / b's, measured in the same round."""
    return median([x / y for x, y in zip(a["per_step_mean"], b["per_step_mean"])])


def _kl_overhead(base: dict, kl: dict, mu: int) -> tuple[float, float, float, float]:
    """(ratio of medians, paired ratio, update share without KL, goal limit)."""
    share = base["time/update"] / base["time/step"]
    if mu > 1:  # the update share of a whole batch cycle (mu updates, one generation)
        share = ((base["time/update"] + (mu - 1) * base["reuse_step"])
                 / (base["time/step"] + (mu - 1) * base["reuse_step"]))
    return kl["per_step"] / base["per_step"], _paired(kl, base), share, 1 + 0.35 * share


def report(rows: list[dict]) -> bool:
    all_ok = True
    for shape in dict.fromkeys(r["shape"] for r in rows):
        rs = [r for r in rows if r["shape"] == shape]
        by = {r["variant"]: r for r in rs}
        print_table(
            ["variant", "generate", "reward", "reference", "old_logp", "update", "step (gen)", "step (reuse)",
             "per optimizer step", "mean len"],
            [[r["variant"], *(1000 * r[k] for k in PHASES), 1000 * r["reuse_step"], 1000 * r["per_step"],
              r["mean_length"]] for r in rs],
            title=f"{shape}: medians in ms over rounds (phases: generating steps; 'step (reuse)': steps 2..mu of a "
                  f"batch; 'per optimizer step': the batch's mean step time)")
        lines = []
        for label, base, kl, mu in (("current, mu=1", "no KL, mu=1", "KL 0.04, mu=1", 1),
                                    ("current, mu=4", "no KL, mu=4", "KL 0.04, mu=4", 4)):
            if base not in by or kl not in by:
                continue
            ratio, paired, share, limit = _kl_overhead(by[base], by[kl], mu)
            ok = paired <= limit
            if label.startswith("current"):
                all_ok &= ok
            lines.append([label, ratio, paired, share, limit, verdict(ok)])
        print_table(["trainer", "KL / no KL (medians)", "KL / no KL (paired)", "update share (no KL)",
                     "goal: <= 1 + 0.35 x share", "KL overhead goal"], lines, title=f"{shape}: KL overhead")
        kl4 = by["KL 0.04, mu=4"]
        once = kl4["ref_on_reuse_steps"] == 0 and kl4["ref_on_gen_steps"] == kl4["n_gen"]
        all_ok &= once
        print(f"{shape}: mu=4: time/reference on {kl4['ref_on_gen_steps']}/{kl4['n_gen']} generating steps and on "
              f"{kl4['ref_on_reuse_steps']} reuse steps -> reference once per batch: {verdict(once)}")
        if "KL 0.04, mu=1, transformers generate" not in by:
            continue
        kl1, gen = by["KL 0.04, mu=1"], by["KL 0.04, mu=1, transformers generate"]
        print(f"{shape}: klgrpo's sampling loop against transformers generate: time/generate "
              f"{1000 * gen['time/generate']:.1f} -> {1000 * kl1['time/generate']:.1f} ms "
              f"({kl1['time/generate'] / gen['time/generate']:.2f}x), per step {_paired(kl1, gen):.3f}x (paired)")
    return all_ok


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser, shapes_default="tiny,small")
    parser.add_argument("--rounds", type=int, default=12, help="measured rounds (one batch per variant each)")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured rounds first")
    parser.add_argument("--core-only", action="store_true",
                        help="only the four goal variants (no KL / KL 0.04 x mu 1 / 4): less memory on a GPU")
    args = parser.parse_args(argv)
    gpu_preset(args)
    set_threads(args.threads)
    sync_timer_on_cuda(args.device)
    print_machine({"device": args.device, "dtype": resolve_dtype(args)})
    print(f"batch: {args.prompts} prompts x {args.group_size} completions, max_new_tokens {args.max_new_tokens}, "
          f"lr 1e-6, token_mean, k3_st in the loss; {args.rounds} rounds after {args.warmup} warm-up")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.workdir or tmp)
        rows = []
        for shape in args.model_shape.split(","):
            rows += run_shape(shape.strip(), args, root)
        ok = report(rows)
    print(f"\nall step_breakdown goals: {verdict(ok)} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
