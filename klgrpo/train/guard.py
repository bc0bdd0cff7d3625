"""Non-finite guard: a step whose loss or gradient norm is NaN or infinite never reaches the weights.

The trainer asks ``NonFiniteGuard.allows_update(loss, grad_norm)`` after the backward pass and before the
optimizer step. A non-finite step is skipped: gradients dropped, no optimizer, scheduler or KL-controller
update, counted in ``train/skipped_steps``. After ``train.max_skipped_steps`` skipped steps in a row the run
stops and ``train()`` raises ``NonFiniteError`` (the CLI exits non-zero). ``check_finite_weights`` refuses
to write a checkpoint whose weights hold a NaN or an infinity, so the newest checkpoint always loads into a
usable model.
"""

from __future__ import annotations

import torch

from klgrpo.errors import NonFiniteError


class NonFiniteGuard:
    """Counts skipped steps; ``exhausted`` once ``max_consecutive`` steps in a row were skipped."""

    def __init__(self, max_consecutive: int = 3):
        self.max_consecutive = max(1, int(max_consecutive))
        self.skipped_total = 0
        self.consecutive = 0
        self.last_reason = ""

    def allows_update(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        """True when loss and gradient norm are finite (one host sync); otherwise counts a skipped step."""
        values = torch.stack([torch.as_tensor(loss).detach().float().reshape(()).to(grad_norm.device),
                              grad_norm.detach().float().reshape(())])
        finite = torch.isfinite(values).cpu().tolist()
        if all(finite):
            self.consecutive = 0
            return True
        self.skipped_total += 1
        self.consecutive += 1
        self.last_reason = "loss" if not finite[0] else "gradient norm"
        return False

    @property
    def exhausted(self) -> bool:
        return self.consecutive >= self.max_consecutive

    def stop_message(self, step: int) -> str:
        return (f"{self.consecutive} steps in a row up to step {step} had a non-finite {self.last_reason} and were "
                f"skipped (train.max_skipped_steps={self.max_consecutive}); the weights are those of the last good "
                "step (saved). Check the rewards and the data, or lower optim.lr / set optim.max_grad_norm in a "
                "new run")

    def state_dict(self) -> dict:
        return {"skipped_total": self.skipped_total, "consecutive": self.consecutive}

    def load_state_dict(self, state: dict | None) -> None:
        state = state or {}
        self.skipped_total = int(state.get("skipped_total", 0))
        self.consecutive = 0  # a resumed run gets max_consecutive fresh chances


__all__ = ["NonFiniteGuard", "NonFiniteError"]
