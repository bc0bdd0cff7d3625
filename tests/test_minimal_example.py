"""examples/minimal_grpo.py makes the same update as GRPOTrainer on the same batch, from the same weights."""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from klgrpo.math.kl_control import build_controller
from klgrpo.run.trainer import GRPOTrainer
from tests.helpers.configs import make_config, quiet

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "minimal_grpo.py"


def _load_example():
    spec = importlib.util.spec_from_file_location("minimal_grpo", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


def _perturb(model, seed=1):
    """Move the policy off the reference, so the KL term and its gradient are not zero."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype))


@pytest.mark.parametrize("estimator", ["k3_st", "k3"])
def test_example_step_equals_the_trainers(tiny_model_dir, addition_file, tmp_path, estimator):
    ex = _load_example()
    args = ex.Args(prompts_per_step=4, group_size=4, max_new_tokens=4, lr=1e-2, beta=0.1, kl_estimator=estimator,
                   controller="adaptive", kl_target=0.01, horizon=100.0)
    cfg = make_config(tiny_model_dir, addition_file, tmp_path,
                      kl={"coef": args.beta, "estimator": estimator, "controller": "adaptive",
                          "target": args.kl_target, "horizon": args.horizon},
                      optim={"lr": args.lr}, train={"steps": 1})
    trainer = GRPOTrainer(cfg, log=quiet)
    reference = copy.deepcopy(trainer.model).requires_grad_(False)  # the trainer's frozen copy, taken at build
    _perturb(trainer.model)
    policy = copy.deepcopy(trainer.model)
    batches = []
    make_batch = trainer.grpo_step.make_batch
    trainer.grpo_step.make_batch = lambda: batches.append(make_batch()) or batches[-1]  # keep the batch it drew
    metrics = trainer.train_step()
    batch = batches[0]

    controller = build_controller("adaptive", args.beta, target=args.kl_target, horizon=args.horizon)
    stats = ex.grpo_step(policy, reference, ex.make_optimizer(policy, args), controller, batch.rollout,
                         batch.rewards, args)

    assert metrics["adaptive_kl/raw_kl"] > 1e-3  # the KL term is really exercised
    assert stats["loss"] == pytest.approx(metrics["train/loss"], rel=1e-5, abs=1e-7)
    assert stats["kl"] == pytest.approx(metrics["adaptive_kl/raw_kl"], rel=1e-5)
    assert stats["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=1e-5)
    assert controller.value == pytest.approx(trainer.controller.value, rel=1e-6)
    checked = total = 0
    for (name, ours), theirs in zip(policy.named_parameters(), trainer.model.parameters()):
        assert torch.allclose(ours.grad, theirs.grad, rtol=1e-4, atol=1e-7), name  # the clipped gradients
        # AdamW's first step is lr * g / (|g| + 1e-8): where |g| is near 0 float rounding of g flips it, so the
        # weights are compared where the step is well defined (elsewhere both moved by at most lr).
        stable = theirs.grad.abs() > 1e-6
        checked += int(stable.sum())
        total += stable.numel()
        assert torch.allclose(ours[stable], theirs[stable], rtol=0, atol=1e-6), name
        assert (ours - theirs).abs().max() <= 2 * args.lr, name
    assert checked > 0.9 * total, (checked, total)
