"""Trainer state as data, never code: tensors in a safetensors file, everything else in a JSON file.

    save_state(folder, "trainer_state", tree)  ->  trainer_state.safetensors + trainer_state.json
    load_state(folder, "trainer_state")        ->  the same tree, read without unpickling anything

A tree is made of dicts, lists, tuples, str, int, float, bool, None, torch tensors, numpy arrays and a few
known dataclasses (the pending batch of a checkpoint). In the JSON, a tensor is replaced by a reference to
its key in the safetensors file; tuples, dicts with non-string keys (an optimizer's state is keyed by
parameter index), numpy arrays and dataclasses are tagged objects. Decoding accepts only those tags and only
the dataclasses listed in ``_DATACLASSES``: a file can describe data, never name a function to call.

Tensors are saved bit for bit in their own dtype, Python floats as JSON numbers (``repr`` round-trips
exactly; NaN and infinities as JSON's NaN/Infinity), so a resumed run continues bit-identically. Both files
carry the same random token; a pair whose tokens differ (a crash between the two writes) is refused. The JSON
also holds the sha256 of the tensors file (a flipped bit in it is refused) and whatever ``extra`` the caller
adds (a checkpoint's weights checksums), which ``read_state_doc`` returns without reading the tensors.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import secrets
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from klgrpo.backends.sampling import SamplingFilters
from klgrpo.core.batch import StepBatch
from klgrpo.core.rollout import RolloutBatch
from klgrpo.errors import KLGRPOError, first_line
from klgrpo.math.aggregation import Normalizer

_TAG = "__klgrpo__"
_DATACLASSES = {cls.__name__: cls for cls in (StepBatch, RolloutBatch, SamplingFilters, Normalizer)}
FORMAT = 1


class StateFileError(KLGRPOError):
    """A state file is missing, truncated, from another format, or does not match its partner file."""


def state_files(folder: Path, stem: str) -> tuple[Path, Path]:
    return Path(folder) / f"{stem}.safetensors", Path(folder) / f"{stem}.json"


def save_state(folder: Path, stem: str, tree: Any, extra: dict | None = None,
               metadata: dict[str, str] | None = None) -> tuple[Path, Path]:
    """Write ``tree`` as ``<stem>.safetensors`` + ``<stem>.json`` in ``folder`` (each via a temporary name);
    ``extra``: more JSON-ready keys for the JSON file's top level; ``metadata``: more strings for the tensors
    file's header (``read_state_metadata`` returns them)."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    encoded = _encode(tree, tensors)
    token = secrets.token_hex(8)
    weights, doc = state_files(folder, stem)
    tmp = weights.with_name(f".{weights.name}.{os.getpid()}.tmp")
    save_file(tensors, str(tmp), metadata={**(metadata or {}), "token": token})
    os.replace(tmp, weights)
    tmp = doc.with_name(f".{doc.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({**(extra or {}), "format": FORMAT, "token": token, "sha256": file_sha256(weights),
                               "tree": encoded}))
    os.replace(tmp, doc)
    return weights, doc


def file_sha256(path: Path) -> str:
    """The sha256 of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def read_state_doc(folder: Path, stem: str) -> dict:
    """The JSON file of a state (its tree still encoded): for the keys a caller put there with ``extra``."""
    doc = state_files(folder, stem)[1]
    try:
        data = json.loads(doc.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise StateFileError(f"{doc} is missing") from None
    except (ValueError, UnicodeDecodeError, RecursionError, OSError):
        raise StateFileError(f"{doc} is not a klgrpo state file (unreadable JSON)") from None
    if not isinstance(data, dict) or "tree" not in data:
        raise StateFileError(f"{doc} is not a klgrpo state file (unreadable JSON)")
    return data


def read_state_metadata(folder: Path, stem: str) -> dict[str, str]:
    """The header strings of a state's tensors file (empty when it is missing or unreadable): read without the
    tensors."""
    from safetensors import safe_open

    try:
        with safe_open(str(state_files(folder, stem)[0]), framework="pt", device="cpu") as f:
            return dict(f.metadata() or {})
    except Exception:  # noqa: BLE001 -- safetensors raises its own error type for a truncated or foreign file
        return {}


@contextmanager
def folder_lock(folder: Path, on_wait: Callable[[], None] | None = None) -> Iterator[None]:
    """Hold an exclusive lock on ``folder`` (which must exist) while this process builds what other processes
    (the ranks of a launch, a second run) then load instead of building it again. The lock is a flock on the
    directory itself: nothing is written into the folder, and it goes with its process however that ends.
    ``on_wait`` is called once if another process holds it. Where the platform or the file system has no flock
    (Windows, some network file systems), nothing is locked: each process builds, and writes atomically."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait()
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # no flock here
            pass
        yield
    finally:
        os.close(fd)  # releases the lock


