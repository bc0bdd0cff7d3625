"""klgrpo against an earlier git revision of itself: seconds per optimizer step and per phase, interleaved step
by step in one process, and how exactly the two agree from the same seed.

    python benchmarks/speedup.py --baseline-rev 74bb8b5                  # tiny and small Llama, CPU
    python benchmarks/speedup.py --baseline-rev 74bb8b5 --compile        # + a train.compile=true variant
    python benchmarks/speedup.py --baseline-config train.entropy_metrics=false --memory   # a setting's cost

The baseline is either an earlier revision (--baseline-rev) or the working tree with some settings changed
(--baseline-config KEY=VALUE, repeatable): then "current" is the working tree as configured below and the ratio
is the cost of what the settings turn off. --memory adds each step's peak extra memory: on the CPU
VmHWM - VmRSS around the step (the high-water mark reset through /proc/self/clear_refs; the script re-runs itself
with MALLOC_MMAP_THRESHOLD_=65536 so that freed tensors leave the resident set), on CUDA
max_memory_allocated - memory_allocated.

A revision baseline is the whole klgrpo package as that revision had it (benchmarks/_common.py:klgrpo_at, imported as
klgrpo_<rev>); both trainers get the same config (vs_trl.py's: 4 prompts x 8 completions, 16 new tokens,
k3_st in the loss at beta 0.04, token_mean, one thread). Timing: every round runs one train_step() of each
variant in an order that rotates every round, so they share the machine's load; medians over the rounds
after warm-up, and the ratio is also the median of per-round ratios. With --compile the compiled variant's
first step (the compilation, with an empty inductor cache unless --warm-compile-cache) is reported apart, with
the break-even step count. Shapes stay fixed here (4 fixed-width prompts, and some completion nearly always
runs to max_new_tokens); a run whose widths change recompiles once more with dynamic shapes.

Exactness: each trainer alone, freshly built with the same seed, runs --check-steps steps; the sampled
completions must be identical and the table gives the largest difference of the logged loss / KL metrics and
of the parameters at the end (float rounding only, or the change is not the same computation).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (  # noqa: E402
    add_common_args,
    gpu_preset,
    klgrpo_at,
    klgrpo_config,
    median,
    prepare_assets,
    print_machine,
    print_table,
    quiet,
    resolve_dtype,
    set_threads,
    sync_timer_on_cuda,
    trainer_module,
)

PHASES = ("time/generate", "time/reference", "time/update", "time/step")
CHECKED = ("train/loss", "train/policy_loss", "kl/k1", "kl/k3", "adaptive_kl/raw_kl", "entropy", "grad_norm")


def _variants(args, package):
    if args.baseline_config:
        out = [("baseline " + ", ".join(args.baseline_config), None, _overrides(args.baseline_config)),
               ("current", None, {})]
    else:
        out = [(f"baseline {args.baseline_rev}", package, {}), ("current", None, {})]
    if args.compile:
        out.append(("current, train.compile", None, {"train": {"compile": True}}))
    return out


def _overrides(pairs: list[str]) -> dict:
    """["train.entropy_metrics=false", ...] as {"train": {"entropy_metrics": False}} (values read as YAML)."""
    import yaml

    tree: dict = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        group, dot, name = key.partition(".")
        if not sep or not dot or not name:
            raise SystemExit(f"speedup.py: error: --baseline-config {pair!r}: write GROUP.FIELD=VALUE")
        tree.setdefault(group, {})[name] = yaml.safe_load(value)
    return tree


def _peak_memory_reset(device: str) -> int:
    """Start a step's peak-memory window; returns the bytes in use now."""
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    return _status_bytes("VmRSS")


def _peak_memory(device: str) -> int:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    return _status_bytes("VmHWM")


