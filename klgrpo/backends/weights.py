"""A model's weights checked against the model they load into: every weight present, nothing else, each of the
model's shape and a floating-point type. A load that initialises a missing weight at random scores a random
model without a word, so every load of a trained model (resume, eval, kl, export) refuses it in one line."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import Tensor

from klgrpo.errors import ConfigError


def check_weight_report(path, *, missing=(), unexpected=(), mismatched=(), total: int, fix: str) -> None:
    """One ConfigError line naming what ``path`` lacks, what it holds beyond the model's ``total`` weights, and
    which tensors have another shape than the model's; nothing when all three are empty."""
    missing, unexpected, mismatched = sorted(missing), sorted(unexpected), sorted(mismatched)
    parts = []
    if missing:
        parts.append(f"lacks {len(missing)} of the model's {total} weights ({_names(missing)})")
    if unexpected:
        parts.append(f"holds {len(unexpected)} weights the model does not have ({_names(unexpected)})")
    if mismatched:
        parts.append(f"has {len(mismatched)} weights of another shape than the model's ({_names(mismatched)})")
    if parts:
        raise ConfigError(f"{path} {'; '.join(parts)}: it is not a checkpoint of this model; {fix}")


def check_weight_names(model, names, path, fix: str) -> None:
    """``names`` (the tensors of a weights file) cover every entry of ``model``'s state dict, counting a tied
    weight as present when any of its names is, and name nothing else."""
    names = set(names)
    aliases: dict[int, set[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), set()).add(name)
    expected = set(model.state_dict().keys())
    tied = {n: group for group in aliases.values() for n in group}
    missing = [n for n in expected - names if not (tied.get(n, set()) & names)]
    check_weight_report(path, missing=missing, unexpected=names - expected, total=len(expected), fix=fix)


def check_float_weights(model, folder: Path, fix: str) -> None:
    """Every tensor of the safetensors files in ``folder`` that the model holds as a floating-point weight has a
    floating-point type in the file too (a header whose dtype was changed to an integer type of the same size
    would otherwise load as garbage numbers)."""
    from safetensors import safe_open

    floats = {n for n, t in model.state_dict().items() if t.is_floating_point()}
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                dtype = f.get_slice(name).get_dtype()
                if name in floats and not dtype.startswith(("F", "BF")):
                    raise ConfigError(f"{file}: weight {name} is stored as {dtype}, but the model holds it as a "
                                      f"floating-point tensor: the file was altered; {fix}")


def whole(value: Tensor) -> Tensor:
    """``value`` as it is: the ``gather`` of a model whose parameters are not sharded."""
    return value.detach()


def named_whole_weights(model, gather: Callable[[Tensor], Tensor] = whole) -> Iterator[tuple[str, Tensor]]:
    """(name, tensor) of ``model`` as transformers names them, one tensor at a time, for a copy of the model held
    elsewhere (a vLLM engine). ``gather`` turns each parameter (``state_dict(keep_vars=True)``'s entry: a sharded
    one as FSDP2 or ZeRO-3 keeps it) into the whole tensor, so the whole model is never gathered at once. A LoRA
    policy comes merged: each target layer's base weight plus its adapters' B @ A x scaling (peft's own delta,
    computed here from the gathered factors), the model itself left untouched (peft's merge and unmerge would
    round its frozen weights on every push)."""
    base = base_model(model)
    for name, value, lora_layer in _whole_entries(base):
        value = gather(value)
        delta = None if lora_layer is None else _lora_delta(base.get_submodule(lora_layer), gather)
        yield name, value if delta is None else (value + delta).to(value.dtype)


def whole_weight_specs(model) -> list[tuple[str, torch.dtype, list[int]]]:
    """(name, dtype, shape) of each tensor ``named_whole_weights`` yields, in its order, read from the
    declarations without gathering or merging anything: what a receiver is told before the tensors follow."""
    specs = []
    for name, value, _ in _whole_entries(base_model(model)):
        shape = getattr(value, "ds_shape", value.shape)  # ZeRO-3 keeps the whole shape beside an empty tensor
        specs.append((name, value.dtype, list(shape)))
    return specs


def base_model(model):
    """The transformers model inside a peft wrapper, or ``model`` itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _whole_entries(base) -> Iterator[tuple[str, Tensor, str | None]]:
    """(transformers' name, the state dict's tensor, the LoRA layer whose adapters add to it or None) for each
    weight of the whole model: a LoRA layer's base weight under the layer's own name, its factors left out."""
    for name, value in base.state_dict(keep_vars=True).items():
        if "lora_" in name:
            continue
        layer_name, lora, kind = name.rpartition(".base_layer.")
        if not lora:
            yield name, value, None
        else:
            yield f"{layer_name}.{kind}", value, layer_name if kind == "weight" else None


def _lora_delta(layer, gather: Callable[[Tensor], Tensor]) -> Tensor | None:
    """The sum of ``layer``'s active adapters' deltas as peft's ``get_delta_weight`` computes each: in the
    factors' dtype (peft keeps them float32 beside a half-precision base by default), half-precision factors
    multiplied in float32; None without an active adapter."""
    delta = None
    for adapter in layer.active_adapters:
        if adapter not in layer.lora_A:
            continue
        a, b = gather(layer.lora_A[adapter].weight), gather(layer.lora_B[adapter].weight)
        term = b.float() @ a.float() if a.dtype in (torch.float16, torch.bfloat16) else b @ a
        term = ((term.T if layer.fan_in_fan_out else term) * layer.scaling[adapter]).to(a.dtype)
        delta = term if delta is None else delta + term
    return delta


def _names(names: list[str], shown: int = 3) -> str:
    more = f", ... ({len(names) - shown} more)" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


__all__ = ["base_model", "check_weight_report", "check_weight_names", "check_float_weights", "named_whole_weights",
           "whole", "whole_weight_specs"]
