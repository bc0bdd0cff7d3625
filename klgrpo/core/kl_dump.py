"""Per-token log-prob dumps of a training run (``kl.dump_every``), read by ``klgrpo verify-kl --from-run``.

``RUN_DIR/kl_dumps/step_NNNNNN.safetensors``: tensors ``logp`` float32 [B, T], ``ref_logp`` float32 [B, T] and
``mask`` bool [B, T] (log-probs of the sampled tokens under the policy and the reference), the step in the
file's metadata (``{"step": "N"}``). Plain tensors: reading one executes nothing.
"""

from __future__ import annotations

from pathlib import Path

from torch import Tensor

from klgrpo.errors import DataError, first_line

DUMP_DIR = "kl_dumps"
DUMP_GLOB = "step_*.safetensors"
_KEYS = ("logp", "ref_logp", "mask")


class DumpError(DataError):
    """A missing folder, a missing dump or a malformed dump; the message is one sentence with the remedy."""


def save_dump(path: Path, step: int, logp: Tensor, ref_logp: Tensor, mask: Tensor) -> None:
    """Write one dump (the module docstring's format)."""
    from safetensors.torch import save_file

    tensors = {"logp": logp.float().cpu().contiguous(), "ref_logp": ref_logp.float().cpu().contiguous(),
               "mask": mask.bool().cpu().contiguous()}
    save_file(tensors, str(path), metadata={"step": str(int(step))})


def load_dump(path: Path) -> dict:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            dump = {k: f.get_tensor(k) for k in f.keys()}
            dump["step"] = int((f.metadata() or {}).get("step", -1))
    except Exception as exc:  # a truncated or foreign file: say which one
        raise DumpError(f"cannot read KL dump {str(path)!r}: {first_line(exc, limit=None)}") from None
    if any(k not in dump for k in _KEYS):
        raise DumpError(f"KL dump {str(path)!r} must hold the tensors {', '.join(_KEYS)}")
    shapes = {tuple(dump[k].shape) for k in _KEYS}
    if len(shapes) != 1:
        raise DumpError(f"KL dump {str(path)!r}: logp, ref_logp and mask must have the same [B, T] shape, "
                        f"got {[tuple(dump[k].shape) for k in _KEYS]}")
    return dump
