"""The frozen reference model behind a small interface: log-probs of a batch, optional sync, checkpointing.

Kinds:
    FrozenCopyReference   a copy of the initial policy (or another checkpoint), eval mode, no grad
    (LoRA: the policy with adapters disabled slots in behind the same interface; see klgrpo.lora)

Reference log-probs are computed once per generated batch without gradient and reused across
num_iterations and micro-batches.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor

from klgrpo.models import completion_logprobs, position_ids_from_mask
from klgrpo.rollout import RolloutBatch


class Reference(Protocol):
    def logprobs(self, batch: RolloutBatch, temperature: float, micro_batch_size: int = 0) -> Tensor: ...

    def logits(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """Full next-token logits [B, L, V] of the reference (no grad), e.g. for the exact replay KL."""
        ...

    def sync(self, policy, alpha: float) -> None: ...

    def save(self, folder: Path) -> None: ...

    def load(self, folder: Path) -> None: ...


def _micro_slices(n: int, size: int):
    size = size or n
    for start in range(0, n, size):
        yield slice(start, min(start + size, n))


class FrozenCopyReference:
    """A separate frozen model: a deep copy of the policy at start, or weights loaded from elsewhere."""

    def __init__(self, model):
        self.model = model
        self.model.eval()
        self.model.requires_grad_(False)
        self.synced = False  # once synced, checkpoints must carry the reference's own weights
        self.forward_model = model  # what logprobs runs: the model, or its compiled wrapper (compile())

    def compile(self) -> None:
        """Run ``logprobs`` through torch.compile(model) (train.compile): same weights, so ``sync`` still applies."""
        self.forward_model = torch.compile(self.model)

    @classmethod
    def copy_of(cls, policy) -> "FrozenCopyReference":
        return cls(copy.deepcopy(policy))

    def logprobs(self, batch: RolloutBatch, temperature: float, micro_batch_size: int = 0) -> Tensor:
        # inference_mode skips autograd's version counting and view tracking, which no_grad keeps; the result
        # is copied out of it as a normal tensor, which the loss may save for its backward.
        with torch.inference_mode():
            parts = [completion_logprobs(self.forward_model, batch, temperature, rows=sl)[0]
                     for sl in _micro_slices(batch.size, micro_batch_size)]
            out = torch.cat(parts, dim=0)
        return out.clone()

    @torch.no_grad()
    def logits(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask,
                          position_ids=position_ids_from_mask(attention_mask), use_cache=False).logits

    @torch.no_grad()
    def sync(self, policy, alpha: float = 1.0) -> None:
        """ref <- alpha * policy + (1 - alpha) * ref (alpha = 1: a copy), parameter by parameter."""
        for p_ref, p in zip(self.model.parameters(), policy.parameters()):
            p_ref.mul_(1.0 - alpha).add_(p.detach().to(p_ref.dtype), alpha=alpha)
        self.synced = True

    def save(self, folder: Path) -> None:
        if self.synced:
            self.model.save_pretrained(folder / "reference")

    def load(self, folder: Path) -> None:
        from safetensors.torch import load_model

        path = folder / "reference" / "model.safetensors"
        if path.exists():
            load_model(self.model, str(path), strict=False)
            self.synced = True
