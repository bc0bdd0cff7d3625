"""Run under torchrun with 2 CPU processes: each rank takes its shard of a saved global batch, computes the
gradient and metrics through the trainer's own path, and rank 0 writes them for the test to compare."""

import json
import sys

import torch

from klgrpo.train.config import GRPOConfig
from klgrpo.train.step_metrics import step_metrics
from klgrpo.train.trainer import GRPOTrainer


def perturb(model, seed=1):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen, dtype=p.dtype))


def gradient_and_metrics(trainer, batch):
    perturb(trainer.model)
    sums, maxes, entropy, _ = trainer.accumulate_gradients(batch)
    trainer.dist.sum_gradients(trainer.model.parameters())
    grad = torch.cat([p.grad.reshape(-1) for p in trainer.model.parameters() if p.grad is not None])
    metrics, _ = step_metrics(batch, sums, maxes, entropy, torch.tensor(0.0), trainer.controller.value, 0.0, {},
                              trainer.dist, trainer.device)
    return grad, metrics


if __name__ == "__main__":
    config_file, batch_file, out_file = sys.argv[1:4]
    cfg = GRPOConfig.from_dict(json.loads(open(config_file).read()))
    trainer = GRPOTrainer(cfg, log=lambda *_: None)
    assert trainer.dist.world_size == 2, f"expected 2 processes, got {trainer.dist.world_size}"
    batch = torch.load(batch_file, weights_only=False)
    grad, metrics = gradient_and_metrics(trainer, batch.rows(trainer.dist.local_slice(batch.rollout.size)))
    if trainer.dist.is_main:
        torch.save({"grad": grad, "metrics": metrics, "world_size": trainer.dist.world_size}, out_file)
