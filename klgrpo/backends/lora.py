"""LoRA (peft): the policy is base + adapter, and the reference costs no second copy of the base weights.

    apply_lora(model, cfg)             wrap the policy in a peft LoRA PeftModel (adapter "default", trainable)
    (the reference of a LoRA policy, AdapterDisabledReference, is in klgrpo.core.reference)
    load_adapter_weights(policy, dir)  put a checkpoint's adapter back into the live PeftModel, bitwise
    export_merged(ckpt, out)           merged full weights (merge_and_unload) + tokenizer, for AutoModelForCausalLM
    parameter_bytes(*modules)          bytes of the distinct storages behind parameters and buffers

TRL refuses reference sync with LoRA (its sync copies full weights into a reference model that LoRA does not
have). Here the synced reference is base + reference adapter, so a sync costs one adapter of memory.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

import torch

from klgrpo.backends.hf import gguf_kwargs, pretrained_causal_lm, split_gguf
from klgrpo.errors import ConfigError, first_line

#: Name of the frozen second adapter that holds the synced reference; also its folder in a checkpoint
#: (peft's own save_pretrained writes non-default adapters to <folder>/<name>/, the same place).
REFERENCE_ADAPTER = "reference"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def _peft():
    try:
        import peft
    except ImportError:
        raise ConfigError('model.lora.r > 0 needs peft, which is not installed: pip install "klgrpo[lora]" '
                          "(or set model.lora.r 0 for full fine-tuning)") from None
    return peft


def require_peft_model(model, what: str):
    peft = _peft()
    if not isinstance(model, peft.PeftModel):
        raise ConfigError(f"{what} needs a LoRA policy (a peft PeftModel), got {type(model).__name__}; "
                          f"set model.lora.r > 0 to the rank the checkpoint was trained with")


class LoraSettings(Protocol):
    """What apply_lora reads (model.lora's fields)."""

    r: int
    alpha: float
    dropout: float
    target_modules: list[str]


def apply_lora(model, cfg: LoraSettings):
    """Wrap ``model`` in a peft LoRA PeftModel: base weights frozen, adapter "default" trainable.

    ``adapter_config.json`` records the base model as an absolute path when the base came from a local
    folder, so ``PeftModel.from_pretrained`` and :func:`export_merged` find it from any working directory.
    """
    peft = _peft()
    targets = list(cfg.target_modules)
    peft_cfg = peft.LoraConfig(
        r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, task_type="CAUSAL_LM",
        target_modules="all-linear" if targets == ["all-linear"] else targets)
    try:
        wrapped = peft.get_peft_model(model, peft_cfg)
    except ValueError as exc:
        raise ConfigError(f"model.lora.target_modules={targets}: {first_line(exc, limit=None)}; use module names "
                          f"of this model (e.g. q_proj, v_proj) or ['all-linear']") from None
    base = getattr(model, "name_or_path", "") or ""
    if base and Path(base).is_dir():
        wrapped.peft_config["default"].base_model_name_or_path = str(Path(base).resolve())
    return wrapped


# ------------------------------------------------------------------------------------------- adapters
def adapter_params(model, adapter: str) -> dict[str, torch.nn.Parameter]:
    """The parameters of one adapter, keyed by their name with the adapter name removed."""
    tag = f".{adapter}."
    return {name.replace(tag, "."): p for name, p in model.named_parameters() if tag in name}


def is_up_factor(name: str) -> bool:
    """The B factor of delta = B A (Linear: lora_B; Embedding: lora_embedding_B): scaling it scales delta."""
    return ".lora_B." in name or ".lora_embedding_B." in name


@contextmanager
def keep_requires_grad(model):
    """peft's adapter switching rewrites requires_grad flags; restore every flag as it was."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


def load_adapter_file(model, path: Path, adapter: str) -> None:
    """Copy the tensors of a saved adapter (peft's key format) into ``adapter``'s live parameters, in place."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file

    saved = load_file(str(path))
    expected = get_peft_model_state_dict(model, adapter_name=adapter)
    if saved.keys() != expected.keys() or any(saved[k].shape != expected[k].shape for k in saved):
        raise ConfigError(f"{path} does not match the live LoRA adapter (different model.lora.r, target_modules "
                          f"or base model); resume with the model.lora settings the checkpoint was trained with")
    with keep_requires_grad(model):
        set_peft_model_state_dict(model, saved, adapter_name=adapter)
    loaded = get_peft_model_state_dict(model, adapter_name=adapter)
    for k, v in saved.items():  # in-place copy into the optimizer's own tensors: bitwise, or an error
        if not torch.equal(loaded[k].cpu(), v.to(loaded[k].dtype)):
            raise RuntimeError(f"adapter tensor {k} did not load exactly from {path}")


def check_adapter_file(model, ckpt_dir: Path) -> None:
    """The adapter file of ``ckpt_dir`` holds exactly the tensors of ``model``'s adapter (peft would leave a
    missing one at its initial value without an error)."""
    from peft import get_peft_model_state_dict
    from safetensors import safe_open

    from klgrpo.backends.weights import check_weight_report

    path = Path(ckpt_dir) / ADAPTER_WEIGHTS
    with safe_open(str(path), framework="pt") as f:
        saved = set(f.keys())
    expected = set(get_peft_model_state_dict(model).keys())
    check_weight_report(path, missing=expected - saved, unexpected=saved - expected, total=len(expected),
                        fix="restore the checkpoint folder, or pass an intact checkpoint")


def load_adapter_weights(peft_model, ckpt_dir) -> None:
    """Load the trainable adapter written by ``save_pretrained`` into the live PeftModel, bitwise, in place
    (the optimizer keeps pointing at the same tensors)."""
    require_peft_model(peft_model, "resuming a LoRA checkpoint")
    path = Path(ckpt_dir) / ADAPTER_WEIGHTS
    if not path.exists():
        raise ConfigError(f"{ckpt_dir} has no {ADAPTER_WEIGHTS}: not a LoRA checkpoint; resume it with "
                          f"model.lora.r 0")
    load_adapter_file(peft_model, path, peft_model.active_adapter)


# --------------------------------------------------------------------------------------------- export
def export_merged(checkpoint_dir, out_dir, base_model: str | None = None) -> Path:
    """Merge a checkpoint's adapter into its base (merge_and_unload) and save full weights + tokenizer to
    ``out_dir``, loadable with ``AutoModelForCausalLM.from_pretrained(out_dir)``. The base is ``base_model``
    or the adapter_config.json's ``base_model_name_or_path``; the tokenizer is the checkpoint's if it has one."""
    peft = _peft()
    from transformers import AutoTokenizer

    ckpt, out = Path(checkpoint_dir), Path(out_dir)
    config_file = ckpt / "adapter_config.json"
    if not config_file.exists():
        raise ConfigError(f"{ckpt} has no adapter_config.json: not a LoRA checkpoint (a full checkpoint is "
                          f"already loadable with AutoModelForCausalLM)")
    base = base_model or json.loads(config_file.read_text()).get("base_model_name_or_path")
    if not base:
        raise ConfigError(f"{config_file} does not name its base model; pass base_model= (the folder or hub "
                          f"name the adapter was trained on)")
    folder, gguf_file = split_gguf(base)  # a GGUF base: a .gguf path or package:NAME/FILE
    model = pretrained_causal_lm(folder, gguf_file, f"cannot load the base model {base!r} to merge into",
                                 "; pass base_model=", dtype="auto")
    merged = peft.PeftModel.from_pretrained(model, str(ckpt)).merge_and_unload()
    out.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(out, safe_serialization=True)
    if (ckpt / "tokenizer_config.json").exists():
        AutoTokenizer.from_pretrained(ckpt).save_pretrained(out)
    else:
        try:
            AutoTokenizer.from_pretrained(folder, **gguf_kwargs(folder, gguf_file)).save_pretrained(out)
        except (OSError, ValueError):
            pass  # neither the checkpoint nor the base has a tokenizer: the weights are still complete
    return out


# --------------------------------------------------------------------------------------------- memory
def parameter_bytes(*modules) -> int:
    """Bytes of the distinct storages behind the parameters and buffers of ``modules``: a tensor shared by
    two modules (tied embeddings, the base under a LoRA reference) counts once."""
    storages: dict[int, int] = {}
    for module in modules:
        for t in [*module.parameters(), *module.buffers()]:
            s = t.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())
