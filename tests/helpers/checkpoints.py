"""Checkpoints edited the way a test needs: checksum entries removed, or made into one written before klgrpo
recorded checksums (no checksum entries and no ``checkpoint_version``, neither in trainer_state.json nor in
trainer_state.safetensors' header)."""

from __future__ import annotations

import json
from pathlib import Path


def strip_checksums(ckpt: Path, as_before_checksums: bool = False) -> Path:
    """Remove the checksum entries from trainer_state.json; ``as_before_checksums``: also the layout version
    there and in the tensors file's header (the token the two files share is kept)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    doc = Path(ckpt) / "trainer_state.json"
    data = json.loads(doc.read_text())
    for key in ("weights_sha256", "sha256", *(["checkpoint_version"] if as_before_checksums else [])):
        data.pop(key, None)
    if as_before_checksums:
        tensors_file = Path(ckpt) / "trainer_state.safetensors"
        with safe_open(str(tensors_file), framework="pt") as f:
            tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata())
        meta.pop("checkpoint_version", None)
        save_file(tensors, str(tensors_file), metadata=meta)
    doc.write_text(json.dumps(data))
    return Path(ckpt)
