"""Resume from the newest checkpoint that loads.

``--resume latest`` tries the run's complete checkpoints newest first: a checkpoint whose trainer state or
weights cannot be read (a truncated file, a disk error, a weights file whose sha256 no longer matches the one
saved with it) is named in a warning and the next older one is used. ``--resume <folder>`` names one
checkpoint; if it does not load, the error names the file.
Everything is read before anything is applied, except the weights, which the next candidate overwrites.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from klgrpo.errors import ConfigError, KLGRPOError, first_line, warn
from klgrpo.run.checkpoint import (SHARDS_DIR, STATE_FILE, load_trainer_state, resume_candidates,
                                    verify_checksums)


class CheckpointLoadError(KLGRPOError):
    """A checkpoint's file cannot be read."""


def load_resumable_checkpoint(step, run_dir: Path, resume: str, apply=None) -> tuple[Path, dict[str, Any]]:
    """Load the weights (policy and reference) of the first candidate that loads into ``step``'s models (a
    GRPOStep), and ``apply(state)`` its trainer state (optimizer, scheduler, ...): a state of the wrong shape or
    types counts as a checkpoint that does not load. Returns that checkpoint and its trainer state."""
    candidates = resume_candidates(resume, run_dir)
    failures = []
    for ckpt in candidates:
        try:
            verify_checksums(ckpt)  # first: every rank reads the same files, so all reach the same verdict
            state = load_trainer_state(ckpt)
            _load_weights(step, ckpt)
            if apply is not None:
                _apply_state(apply, state, ckpt)
        except KLGRPOError as exc:
            failures.append(str(exc))
            if len(candidates) > 1:
                warn(f"checkpoint {ckpt.name} cannot be loaded: {exc}")
            continue
        if failures:
            warn(f"resuming from {ckpt} instead (the newest checkpoint that loads)")
        return ckpt, state
    if len(candidates) == 1:
        raise CheckpointLoadError(f"cannot resume: {failures[0]}; pass --resume an intact checkpoint folder")
    raise CheckpointLoadError(f"cannot resume: none of the {len(candidates)} checkpoints loads (newest: "
                              f"{failures[0]}); start a new run")


def _apply_state(apply, state: dict, ckpt: Path) -> None:
    try:
        apply(state)
    except KLGRPOError:
        raise
    except Exception as exc:  # a hand-edited or foreign state: wrong types, shapes or keys
        raise CheckpointLoadError(f"{ckpt / STATE_FILE} holds a trainer state this run cannot use "
                                  f"({type(exc).__name__}: {first_line(exc)})") from None


def _load_reference(step, ckpt: Path) -> None:
    """The reference's synced weights (kl.sync_every) when the checkpoint has them; a sharded frozen copy
    (FSDP2) loads them through the engine, which shards the full tensors."""
    from klgrpo.core.reference import FrozenCopyReference

    reference = step.reference
    path = ckpt / "reference" / "model.safetensors"
    if isinstance(reference, FrozenCopyReference) and step.engine.kind == "fsdp2":
        if path.exists():
            step.engine.load_model_file(reference.model, path, step.device)
            reference.synced = True
        return
    reference.load(ckpt)


def _load_weights(step, ckpt: Path) -> None:
    adapter = ckpt / "adapter_model.safetensors"
    target = adapter if adapter.exists() else ckpt / "model.safetensors"
    shards = ckpt / SHARDS_DIR
    try:
        if shards.is_dir() and not target.exists():
            target = shards
            step.engine.load_sharded(shards, step.model, step.optimizer)  # weights and AdamW moments
        elif adapter.exists():
            step.engine.load_adapter(step.model, ckpt)
        elif target.exists():
            step.engine.load_model_file(step.model, target, step.device)
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


__all__ = ["load_resumable_checkpoint", "CheckpointLoadError", "ConfigError"]
