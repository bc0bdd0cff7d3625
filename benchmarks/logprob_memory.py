"""Per-token log-probs from [B, T, V] bf16 logits: the naive float32 log_softmax + gather against
klgrpo.math.logprobs.token_logprobs; time and PEAK EXTRA memory, forward and forward+backward.

    python benchmarks/logprob_memory.py                          # CPU: B=8, T=128, V=151,936 (0.31 GB logits)
    python benchmarks/logprob_memory.py --device cuda --tokens 288   # GPU: 8 x 288 (0.65 GB), docs/benchmarks.md

Memory method (CPU): every measurement runs in a fresh Python subprocess with glibc's mmap threshold pinned at
64 KiB (MALLOC_MMAP_THRESHOLD_), so every large tensor is its own mapping and freeing it returns the pages. The
child builds the logits (and targets), runs the variant once to warm up, frees its outputs, resets the
kernel's resident-set high-water mark (writes 5 to /proc/self/clear_refs), reads VmRSS as the baseline, runs
the variant once more and reads VmHWM: extra = VmHWM - baseline, i.e. everything the variant allocated at
its peak (kept-for-backward tensors, scratch, outputs and, with the backward, the logits' gradient).
On CUDA: torch.cuda.max_memory_allocated() - memory_allocated() before the run, in the same kind of child.

"forward" runs with logits.requires_grad=True (the training case: what autograd keeps counts);
"forward+backward" adds .sum().backward(). The gradient of the logits (1x the logits, bf16) is needed by the
model's backward whatever computes the log-probs, so the table also shows extra minus that gradient.

Goal: klgrpo's forward extra peak <= 0.5 x the bf16 logits (the naive path needs about 4x).
kl.estimator full (klgrpo.math.full_kl.token_logprobs_and_full_kl: log-probs, entropy and the exact KL over the
vocabulary against a reference given as the input of its output layer, [B, T, --hidden] bf16, plus that layer):
the hidden states are allocated inside the measured run (the reference forward hands them over), the output
layer's weight before it (it belongs to the reference model). Goal: its extra peak <= 0.5 x the bf16 logits,
forward, and forward+backward less the logits' gradient.
Also measured: the trainer's per-micro-batch pair token_logprobs + token_entropy (two passes over the logits)
against the one-pass token_logprobs_and_entropy (a proposed change to klgrpo.core.forward.completion_logprobs), and
with --baseline-rev REV token_logprobs as git revision REV had it (e.g. 2ba1a72: per-row chunks of 256
positions, before this benchmark's rewrite). The demo-size shape (tiny vocabulary: time only) is
    python benchmarks/logprob_memory.py --batch 32 --tokens 16 --vocab 16 --timing-runs 200 --baseline-rev 2ba1a72
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

VARIANTS = ("naive", "klgrpo", "logp+entropy (2 passes)", "logp+entropy (1 pass)")
FULL_KL = "logp+entropy+full KL"
BASELINE = "klgrpo@"  # + a git revision: token_logprobs as that commit had it (--baseline-rev)
MODES = ("forward", "forward+backward")


def _status_mb() -> dict[str, int]:
    text = Path("/proc/self/status").read_text()
    return {k: int(re.search(rf"{k}:\s+(\d+) kB", text).group(1)) * 1024 for k in ("VmRSS", "VmHWM")}


_MODULES: dict = {}


def _module_at(rev: str):
    """klgrpo/math/logprobs.py as git revision ``rev`` had it, imported under another name."""
    import importlib.util

    from benchmarks._common import scratch_folder

    if rev in _MODULES:
        return _MODULES[rev]
    root = Path(__file__).resolve().parent.parent
    source = subprocess.run(["git", "show", f"{rev}:klgrpo/math/logprobs.py"], cwd=root, capture_output=True,
                            text=True, check=True).stdout
    path = scratch_folder("klgrpo-logprobs-at-rev-") / "logprobs_at_rev.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("logprobs_at_rev", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    _MODULES[rev] = module
    return module


def _run_variant(variant: str, logits, targets, temperature: float, backward: bool, ref_head=None):
    import torch

    from klgrpo.math.logprobs import token_entropy, token_logprobs, token_logprobs_and_entropy

    if variant.startswith(BASELINE):
        out = (_module_at(variant[len(BASELINE):]).token_logprobs(logits, targets, temperature),)
    elif variant == "naive":
        out = (torch.log_softmax(logits.float() / temperature, dim=-1)
               .gather(-1, targets.unsqueeze(-1)).squeeze(-1),)
    elif variant == "klgrpo":
        out = (token_logprobs(logits, targets, temperature),)
    elif variant == FULL_KL:
        from klgrpo.math.full_kl import token_logprobs_and_full_kl

        hidden = torch.randn(*targets.shape, ref_head.in_features, device=logits.device, dtype=logits.dtype)
        logp, kl, entropy, _ = token_logprobs_and_full_kl(logits, targets, hidden, ref_head, temperature)
        out = (logp + kl, entropy)
    elif variant == "logp+entropy (2 passes)":
        out = (token_logprobs(logits, targets, temperature), token_entropy(logits.detach(), temperature))
    else:
        out = token_logprobs_and_entropy(logits, targets, temperature)
    if backward:
        out[0].sum().backward()
    return out


def child(args) -> None:
    import torch

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    g = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(args.batch, args.tokens, args.vocab, generator=g, device=device,
                         dtype=torch.bfloat16).mul_(2.0).requires_grad_(True)
    targets = torch.randint(0, args.vocab, (args.batch, args.tokens), generator=g, device=device)
    backward = args.mode == "forward+backward"
    cuda = device.type == "cuda"
    ref_head = None
    if args.variant == FULL_KL:  # the reference's output layer: part of the reference model, not extra
        ref_head = torch.nn.Linear(args.hidden, args.vocab, bias=False, device=device, dtype=torch.bfloat16)
        ref_head.requires_grad_(False)

    def run():
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = _run_variant(args.variant, logits, targets, args.temperature, backward, ref_head)
        if cuda:
            torch.cuda.synchronize()
        return out, time.perf_counter() - t0

    out, _ = run()  # warm-up (thread pools, kernels, lazy initialisation)
    del out
    logits.grad = None
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        Path("/proc/self/clear_refs").write_text("5")
        base = _status_mb()["VmRSS"]
    out, first = run()
    peak = torch.cuda.max_memory_allocated() if cuda else _status_mb()["VmHWM"]
    del out
    times = [first]
    for _ in range(args.timing_runs - 1):
        logits.grad = None
        out, dt = run()
        del out
        times.append(dt)
    times.sort()
    print(json.dumps({"extra_bytes": peak - base, "seconds": times[len(times) // 2],
                      "logits_bytes": logits.numel() * logits.element_size()}))


def measure(args, variant: str, mode: str) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--variant", variant, "--mode", mode,
           "--batch", str(args.batch), "--tokens", str(args.tokens), "--vocab", str(args.vocab),
           "--temperature", str(args.temperature), "--device", args.device, "--threads", str(args.threads),
           "--timing-runs", str(args.timing_runs), "--hidden", str(args.hidden)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"child {variant}/{mode} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads in each child")
    parser.add_argument("--repeats", type=int, default=3, help="fresh children per (variant, mode), interleaved")
    parser.add_argument("--timing-runs", type=int, default=3, help="timed runs per child (median)")
    parser.add_argument("--baseline-rev", default="",
                        help="also measure token_logprobs as this git revision had it (e.g. 2ba1a72, before the "
                             "block rewrite)")
    parser.add_argument("--skip-entropy", action="store_true", help="leave out the logp+entropy rows")
    parser.add_argument("--hidden", type=int, default=896, help="reference hidden size for the full-KL row "
                                                                "(896: Qwen2.5-0.5B, whose vocabulary is the default)")
    parser.add_argument("--skip-full-kl", action="store_true", help="leave out the kl.estimator full rows")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", default="klgrpo", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="forward", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return 0

    from benchmarks._common import median, print_machine, print_table, verdict

    print_machine({"device": args.device})
    logits_gb = args.batch * args.tokens * args.vocab * 2 / 1e9
    print(f"logits: [{args.batch}, {args.tokens}, {args.vocab}] bf16 = {logits_gb:.3f} GB; temperature "
          f"{args.temperature}; {args.repeats} fresh children per cell, interleaved; memory = "
          f"{'VmHWM - VmRSS (see docstring)' if args.device == 'cpu' else 'torch.cuda max_memory_allocated'}")
    t0 = time.perf_counter()
    cells: dict[tuple[str, str], list[dict]] = {}
    variants = list(VARIANTS[:2]) + ([BASELINE + args.baseline_rev] if args.baseline_rev else [])
    if not args.skip_entropy:
        variants += VARIANTS[2:]
    plan = [(v, m) for v in variants for m in MODES if not (v.startswith("logp+entropy (") and m != "forward")]
    if not args.skip_full_kl:
        plan += [(FULL_KL, m) for m in MODES]
    for r in range(args.repeats):
        for variant, mode in plan:
            cells.setdefault((variant, mode), []).append(measure(args, variant, mode))
        print(f"  repeat {r + 1}/{args.repeats} done ({time.perf_counter() - t0:.0f} s)", file=sys.stderr,
              flush=True)
    logits_bytes = cells[plan[0]][0]["logits_bytes"]
    measurable = logits_bytes >= 16 * 2 ** 20  # RSS pages and allocator slack hide smaller tensors
    rows, summary = [], {}
    for variant, mode in plan:
        runs = cells[(variant, mode)]
        extra = median([c["extra_bytes"] for c in runs])
        seconds = median([c["seconds"] for c in runs])
        grad = logits_bytes if mode == "forward+backward" else 0
        summary[(variant, mode)] = (extra, seconds)
        if not measurable:
            rows.append([variant, mode, 1000 * seconds, "too small", "-", "-"])
            continue
        rows.append([variant, mode, 1000 * seconds, extra / 1e9, extra / logits_bytes,
                     (extra - grad) / logits_bytes if grad else "-"])
    print_table(["variant", "mode", "ms (median)", "extra peak GB", "extra / logits",
                 "(extra - grad) / logits"], rows,
                title=f"per-token log-probs, [{args.batch}, {args.tokens}, {args.vocab}] bf16 logits "
                      f"({logits_gb:.3f} GB), medians over {args.repeats} fresh processes")
    ratio_rows = []
    for mode in MODES:
        (n_extra, n_s), (k_extra, k_s) = summary[("naive", mode)], summary[("klgrpo", mode)]
        ratio_rows.append([f"klgrpo / naive, {mode}", k_s / n_s, k_extra / n_extra if measurable else "-"])
        if args.baseline_rev:
            b_extra, b_s = summary[(BASELINE + args.baseline_rev, mode)]
            ratio_rows.append([f"klgrpo / klgrpo@{args.baseline_rev}, {mode}", k_s / b_s,
                               k_extra / b_extra if measurable else "-"])
    if not args.skip_entropy:
        one, two = summary[("logp+entropy (1 pass)", "forward")], summary[("logp+entropy (2 passes)", "forward")]
        ratio_rows.append(["logp+entropy: 1 pass / 2 passes, forward", one[1] / two[1],
                           one[0] / two[0] if measurable else "-"])
    print_table(["comparison", "time ratio", "extra-memory ratio"], ratio_rows, title="ratios")
    if not measurable:
        print(f"memory: the logits are too small to measure ({time.perf_counter() - t0:.0f} s)")
        return 0
    fwd_ratio = summary[("klgrpo", "forward")][0] / logits_bytes
    print(f"goal: klgrpo forward extra peak <= 0.5 x bf16 logits: {fwd_ratio:.3f}x -> {verdict(fwd_ratio <= 0.5)} "
          f"(naive: {summary[('naive', 'forward')][0] / logits_bytes:.2f}x) ({time.perf_counter() - t0:.0f} s)")
    if not args.skip_full_kl:
        full_fwd = summary[(FULL_KL, "forward")][0] / logits_bytes
        full_bwd = (summary[(FULL_KL, "forward+backward")][0] - logits_bytes) / logits_bytes
        print(f"goal: kl.estimator full extra peak <= 0.5 x bf16 logits: forward {full_fwd:.3f}x, forward+backward "
              f"less the logits' gradient {full_bwd:.3f}x -> {verdict(max(full_fwd, full_bwd) <= 0.5)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
