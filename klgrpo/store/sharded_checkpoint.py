"""Sharded checkpoints through torch.distributed.checkpoint: every rank writes its shards of the weights and the
AdamW moments (safetensors files, one per rank, with DCP's sharding metadata in their headers: nothing pickled),
and any process count reads them back (``Engine.save_sharded`` / ``load_sharded``; ``klgrpo export`` reads the
weights into a whole model)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor


def save_sharded(folder: Path, model, optimizer) -> None:
    """Every rank writes its shards of the weights and the AdamW moments into ``folder``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    flat, _, _ = _flat_state(model, optimizer)
    dcp.save(flat, storage_writer=HuggingFaceStorageWriter(
        str(folder), save_distributed=torch.distributed.is_initialized()))


def load_sharded(folder: Path, model, optimizer) -> None:
    """The inverse of ``save_sharded`` on any process count: torch.distributed.checkpoint reads the parts of the
    saved shards that make up this rank's shards (every tensor must be in the checkpoint)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import set_state_dict

    flat, optim_state, tied = _flat_state(model, optimizer)
    dcp.load(flat, storage_reader=HuggingFaceStorageReader(str(folder)))
    model_state = {k.removeprefix("model."): v for k, v in flat.items() if k.startswith("model.")}
    model_state.update({alias: model_state[kept] for alias, kept in tied.items()})
    moments = {fqn: {k: flat[f"optimizer.{fqn}.{k}"] for k in s} for fqn, s in optim_state["state"].items()}
    set_state_dict(model, getattr(optimizer, "optimizer", optimizer), model_state_dict=model_state,
                   optim_state_dict={"state": moments, "param_groups": optim_state["param_groups"]})


def load_sharded_weights(model, folder: Path) -> None:
    """The weights of a sharded checkpoint folder (``save_sharded``) into a whole model in this process (its
    AdamW moments are not read)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    state = model.state_dict()
    tied = _tied_names(state)
    flat = {f"model.{k}": v for k, v in state.items() if k not in tied}
    dcp.load(flat, storage_reader=HuggingFaceStorageReader(str(folder)))
    loaded = {k.removeprefix("model."): v for k, v in flat.items()}
    model.load_state_dict({**loaded, **{alias: loaded[name] for alias, name in tied.items()}})


def _tied_names(state: dict[str, Tensor]) -> dict[str, str]:
    """{second name: first name} of the tensors that share storage and shape (tied weights; a DTensor by its
    local shard): such a tensor is stored once, as save_pretrained does."""
    first: dict[tuple, str] = {}
    tied: dict[str, str] = {}
    for name, value in state.items():
        local = value.to_local() if hasattr(value, "to_local") else value
        key = (local.data_ptr(), tuple(value.shape))
        if key in first:
            tied[name] = first[key]
        else:
            first[key] = name
    return tied


def _flat_state(model, optimizer) -> tuple[dict[str, Tensor], dict, dict[str, str]]:
    """{"model.<name>": weight, "optimizer.<name>.<exp_avg|exp_avg_sq|step>": moment} (this rank's shards under
    FSDP2), the optimizer's state dict in torch's name-keyed form (its param_groups are kept from the live
    optimizer: they follow from the config), and the tied weights' second names {alias: name kept} (a tensor
    is stored once, as save_pretrained does)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, getattr(optimizer, "optimizer", optimizer))
    tied = _tied_names(model_state)
    flat = {f"model.{k}": v for k, v in model_state.items() if k not in tied}
    flat.update({f"optimizer.{fqn}.{k}": v for fqn, s in optim_state["state"].items() for k, v in s.items()})
    return flat, optim_state, tied
