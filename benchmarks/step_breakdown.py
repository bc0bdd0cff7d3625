"""Where a klgrpo step's time goes (time/generate, time/reference, time/old_logp, time/update, time/step), and
what the KL costs: kl.coef 0 (monitor off: no reference model at all) against kl.coef 0.04, with
num_iterations 1 and 4.

    python benchmarks/step_breakdown.py                       # tiny and small Llama on the CPU
    python benchmarks/step_breakdown.py --device cuda --model-shape qwen0.5b   # GPU: NOTES_PERF.md's shape

Method: one GRPOTrainer per variant (GRPOConfig.from_dict, train_step(): the public API), all built first and
then driven round-robin, one generated batch (num_iterations steps) per variant per round, so every variant
sees the same machine load; medians over rounds after warm-up, and the KL overhead is also the median of the
per-round ratios (KL / no KL measured seconds apart).

Goals (issue 6):
  KL overhead: step time with KL / without <= 1 + 0.35 x (update share of the step without KL), i.e. the KL
  may add at most 35% of the policy's forward+backward time (a reference forward costs ~0.31 of it, NOTES_PERF).
  num_iterations > 1: the reference is paid once per generated batch (time/reference only on generating steps).

Also measured, each as one more interleaved variant (benchmark-only subclasses; klgrpo is not edited):
  klgrpo's KV-cached sampling loop (klgrpo/rollout.py) against transformers generate (the previous path);
  P1  num_iterations > 1: the trainer's extra no-grad forward for old_logp, replaced by the first update's
      logp.detach() (exact: same weights, dropout off);
  P2  fused AdamW; P3 one-pass logp + entropy (token_logprobs_and_entropy); P4 logits_to_keep = T + 1 (no
      lm_head on the prompt); P5 the reference forward under torch.inference_mode.
  A float64 check prints how exact each change is (max |difference|).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (add_common_args, gpu_preset, klgrpo_config, median, prepare_assets,  # noqa: E402
                                print_machine, print_table, quiet, resolve_dtype, set_threads, sync_timer_on_cuda,
                                verdict)

PHASES = ("time/generate", "time/reward", "time/reference", "time/old_logp", "time/update", "time/step")


def proposed_trainer(*, reuse_old_logp: bool = False, fused_adamw: bool = False, one_pass: bool = False,
                     inference_reference: bool = False, sampler: str = "auto"):
    """GRPOTrainer with proposed changes, prototyped without editing klgrpo (benchmark-only subclass):

    reuse_old_logp       no separate old_logp forward when num_iterations > 1: the first update's
                         logp.detach() (same weights, dropout off) becomes the batch's old_logp
    fused_adamw          torch.optim.AdamW(..., fused=True) (one kernel over all parameters)
    one_pass             completion_logprobs computes logp and entropy in one pass over the logits
                         (token_logprobs_and_entropy) and asks the model for the completion positions' logits
                         only (logits_to_keep = T + 1: no lm_head on the prompt)
    inference_reference  the reference forward under torch.inference_mode (cloned out), not no_grad
    sampler              "generate": transformers generate instead of klgrpo's sampling loop (the old path)
    """
    import torch

    import klgrpo.rollout as rollout_module
    from klgrpo.trainer import GRPOTrainer, _make_scheduler

    class Proposed(GRPOTrainer):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            if fused_adamw:
                group = self.optimizer.param_groups[0]
                self.optimizer = torch.optim.AdamW(group["params"], lr=group["lr"], betas=group["betas"],
                                                   weight_decay=group["weight_decay"], fused=True)
                self.scheduler = _make_scheduler(self.optimizer, self.cfg)
            if inference_reference and self.reference is not None:
                plain = self.reference.logprobs

                def logprobs(batch, temperature, micro_batch_size=0):
                    with torch.inference_mode():
                        out = plain(batch, temperature, micro_batch_size)
                    return out.clone()  # a normal tensor: the loss may save it for its backward

                self.reference.logprobs = logprobs

        def make_batch(self):
            iterations = self.cfg.train.num_iterations
            if reuse_old_logp:
                self.cfg.train.num_iterations = 1  # make_batch skips the old_logp forward
            previous = rollout_module.FAST_SAMPLING
            rollout_module.FAST_SAMPLING = sampler != "generate"
            try:
                with _one_pass_logprobs(one_pass):
                    return super().make_batch()
            finally:
                self.cfg.train.num_iterations = iterations
                rollout_module.FAST_SAMPLING = previous

        def accumulate_gradients(self, batch, keep_logp=False):
            capture = reuse_old_logp and self.cfg.train.num_iterations > 1 and batch.old_logp is None
            with _one_pass_logprobs(one_pass):
                sums, maxes, entropy, logp = super().accumulate_gradients(batch, keep_logp=keep_logp or capture)
            if capture:
                batch.old_logp = logp
            return sums, maxes, entropy, (logp if keep_logp else None)

    return Proposed


def one_pass_completion_logprobs(model, batch, temperature, rows=None, with_entropy=False):
    """The proposed klgrpo.models.completion_logprobs: logits for the completion positions only
    (logits_to_keep), logp and entropy from one pass over them."""
    from klgrpo.math.logprobs import token_logprobs, token_logprobs_and_entropy
    from klgrpo.models import position_ids_from_mask

    input_ids, attention_mask, completion_ids = batch.input_ids, batch.attention_mask, batch.completion_ids
    if rows is not None:
        input_ids, attention_mask, completion_ids = input_ids[rows], attention_mask[rows], completion_ids[rows]
    t = completion_ids.shape[1]
    out = model(input_ids=input_ids, attention_mask=attention_mask,
                position_ids=position_ids_from_mask(attention_mask), use_cache=False, logits_to_keep=t + 1)
    logits = out.logits[:, :-1]
    if with_entropy:
        return token_logprobs_and_entropy(logits, completion_ids, temperature)
    return token_logprobs(logits, completion_ids, temperature), None


class _one_pass_logprobs:
    """Swap completion_logprobs in the trainer and reference modules while active (benchmark-only)."""

    def __init__(self, active: bool):
        self.active = active

    def __enter__(self):
        import klgrpo.reference as reference_module
        import klgrpo.trainer as trainer_module

        self.saved = (trainer_module.completion_logprobs, reference_module.completion_logprobs)
        if self.active:
            trainer_module.completion_logprobs = one_pass_completion_logprobs
            reference_module.completion_logprobs = one_pass_completion_logprobs

    def __exit__(self, *exc):
        import klgrpo.reference as reference_module
        import klgrpo.trainer as trainer_module

        trainer_module.completion_logprobs, reference_module.completion_logprobs = self.saved


def check_proposals_are_exact(model_dir, data, root, args, dtype) -> dict[str, float]:
    """On one batch (float64 model): max |difference| of (a) old_logp from the extra forward vs the first
    update's logp, (b) logp / entropy / gradients of the one-pass completion_logprobs vs the current one,
    (c) inference-mode vs no-grad reference log-probs. 0 (or ~1e-15) means the change is exact."""
    import torch
    from transformers import AutoModelForCausalLM

    from klgrpo.models import completion_logprobs
    from klgrpo.trainer import GRPOTrainer

    cfg = klgrpo_config(model_dir, data, root / "check", device=args.device, dtype=dtype, prompts=args.prompts,
                        group_size=args.group_size, max_new_tokens=args.max_new_tokens, num_iterations=4,
                        threads=args.threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64 if args.device == "cpu"
                                                 else getattr(torch, dtype))  # float64 on the CPU: exact checks
    trainer = GRPOTrainer(cfg, model=model, log=quiet)
    batch = trainer.make_batch()
    *_, logp = trainer.accumulate_gradients(batch, keep_logp=True)
    mask = batch.loss_mask.bool()
    out = {"old_logp": float((batch.old_logp - logp).abs()[mask].max())}
    grads = []
    for fn in (completion_logprobs, one_pass_completion_logprobs):
        trainer.model.zero_grad(set_to_none=True)
        lp, ent = fn(trainer.model, batch.rollout, 1.0, None, with_entropy=True)
        (lp * mask).sum().backward()
        grads.append((lp.detach(), ent, torch.cat([p.grad.reshape(-1) for p in trainer.model.parameters()
                                                   if p.grad is not None])))
    out["one_pass_logp"] = float((grads[0][0] - grads[1][0]).abs()[mask].max())
    out["one_pass_entropy"] = float((grads[0][1] - grads[1][1]).abs()[mask].max())
    out["one_pass_grad"] = float((grads[0][2] - grads[1][2]).abs().max())
    with torch.inference_mode():
        inf = trainer.reference.logprobs(batch.rollout, 1.0, 0).clone()
    out["inference_reference"] = float((inf - batch.ref_logp).abs()[mask].max())
    return out


def run_shape(shape: str, args, root: Path) -> list[dict]:
    from klgrpo.trainer import GRPOTrainer

    dtype = resolve_dtype(args)
    model_dir, data = prepare_assets(shape, root, dtype)
    variants = [  # (label, coef, num_iterations, trainer class)
        ("no KL, mu=1", 0.0, 1, GRPOTrainer),
        ("KL 0.04, mu=1", 0.04, 1, GRPOTrainer),
        ("no KL, mu=4", 0.0, 4, GRPOTrainer),
        ("KL 0.04, mu=4", 0.04, 4, GRPOTrainer),
        ("KL 0.04, mu=4, +P1", 0.04, 4, proposed_trainer(reuse_old_logp=True)),
        ("no KL, mu=1, +P2-P4", 0.0, 1, proposed_trainer(fused_adamw=True, one_pass=True)),
        ("KL 0.04, mu=1, +P2-P5", 0.04, 1, proposed_trainer(fused_adamw=True, one_pass=True,
                                                             inference_reference=True)),
        ("KL 0.04, mu=1, transformers generate", 0.04, 1, proposed_trainer(sampler="generate")),
    ]
    if args.core_only:
        variants = variants[:4]
    trainers = []
    for label, coef, mu, cls in variants:
        cfg = klgrpo_config(model_dir, data, root / "runs" / shape / label.replace(" ", "_"), device=args.device,
                            dtype=dtype, prompts=args.prompts, group_size=args.group_size,
                            max_new_tokens=args.max_new_tokens, coef=coef, num_iterations=mu, threads=args.threads)
        t = cls(cfg, log=quiet)
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
    if not args.skip_exact_check:
        out[0]["exactness"] = check_proposals_are_exact(model_dir, data, root, args, dtype)
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
                                    ("current, mu=4", "no KL, mu=4", "KL 0.04, mu=4", 4),
                                    ("with P2-P5, mu=1", "no KL, mu=1, +P2-P4", "KL 0.04, mu=1, +P2-P5", 1)):
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
        if "KL 0.04, mu=4, +P1" not in by:
            continue
        kl1, gen = by["KL 0.04, mu=1"], by["KL 0.04, mu=1, transformers generate"]
        p1, p25 = by["KL 0.04, mu=4, +P1"], by["KL 0.04, mu=1, +P2-P5"]
        print_table(["change", "baseline", "per step before (ms)", "after (ms)", "after / before (paired)",
                     "note"], [
            ["klgrpo's sampling loop (done, rollout.py)", "transformers generate", 1000 * gen["per_step"],
             1000 * kl1["per_step"], _paired(kl1, gen),
             f"time/generate {1000 * gen['time/generate']:.1f} -> {1000 * kl1['time/generate']:.1f} ms "
             f"({kl1['time/generate'] / gen['time/generate']:.2f}x)"],
            ["P1 old_logp from update 1 (trainer)", "KL 0.04, mu=4", 1000 * kl4["per_step"], 1000 * p1["per_step"],
             _paired(p1, kl4), f"generating step {1000 * kl4['time/step']:.1f} -> {1000 * p1['time/step']:.1f} ms"],
            ["P2-P5 together (trainer, models, reference)", "KL 0.04, mu=1", 1000 * kl1["per_step"],
             1000 * p25["per_step"], _paired(p25, kl1),
             f"update {1000 * kl1['time/update']:.1f} -> {1000 * p25['time/update']:.1f} ms, reference "
             f"{1000 * kl1['time/reference']:.1f} -> {1000 * p25['time/reference']:.1f} ms"],
        ], title=f"{shape}: gains (P1: old_logp = first update's logp.detach(); P2 fused AdamW; P3 one-pass "
                 f"logp+entropy; P4 logits_to_keep; P5 reference under inference_mode)")
        if "exactness" in rs[0]:
            e = rs[0]["exactness"]
            print(f"{shape}: exactness on one float64 batch, max |difference|: P1 old_logp {e['old_logp']:.3g}; "
                  f"P3+P4 logp {e['one_pass_logp']:.3g}, entropy {e['one_pass_entropy']:.3g}, gradient "
                  f"{e['one_pass_grad']:.3g}; P5 reference {e['inference_reference']:.3g}")
    return all_ok


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser, shapes_default="tiny,small")
    parser.add_argument("--rounds", type=int, default=12, help="measured rounds (one batch per variant each)")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured rounds first")
    parser.add_argument("--skip-exact-check", action="store_true")
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
