"""A model's weights checked against the model they load into: every weight present, nothing else, each of the
model's shape and a floating-point type. A load that initialises a missing weight at random scores a random
model without a word, so every load of a trained model (resume, eval, kl, export) refuses it in one line."""

from __future__ import annotations

from pathlib import Path

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


def _names(names: list[str], shown: int = 3) -> str:
    more = f", ... ({len(names) - shown} more)" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


__all__ = ["check_weight_report", "check_weight_names", "check_float_weights"]