def _status_bytes(key: str) -> int:
    import re

    return int(re.search(rf"{key}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def _trainer(shape_dir, data, out: Path, args, package, extra):
    GRPOTrainer = trainer_module(package).GRPOTrainer
    cfg = klgrpo_config(shape_dir, data, out, device=args.device, dtype=resolve_dtype(args), prompts=args.prompts,
                        group_size=args.group_size, max_new_tokens=args.max_new_tokens, threads=args.threads,
                        package=package, **extra)
    return GRPOTrainer(cfg, log=quiet)


def check_exactness(shape_dir, data, root: Path, args, variants) -> list[list]:
    """Each variant alone from the same seed for --check-steps steps: same completions? largest differences."""
    import torch

    runs = {}
    for label, package, extra in variants:
        trainer = _trainer(shape_dir, data, root / "check" / label.replace(" ", "_"), args, package, extra)
        completions, metrics = [], []
        owner = getattr(trainer, "grpo_step", trainer)  # the step's owner: GRPOStep, or an older trainer itself
        original = owner.make_batch

        def make_batch(original=original, completions=completions):
            batch = original()
            completions.append(batch.rollout.completion_ids.clone())
            return batch

        owner.make_batch = make_batch
        for _ in range(args.check_steps):
            metrics.append(trainer.train_step())
        params = torch.cat([p.detach().reshape(-1).double() for p in trainer.model.parameters()])
        runs[label] = (completions, metrics, params)
    base_label = variants[0][0]
    base = runs[base_label]
    rows = []
    for label, (completions, metrics, params) in runs.items():
        if label == base_label:
            continue
        same = all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(base[0], completions))
        diffs = [max(abs(m[k] - b[k]) for m, b in zip(metrics, base[1])) if k in metrics[0] and k in base[1][0]
                 else "-" for k in CHECKED]
        rows.append([label, "yes" if same else "NO", *diffs, float((params - base[2]).abs().max())])
    return rows


def run_shape(shape: str, args, root: Path) -> dict:
    package = klgrpo_at(args.baseline_rev, root / "revisions") if args.baseline_rev else None
    if package is not None:
        sync_timer_on_cuda(args.device, package)  # the baseline's phase timers synchronise too
    shape_dir, data = prepare_assets(shape, root, resolve_dtype(args))
    variants = _variants(args, package)
    trainers, first = [], {}
    for label, package_, extra in variants:
        trainers.append(_trainer(shape_dir, data, root / "runs" / shape / label.replace(" ", "_"), args, package_,
                                 extra))
    records = {label: [] for label, *_ in variants}
    for r in range(args.warmup + args.rounds):
        shift = r % len(trainers)
        order = list(range(len(trainers)))[shift:] + list(range(len(trainers)))[:shift]
        for i in order:
            label = variants[i][0]
            before = _peak_memory_reset(args.device) if args.memory else 0
            t0 = time.perf_counter()
            metrics = trainers[i].train_step()
            metrics["wall"] = time.perf_counter() - t0
            if args.memory:
                metrics["peak_extra"] = _peak_memory(args.device) - before
            if r == 0:
                first[label] = metrics["wall"]
            if r >= args.warmup:
                records[label].append(metrics)
        print(f"  {shape}: round {r + 1}/{args.warmup + args.rounds}", file=sys.stderr, flush=True)
    exact = check_exactness(shape_dir, data, root, args, variants) if args.check_steps else []
    return {"shape": shape, "records": records, "first": first, "exact": exact,
            "labels": [v[0] for v in variants]}


def report(result: dict, args) -> None:
    shape, records, labels = result["shape"], result["records"], result["labels"]
    base = records[labels[0]]
    rows = []
    for label in labels:
        rs = records[label]
        phases = [1000 * median([m.get(k) for m in rs]) for k in PHASES]
        rest = 1000 * median([m["time/step"] - sum(m.get(k, 0.0) for k in PHASES[:3]) for m in rs])
        paired = median([m["time/step"] / b["time/step"] for m, b in zip(rs, base)])
        rows.append([label, *phases[:3], rest, phases[3], phases[3] / (1000 * median([b["time/step"] for b in base])),
                     paired])
    print_table(["variant", "generate", "reference", "update", "rest", "step", "step / baseline (medians)",
                 "(paired)"], rows, title=f"{shape}: ms per optimizer step, medians over {len(base)} interleaved "
                                          f"rounds after {args.warmup} warm-up")
    if args.memory:
        base_peak = median([b["peak_extra"] for b in base])
        print_table(["variant", "peak extra MB (median)", "peak / baseline (medians)", "(paired)"],
                    [[label, median([m["peak_extra"] for m in records[label]]) / 2**20,
                      median([m["peak_extra"] for m in records[label]]) / base_peak,
                      median([m["peak_extra"] / b["peak_extra"] for m, b in zip(records[label], base)])]
                     for label in labels],
                    title=f"{shape}: peak memory a step adds to the process, medians over the same rounds")
    if args.compile:
        label = labels[-1]
        current = median([m["time/step"] for m in records[labels[1]]])
        compiled = median([m["time/step"] for m in records[label]])
        first = result["first"][label]
        saved = current - compiled
        even = (first - compiled) / saved if saved > 0 else float("inf")
        print(f"{shape}: train.compile: first step {first:.1f} s (compilation), then {1000 * compiled:.1f} ms "
              f"against {1000 * current:.1f} ms: pays after about {even:.0f} steps")
    if result["exact"]:
        print_table(["variant", "same completions", *CHECKED, "parameters"], result["exact"],
                    title=f"{shape}: exactness against the baseline, {args.check_steps} steps each from the same "
                          f"seed: max |difference|")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser, shapes_default="tiny,small")
    baseline = parser.add_mutually_exclusive_group(required=True)
    baseline.add_argument("--baseline-rev", help="git revision of klgrpo to compare against")
    baseline.add_argument("--baseline-config", action="append", metavar="GROUP.FIELD=VALUE",
                          help="compare against the working tree with this setting (repeatable)")
    parser.add_argument("--memory", action="store_true", help="also each step's peak extra memory")
    parser.add_argument("--rounds", type=int, default=40, help="measured rounds (one step per variant each)")
    parser.add_argument("--warmup", type=int, default=5, help="unmeasured rounds first")
    parser.add_argument("--check-steps", type=int, default=5, help="steps of the exactness check (0: skip it)")
    parser.add_argument("--compile", action="store_true", help="add a variant with train.compile=true")
    parser.add_argument("--warm-compile-cache", action="store_true",
                        help="keep torch inductor's on-disk cache (default: a fresh one, so the first compiled step "
                             "pays the whole compilation)")
    args = parser.parse_args(argv)
    if args.memory and args.device == "cpu" and os.environ.get("MALLOC_MMAP_THRESHOLD_") != "65536":
        # Large blocks from mmap return to the system when freed, so each step's high-water mark is its own.
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
        os.execve(sys.executable, [sys.executable, str(Path(__file__).resolve()), *(argv or sys.argv[1:])], env)
    gpu_preset(args)
    set_threads(args.threads)
    sync_timer_on_cuda(args.device)
    print_machine({"device": args.device, "dtype": resolve_dtype(args)})
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.workdir or tmp)
        if not args.warm_compile_cache:  # a cold compilation, as a fresh machine pays it
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tmp) / "inductor")
        for shape in args.model_shape.split(","):
            report(run_shape(shape.strip(), args, root), args)
    print(f"\n({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
