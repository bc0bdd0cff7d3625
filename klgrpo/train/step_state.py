"""What a GRPOStep owns, written into and read from one checkpoint folder (``GRPOStep.save`` / ``GRPOStep.load``).

The step owns its weights (the policy's, whole or as every rank's shards; the reference's once synced), its
optimizer, scheduler, KL and entropy controllers, non-finite guard, data position, pending batch, replay position
and every rank's RNG. The run (run/loop.py) only names the folder: store/checkpoint.py makes it atomic, checks its
checksums and prunes old ones; the run's own part of the state (its warning signs, the evaluation before the first
step) travels beside the step's in the same trainer_state file and comes back from ``load``.

Every rank calls both (the weights are gathered or sharded with collectives); rank 0 writes the files.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from klgrpo.core.reference import FrozenCopyReference
from klgrpo.errors import KLGRPOError, first_line
from klgrpo.store.checkpoint import (
    SHARDS_DIR,
    STATE_FILE,
    CheckpointLoadError,
    load_trainer_state,
    rng_state,
    set_rng_state,
    write_checkpoint_files,
)
from klgrpo.store.state_io import to_device
from klgrpo.train.building import seed_everything

if TYPE_CHECKING:
    from klgrpo.train.step import GRPOStep


# --------------------------------------------------------------------------------------------------- state
def step_state(step: GRPOStep, with_optimizer: bool = True) -> dict[str, Any]:
    """Everything a resume needs from the step but the weights and the RNG; ``with_optimizer=False``: the AdamW
    moments travel with a sharded checkpoint's shards."""
    optimizer = step.engine.optimizer_state_dict(step.optimizer) if with_optimizer else None
    return {"optimizer": optimizer, "scheduler": step.scheduler.state_dict(),
            "controller": step.controller.state_dict(), "sampler": step.prompt_order.state_dict(),
            "entropy_controller": step.entropy_controller.state_dict(),
            "pending_batch": step.batch, "replay": step.replay.state_dict() if step.replay else None,
            "guard": step.guard.state_dict(), "step": step.completed}


def load_step_state(step: GRPOStep, state: dict[str, Any], same_layout: bool = True) -> None:
    """Restore ``step_state()``'s output; ``same_layout=False`` (another world size) drops a half-used batch,
    which belongs to the old process layout."""
    if state["optimizer"] is not None:  # None: a sharded checkpoint's moments, loaded with its weights
        step.engine.load_optimizer_state(step.optimizer, state["optimizer"])
    step.scheduler.load_state_dict(state["scheduler"])
    step.controller.load_state_dict(state["controller"])
    if state.get("entropy_controller") is not None:  # absent in checkpoints written before the entropy bonus
        step.entropy_controller.load_state_dict(state["entropy_controller"])
    step.prompt_order.load_state_dict(state["sampler"])
    batch = state.get("pending_batch")
    step.batch = to_device(batch, step.device) if batch is not None and same_layout else None
    step.guard.load_state_dict(state.get("guard"))
    if step.replay is not None and state.get("replay") is not None:
        step.replay.load_state_dict(state["replay"])
    step.completed = int(state["step"])


# ---------------------------------------------------------------------------------------------------- save
def save_step(step: GRPOStep, folder: Path, sharded: bool = False, run_state: dict | None = None) -> None:
    """Write the step into ``folder`` (see the module's docstring). ``sharded``: every rank writes its shards of
    the weights and AdamW moments into folder/sharded, rank 0 the rest."""
    engine, dist = step.engine, step.dist
    rng_by_rank = dist.gather_objects(rng_state())
    model_state = None
    if sharded:
        engine.save_sharded(Path(folder) / SHARDS_DIR, step.model, step.optimizer)
        state = step_state(step, with_optimizer=False)
    else:
        state = step_state(step)
        model_state = engine.full_state_dict(step.model)  # collectives
    reference_state = None
    if isinstance(step.reference, FrozenCopyReference) and step.reference.synced:  # kl.sync_every's weights
        reference_state = engine.full_state_dict(step.reference.model)  # a collective under FSDP2
    if dist.is_main:
        write_checkpoint_files(folder, model=step.model, tokenizer=step.tokenizer, reference=step.reference,
                               trainer_state={**(run_state or {}), **state, "rng_by_rank": rng_by_rank},
                               model_state=model_state, reference_state=reference_state, sharded=sharded)


# ---------------------------------------------------------------------------------------------------- load
def load_step(step: GRPOStep, folder: Path) -> dict[str, Any]:
    """Read everything the step owns from the checkpoint ``folder``; returns the whole trainer state (the run's
    part included). Raises CheckpointLoadError naming the file that cannot be read or used. The trainer state is
    read before anything is applied; the weights are applied first (a failure afterwards leaves them changed,
    and the next candidate checkpoint overwrites them)."""
    folder = Path(folder)
    state = load_trainer_state(folder)
    _load_weights(step, folder)
    try:
        _apply_state(step, state)
    except KLGRPOError:
        raise
    except Exception as exc:  # a hand-edited or foreign state: wrong types, shapes or keys
        raise CheckpointLoadError(f"{folder / STATE_FILE} holds a trainer state this run cannot use "
                                  f"({type(exc).__name__}: {first_line(exc)})") from None
    return state


def _apply_state(step: GRPOStep, state: dict[str, Any]) -> None:
    dist = step.dist
    # Checkpoints before every rank's RNG was kept hold one state, "rng" (rank 0's).
    rng_by_rank = state.get("rng_by_rank") or [state["rng"]]
    same_layout = len(rng_by_rank) == dist.world_size
    load_step_state(step, state, same_layout=same_layout)
    if same_layout:
        set_rng_state(rng_by_rank[dist.rank])
    else:  # another world size: resumes correctly but not bit-identically
        seed_everything(step.plan.seed + dist.rank + 7919 * int(state["step"]))


def _load_weights(step: GRPOStep, ckpt: Path) -> None:
    adapter = ckpt / "adapter_model.safetensors"
    target = adapter if adapter.exists() else ckpt / "model.safetensors"
    shards = ckpt / SHARDS_DIR
    engine = step.engine
    try:
        if shards.is_dir() and not target.exists():
            target = shards
            engine.load_sharded(shards, step.model, step.optimizer)  # weights and AdamW moments
        elif adapter.exists():
            engine.load_adapter(step.model, ckpt)
        elif target.exists():
            engine.load_model_file(step.model, target, step.device)
        else:
            raise CheckpointLoadError(f"{target} is missing")
    except KLGRPOError:
        raise
    except Exception as exc:  # safetensors and torch raise several types for a truncated or foreign file
        raise CheckpointLoadError(f"{target} cannot be read ({first_line(exc)})") from None
    if step.reference is not None:
        try:
            _load_reference(step, ckpt)
        except KLGRPOError:
            raise
        except Exception as exc:
            raise CheckpointLoadError(f"the reference in {ckpt} cannot be read ({first_line(exc)})") from None


def _load_reference(step: GRPOStep, ckpt: Path) -> None:
    """The reference's synced weights (kl.sync_every) when the checkpoint has them; a sharded frozen copy
    (FSDP2) loads them through the engine, which shards the full tensors."""
    reference = step.reference
    path = ckpt / "reference" / "model.safetensors"
    if isinstance(reference, FrozenCopyReference) and step.engine.kind == "fsdp2":
        if path.exists():
            step.engine.load_model_file(reference.model, path, step.device)
            reference.synced = True
        return
    reference.load(ckpt)
