"""What a custom loss costs against a built-in one, on the same batch: FLOPs and wall time of one forward/backward.

    python benchmarks/custom_loss_cost.py                                   # tiny and small Llama on the CPU
    python benchmarks/custom_loss_cost.py --device cuda --model-shape qwen0.5b

Hosted training APIs offer built-in losses (``forward_backward(data, loss_fn="ppo")``) and a custom route
(``forward_backward_custom(data, loss_fn)``), and document the custom one as costing about 1.5x the FLOPs and up to
3x the wall time of a built-in loss. The custom route there is two passes: a forward to get the log-probs, the
user's function on them (its gradient with respect to the log-probs), then a forward/backward that pushes that
gradient into the model. This script measures, on one generated batch of klgrpo's trainer (the model and batch the
same for all):

    trainer built-in        GRPOTrainer.accumulate_gradients, the built-in objective (klgrpo's training step)
    trainer typed custom    the same with a typed loss.function that recomputes the objective
    datum built-in ppo_kl   klgrpo.custom.forward_backward(data, loss_fn="ppo_kl"): one forward with the graph
    datum custom, 1 pass    forward_backward_custom(data, fn): one forward with the graph (klgrpo's local route)
    datum custom, 2 passes  the hosted APIs' route: a no-grad forward, fn's gradient w.r.t. the log-probs,
                            a forward/backward

FLOPs are torch.utils.flop_counter's count (matmuls and attention) of one call; wall times are medians over
interleaved rounds (all variants once per round, so each sees the same machine load). Ratios are against
"datum built-in ppo_kl", the built-in loss of the datum shape (the comparison the documents make), and the
trainer's step. The custom function is examples/custom_losses/grpo_kl_as_written.py:compute_grpo_kl_loss_fixed.
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
)

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "custom_losses" / "grpo_kl_as_written.py"


def two_pass_custom(model, data, loss_fn, temperature: float = 1.0):
    """The hosted APIs' forward_backward_custom: log-probs without a graph, the function's gradient with respect
    to them, then one forward/backward of sum(grad * logp), whose parameter gradient is the loss's."""
    import torch

    from klgrpo.custom import datum_logprobs

    with torch.no_grad():
        detached = [lp.detach().requires_grad_(True) for lp in datum_logprobs(model, data, temperature)]
    loss, metrics = loss_fn(data, detached)
    grads = torch.autograd.grad(loss, detached)
    surrogate = sum((g * lp).sum() for g, lp in zip(grads, datum_logprobs(model, data, temperature)))
    surrogate.backward()
    return loss, metrics


def variants(trainer, batch, data):
    import torch

    from klgrpo.core.loss_api import load_loss_function
    from klgrpo.custom import forward_backward, forward_backward_custom
    from klgrpo.math.objective import KLTerm, ObjectiveInputs, ObjectiveTerms, grpo_objective

    custom = load_loss_function(f"{EXAMPLE}:compute_grpo_kl_loss_fixed")
    beta = trainer.controller.value
    kl = trainer.grpo_step.kl_term()

    def typed(inp):
        return grpo_objective(ObjectiveInputs(inp.logp, inp.old_logp, inp.ref_logp, inp.advantages, inp.mask),
                              ObjectiveTerms(kl=KLTerm(coef=inp.beta, estimator=kl.estimator),
                                             aggregation=inp.aggregation), inp.normalizer).loss, {}

    def trainer_step(loss_fn):
        def run():
            trainer.grpo_step.loss_fn = loss_fn
            trainer.grpo_step.accumulate_gradients(batch)
        return run

    model = trainer.model
    config = {"kl_coef": beta, "clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    return {
        "trainer built-in": trainer_step(None),
        "trainer typed custom": trainer_step(typed),
        "datum built-in ppo_kl": lambda: forward_backward(model, data, "ppo_kl", config),
        "datum custom, 1 pass": lambda: forward_backward_custom(model, data,
                                                                lambda d, lp: custom(d, lp, kl_coef=beta)),
        "datum custom, 2 passes": lambda: two_pass_custom(model, data, lambda d, lp: custom(d, lp, kl_coef=beta)),
    }, torch


def run_shape(shape: str, args, root: Path) -> list[list]:
    from torch.utils.flop_counter import FlopCounterMode

    from klgrpo.custom import datums_from_batch
    from klgrpo.run.trainer import GRPOTrainer
    from klgrpo.train.timing import synchronize_timers  # noqa: F401 (CUDA timing below synchronises itself)

    dtype = resolve_dtype(args)
    model_dir, data_file = prepare_assets(shape, root, dtype)
    cfg = klgrpo_config(model_dir, data_file, root / "runs" / shape, device=args.device, dtype=dtype,
                        prompts=args.prompts, group_size=args.group_size, max_new_tokens=args.max_new_tokens,
                        coef=0.04, threads=args.threads)
    trainer = GRPOTrainer(cfg, log=quiet)
    batch = trainer.make_batch()
    data = datums_from_batch(trainer.model, batch, cfg.rollout.temperature)
    runs, torch = variants(trainer, batch, data)
    cuda = args.device.startswith("cuda")

    def once(fn) -> float:
        trainer.model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    flops = {}
    for name, fn in runs.items():
        trainer.model.zero_grad(set_to_none=True)
        with FlopCounterMode(display=False) as counter:
            fn()
        flops[name] = counter.get_total_flops()
    for _ in range(args.warmup):
        for fn in runs.values():
            once(fn)
    times = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, fn in runs.items():
            times[name].append(once(fn))
    base, step = "datum built-in ppo_kl", "trainer built-in"
    rows = []
    for name in runs:
        t = median(times[name])
        rows.append([shape, name, f"{flops[name] / 1e9:.3f}", f"{flops[name] / flops[base]:.2f}",
                     f"{1e3 * t:.1f}", f"{t / median(times[base]):.2f}", f"{t / median(times[step]):.2f}"])
    tokens = int(batch.loss_mask.sum())
    print(f"{shape}: {batch.rollout.size} completions, {tokens} completion tokens, {len(data)} datums, "
          f"{args.rounds} rounds")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, shapes_default="tiny,small")
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds (every variant once per round)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    args = parser.parse_args()
    gpu_preset(args)
    set_threads(args.threads)
    print_machine()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.workdir) if args.workdir else Path(tmp)
        for shape in args.model_shape.split(","):
            rows += run_shape(shape, args, root)
    print_table(["shape", "loss", "GFLOP", "FLOPs / built-in", "ms (median)", "time / built-in",
                 "time / trainer step"], rows,
                title="custom vs built-in loss on the same batch (built-in = datum built-in ppo_kl)")


if __name__ == "__main__":
    main()
