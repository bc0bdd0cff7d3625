"""What a GRPOStep owns, in a checkpoint folder and in memory: plain helpers over the step's parts (its engine,
model, optimizer, reference), which the step's own methods compose (``GRPOStep.save`` / ``load`` and
``snapshot`` / ``restore``, train/step.py). None of them knows the step: what its state holds is the step's.

The step owns its weights (the policy's, whole or as every rank's shards; the reference's once synced), its
optimizer, scheduler, KL and entropy controllers, non-finite guard, data position, pending batch, replay position
and every rank's RNG. The run (run/loop.py) only names the folder: store/checkpoint.py makes it atomic, checks its
checksums and prunes old ones; the run's own part of the state (its warning signs, the evaluation before the first
step) travels beside the step's in the same trainer_state file and comes back from ``load``.

Every rank calls the folder's helpers (the weights are gathered or sharded with collectives); rank 0 writes the
files.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

from klgrpo.core.reference import FrozenCopyReference
from klgrpo.errors import KLGRPOError, first_line
from klgrpo.store.checkpoint import SHARDS_DIR, STATE_FILE, CheckpointLoadError


# ---------------------------------------------------------------------------------------------- in memory
@dataclasses.dataclass(frozen=True)
class StepSnapshot:
    """``GRPOStep.snapshot()``: CPU copies, never shared with the live tensors, of the trainable weights, a synced
    reference's weights (None where the reference is frozen or absent), the step's state and the RNG."""

    weights: dict[str, torch.Tensor]
    reference: dict[str, torch.Tensor] | None
    state: dict[str, Any]
    rng: dict[str, Any]


def cpu_copy(tree: Any) -> Any:
    """``tree`` with every tensor copied to the CPU (never shared with the live one: AdamW updates in place)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {k: cpu_copy(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(cpu_copy(v) for v in tree)
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        return dataclasses.replace(
            tree, **{f.name: cpu_copy(getattr(tree, f.name)) for f in dataclasses.fields(tree) if f.init}
        )
    return tree


def trainable(model) -> dict[str, torch.Tensor]:
    """The parameters the optimizer trains, by name (a LoRA run's adapters; every weight otherwise)."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def synced_reference_model(reference):
    """The reference's module where kl.sync_every has moved it off the start (its weights are state), else None."""
    return reference.model if getattr(reference, "synced", False) else None


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# ---------------------------------------------------------------------------------------------- the folder
def synced_reference_state(engine, reference) -> dict[str, torch.Tensor] | None:
    """Every rank calls this: the full weights of a reference kl.sync_every moved (a collective under FSDP2), for
    the checkpoint; None where the reference is the start's."""
    if isinstance(reference, FrozenCopyReference) and reference.synced:
        return engine.full_state_dict(reference.model)
    return None


@contextmanager
def state_named(folder: Path) -> Iterator[None]:
    """Applying a trainer state: a hand-edited or foreign one (wrong types, shapes or keys) raises a
    CheckpointLoadError naming its file."""
    try:
        yield
    except KLGRPOError:
        raise
    except Exception as exc:
        raise CheckpointLoadError(
            f"{Path(folder) / STATE_FILE} holds a trainer state this run cannot use "
            f"({type(exc).__name__}: {first_line(exc)})"
        ) from None


def load_weights(ckpt: Path, *, engine, model, optimizer, reference, device) -> None:
    """The policy's weights from the checkpoint ``ckpt`` (an adapter, a whole model file, or the ranks' shards with
    the AdamW moments), then the reference's; a file that cannot be read raises a CheckpointLoadError naming it."""
    ckpt = Path(ckpt)
    adapter = ckpt / "adapter_model.safetensors"
    target = adapter if adapter.exists() else ckpt / "model.safetensors"
    shards = ckpt / SHARDS_DIR
    try:
        if shards.is_dir() and not target.exists():
            target = shards
            engine.load_sharded(shards, model, optimizer)  # weights and AdamW moments
        elif adapter.exists():
            engine.load_adapter(model, ckpt)
        elif target.exists():
            engine.load_model_file(model, target, device)
        else:
            raise CheckpointLoadError(f"{target} is missing")
    except KLGRPOError:
        raise
    except Exception as exc:  # safetensors and torch raise several types for a truncated or foreign file
        raise CheckpointLoadError(f"{target} cannot be read ({first_line(exc)})") from None
    if reference is not None:
        try:
            _load_reference(ckpt, engine, reference, device)
        except KLGRPOError:
            raise
        except Exception as exc:
            raise CheckpointLoadError(f"the reference in {ckpt} cannot be read ({first_line(exc)})") from None


def _load_reference(ckpt: Path, engine, reference, device) -> None:
    """The reference's synced weights (kl.sync_every) when the checkpoint has them; a sharded frozen copy
    (FSDP2) loads them through the engine, which shards the full tensors."""
    path = ckpt / "reference" / "model.safetensors"
    if isinstance(reference, FrozenCopyReference) and engine.kind == "fsdp2":
        if path.exists():
            engine.load_model_file(reference.model, path, device)
            reference.synced = True
        return
    reference.load(ckpt)
