"""Atomic checkpoints: a run can be killed at any moment and the newest complete checkpoint still loads.

    checkpoints/step_N/   model (save_pretrained, safetensors), tokenizer, trainer_state.pt (optimizer,
                          scheduler, RNG states, controller, data position, step), reference/ once synced

A checkpoint is written to a temporary sibling folder and renamed into place, so step_N either exists
whole or not at all.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from klgrpo.errors import ConfigError

STATE_FILE = "trainer_state.pt"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # numpy is optional
        pass
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


def save_checkpoint(run_dir: Path, step: int, *, model, tokenizer, trainer_state: dict[str, Any],
                    reference=None, keep: int = 0, model_state: dict | None = None) -> Path:
    """Write checkpoints/step_<step> atomically; prune to the newest ``keep`` (0: keep all). ``model_state``:
    the full state dict of a sharded model (gathered by the engine), saved instead of ``model``'s own."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step}"
    tmp = root / f".tmp_step_{step}_{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    if hasattr(model, "peft_config"):  # the trainable adapter only; the reference adapter is saved separately
        model.save_pretrained(tmp, safe_serialization=True, selected_adapters=["default"], state_dict=model_state)
    else:
        model.save_pretrained(tmp, safe_serialization=True, state_dict=model_state)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    if reference is not None:
        reference.save(tmp)
    torch.save({**trainer_state, "rng": rng_state(), "step": step}, tmp / STATE_FILE)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    if keep > 0:
        for old in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _STEP_DIR.match(p.name)) and (p / STATE_FILE).exists()]
    return [p for _, p in sorted(found)]


def resolve_resume(resume: str, run_dir: Path) -> Path:
    """``latest`` -> the newest checkpoint of run_dir; otherwise a checkpoint folder path."""
    if resume == "latest":
        found = list_checkpoints(run_dir)
        if not found:
            raise ConfigError(f"--resume latest: no checkpoint in {Path(run_dir) / 'checkpoints'}; "
                              f"pass --output-dir of the run to resume or a checkpoint folder")
        return found[-1]
    path = Path(resume)
    if not (path / STATE_FILE).exists():
        raise ConfigError(f"--resume {resume}: not a checkpoint folder (no {STATE_FILE}); "
                          f"pass a checkpoints/step_N folder or 'latest'")
    return path


def load_trainer_state(checkpoint: Path) -> dict[str, Any]:
    return torch.load(Path(checkpoint) / STATE_FILE, weights_only=False)
