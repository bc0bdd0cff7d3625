"""Resume from the newest checkpoint that loads.

``--resume latest`` tries the run's complete checkpoints newest first: a checkpoint whose trainer state or
weights cannot be read (a truncated file, a disk error, a weights file whose sha256 no longer matches the one
saved with it) is named in a warning and the next older one is used. ``--resume <folder>`` names one
checkpoint; if it does not load, the error names the file. What a checkpoint holds is read by whoever owns it
(the step: ``GRPOStep.load``); this module only picks the folders and checks their bytes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

from klgrpo.errors import ConfigError, KLGRPOError, warn
from klgrpo.store.checkpoint import CheckpointLoadError, resume_candidates, verify_checksums


def load_resumable_checkpoint(run_dir: Path, resume: str,
                              load: Callable[[Path], dict[str, Any]]) -> tuple[Path, dict[str, Any], list[Path]]:
    """``load(folder)`` the first candidate checkpoint whose checksums hold and that loads (``load`` raises a
    KLGRPOError for one that does not). Returns that checkpoint, what ``load`` returned, and the newer candidates
    that did not load (``set_aside`` keeps them out of the way of the steps trained again)."""
    candidates = resume_candidates(resume, run_dir)
    failures = []
    for ckpt in candidates:
        try:
            verify_checksums(ckpt)  # first: every rank reads the same files, so all reach the same verdict
            state = load(ckpt)
        except KLGRPOError as exc:
            failures.append(str(exc))
            if len(candidates) > 1:
                warn(f"checkpoint {ckpt.name} cannot be loaded: {exc}")
            continue
        if failures:
            warn(f"resuming from {ckpt} instead (the newest checkpoint that loads)")
        return ckpt, state, candidates[:candidates.index(ckpt)]
    if len(candidates) == 1:
        raise CheckpointLoadError(f"cannot resume: {failures[0]}; pass --resume an intact checkpoint folder")
    raise CheckpointLoadError(f"cannot resume: none of the {len(candidates)} checkpoints loads (newest: "
                              f"{failures[0]}); start a new run")


def set_aside(damaged: list[Path]) -> list[Path]:
    """Rename each checkpoint folder that did not load to ``damaged_step_N`` beside it (``damaged_step_N.2``, ...
    where that is taken), so the steps trained again write their checkpoints without replacing it: it is kept
    as it was, for a look or a repair, and never counted as a checkpoint again. Returns the new names."""
    moved = []
    for folder in damaged:
        target, n = folder.with_name(f"damaged_{folder.name}"), 1
        while target.exists():
            n += 1
            target = folder.with_name(f"damaged_{folder.name}.{n}")
        os.replace(folder, target)
        moved.append(target)
    return moved


__all__ = ["load_resumable_checkpoint", "CheckpointLoadError", "ConfigError", "set_aside"]