def load_state(folder: Path, stem: str) -> Any:
    """The tree saved by ``save_state``; tensors on the CPU. Raises StateFileError naming the bad file."""
    from safetensors import safe_open

    weights, doc = state_files(folder, stem)
    for path in (weights, doc):
        if not path.is_file():
            raise StateFileError(f"{path} is missing")
    try:
        data = json.loads(doc.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError):
        data = None
    if not isinstance(data, dict) or "tree" not in data:
        raise StateFileError(f"{doc} is not a klgrpo state file (unreadable JSON)")
    if data.get("format") != FORMAT:
        raise StateFileError(f"{doc} has format {data.get('format')!r}; this klgrpo reads format {FORMAT}")
    try:
        with safe_open(str(weights), framework="pt", device="cpu") as f:
            token = (f.metadata() or {}).get("token")
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:  # safetensors raises its own error type for a truncated or foreign file
        raise StateFileError(f"{weights} cannot be read ({first_line(exc)})") from None
    if token != data.get("token"):
        raise StateFileError(f"{weights} and {doc} were not written together (a save was cut short)")
    if "sha256" in data and file_sha256(weights) != data["sha256"]:
        raise StateFileError(f"{weights} cannot be read as saved: its sha256 checksum differs from the one in "
                             f"{doc.name} (a disk error, a cut copy or an edit)")
    try:
        return _decode(data["tree"], tensors, doc)
    except RecursionError:
        raise StateFileError(f"{doc} is nested too deeply to be a klgrpo state file") from None


def to_device(tree: Any, device) -> Any:
    """``tree`` (as loaded: CPU tensors) with every tensor moved to ``device``; dataclasses are rebuilt."""
    if isinstance(tree, torch.Tensor):
        return tree.to(device)
    if isinstance(tree, dict):
        return {k: to_device(v, device) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(to_device(v, device) for v in tree)
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        return dataclasses.replace(tree, **{f.name: to_device(getattr(tree, f.name), device)
                                            for f in dataclasses.fields(tree)})
    return tree


# ---------------------------------------------------------------------------------------------- encoding
def _encode(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        key = str(len(tensors))
        # clone: safetensors refuses tensors that share storage (views of one batch tensor do)
        tensors[key] = value.detach().to("cpu").contiguous().clone()
        return {_TAG: "tensor", "key": key}
    if isinstance(value, (list, tuple)):
        items = [_encode(v, tensors) for v in value]
        return items if isinstance(value, list) else {_TAG: "tuple", "items": items}
    if isinstance(value, dict):
        if all(isinstance(k, str) and k != _TAG for k in value):
            return {k: _encode(v, tensors) for k, v in value.items()}
        return {_TAG: "dict", "items": [[_encode(k, tensors), _encode(v, tensors)] for k, v in value.items()]}
    if dataclasses.is_dataclass(value) and type(value).__name__ in _DATACLASSES:
        fields = {f.name: _encode(getattr(value, f.name), tensors) for f in dataclasses.fields(value)}
        return {_TAG: "dataclass", "type": type(value).__name__, "fields": fields}
    if type(value).__module__ == "numpy":
        import numpy as np

        if isinstance(value, np.ndarray):
            return {_TAG: "ndarray", "dtype": str(value.dtype), "shape": list(value.shape),
                    "data": value.reshape(-1).tolist()}
        return _encode(value.item(), tensors)  # a numpy scalar
    raise TypeError(f"cannot store a {type(value).__name__} in a klgrpo state file")


def _decode(value: Any, tensors: dict[str, torch.Tensor], where: Path) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors, where) for v in value]
    if not isinstance(value, dict):
        return value
    tag = value.get(_TAG)
    if tag is None:
        return {k: _decode(v, tensors, where) for k, v in value.items()}
    try:
        if tag == "tensor":
            return tensors[value["key"]]
        if tag == "tuple":
            return tuple(_decode(v, tensors, where) for v in value["items"])
        if tag == "dict":
            return {_hashable(_decode(k, tensors, where)): _decode(v, tensors, where) for k, v in value["items"]}
        if tag == "dataclass":
            cls = _DATACLASSES[value["type"]]
            return cls(**{k: _decode(v, tensors, where) for k, v in value["fields"].items()})
        if tag == "ndarray":
            import numpy as np

            return np.asarray(value["data"], dtype=np.dtype(value["dtype"])).reshape(value["shape"])
    except (KeyError, TypeError, ValueError):
        pass
    raise StateFileError(f"{where} holds an entry klgrpo does not know ({str(tag)[:40]!r}); it is not a klgrpo "
                         f"state file of this version")


def _hashable(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key


__all__ = ["save_state", "load_state", "read_state_doc", "read_state_metadata", "file_sha256",
           "to_device", "state_files", "StateFileError",
           "FORMAT"]
