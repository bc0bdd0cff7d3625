"""Loading a model folder (a checkpoint, a merged export, a hub name) for the commands that only run it:
``klgrpo eval`` and ``klgrpo kl``."""

from __future__ import annotations

from pathlib import Path

from klgrpo.errors import ConfigError


def checkpoint_run_config(path: str):
    """The config.yaml of the run that holds the checkpoint folder ``path`` (``<run>/checkpoints/step_N``), or
    None when ``path`` is not inside a run folder or the run's config.yaml is missing or empty."""
    from klgrpo.config.schema import GRPOConfig
    from klgrpo.store.run_folder import run_config_file

    folder = Path(path)
    config = run_config_file(folder.parent.parent) if folder.parent.name == "checkpoints" else None
    if config is not None:
        return GRPOConfig.from_yaml(config), config
    return None, None


def verify_checkpoint(path: Path, field: str = "CHECKPOINT") -> None:
    """A klgrpo checkpoint folder's weights files match the sha256 saved with them (a ConfigError line naming
    the file otherwise); any other folder passes (it has no checksums)."""
    from klgrpo.store.checkpoint import check_checkpoint

    check_checkpoint(path, field)


def load_model_for_inference(path: str, model_cfg, field: str):
    """(model, tokenizer) of ``path`` in ``model.dtype`` on ``model.device``, in eval mode. ``model.gguf_file``
    applies only when ``path`` is ``model.name_or_path`` itself; ``model.tokenizer``, when set, replaces the
    folder's own tokenizer. A LoRA checkpoint (adapter_config.json) loads onto its base model through peft.
    Weights that lack one of the model's tensors, hold others, or (in a checkpoint) no longer match their
    checksum are refused: a missing tensor would be initialised at random and scored without a word."""
    from transformers.utils import logging as hf_logging

    from klgrpo.backends.hf import load_causal_lm, load_tokenizer, resolve_device, resolve_dtype

    hf_logging.disable_progress_bar()  # a command's output is its table: no weight-loading bars
    device = resolve_device(model_cfg.device)
    dtype = resolve_dtype(model_cfg.dtype, device)
    gguf = model_cfg.gguf_file if path == model_cfg.name_or_path else ""
    verify_checkpoint(Path(path), field)
    if (Path(path) / "adapter_config.json").is_file():
        model = _load_lora_merged(Path(path), dtype).to(device)
    else:
        model = load_causal_lm(path, model_cfg, device, dtype, gguf_file=gguf, field=field, strict=True)
    own_tokenizer = model_cfg.tokenizer or (model_cfg.name_or_path if (Path(path) / "adapter_config.json").is_file()
                                            and not (Path(path) / "tokenizer_config.json").is_file() else "")
    tokenizer = load_tokenizer(own_tokenizer or path, model_cfg.trust_remote_code,
                               gguf_file="" if own_tokenizer else gguf, field=field)
    model.eval()
    return model, tokenizer


def _load_lora_merged(path: Path, dtype):
    """A LoRA checkpoint on its base model, merged; its adapter file must hold exactly the adapter's tensors."""
    try:
        from peft import AutoPeftModelForCausalLM
    except ImportError:
        raise ConfigError(f"{path} is a LoRA checkpoint: pip install \"klgrpo[lora]\" to load it, or pass "
                          f"the run's merged/ folder") from None
    from klgrpo.backends.lora import check_adapter_file

    model = AutoPeftModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    check_adapter_file(model, path)
    return model.merge_and_unload()
