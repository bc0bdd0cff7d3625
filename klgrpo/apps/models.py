"""Loading a model folder (a checkpoint, a merged export, a hub name) for the commands that only run it:
``klgrpo eval`` and ``klgrpo kl``."""

from __future__ import annotations

from pathlib import Path

from klgrpo.errors import ConfigError


def checkpoint_run_config(path: str):
    """The config.yaml of the run that holds the checkpoint folder ``path`` (``<run>/checkpoints/step_N``), or
    None when ``path`` is not inside a run folder."""
    from klgrpo.train.config import GRPOConfig

    folder = Path(path)
    config = folder.parent.parent / "config.yaml"
    if folder.parent.name == "checkpoints" and config.is_file():
        return GRPOConfig.from_yaml(config), config
    return None, None


def load_model_for_inference(path: str, model_cfg, field: str):
    """(model, tokenizer) of ``path`` in ``model.dtype`` on ``model.device``, in eval mode. ``model.gguf_file``
    applies only when ``path`` is ``model.name_or_path`` itself; ``model.tokenizer``, when set, replaces the
    folder's own tokenizer. A LoRA checkpoint (adapter_config.json) loads onto its base model through peft."""
    from transformers.utils import logging as hf_logging

    from klgrpo.backends.hf import load_causal_lm, load_tokenizer, resolve_device, resolve_dtype

    hf_logging.disable_progress_bar()  # a command's output is its table: no weight-loading bars
    device = resolve_device(model_cfg.device)
    dtype = resolve_dtype(model_cfg.dtype, device)
    gguf = model_cfg.gguf_file if path == model_cfg.name_or_path else ""
    if (Path(path) / "adapter_config.json").is_file():
        try:
            from peft import AutoPeftModelForCausalLM
        except ImportError:
            raise ConfigError(f"{path} is a LoRA checkpoint: pip install \"klgrpo[lora]\" to load it, or pass "
                              f"the run's merged/ folder") from None
        model = AutoPeftModelForCausalLM.from_pretrained(path, dtype=dtype).merge_and_unload().to(device)
    else:
        model = load_causal_lm(path, model_cfg, device, dtype, gguf_file=gguf, field=field)
    own_tokenizer = model_cfg.tokenizer or (model_cfg.name_or_path if (Path(path) / "adapter_config.json").is_file()
                                            and not (Path(path) / "tokenizer_config.json").is_file() else "")
    tokenizer = load_tokenizer(own_tokenizer or path, model_cfg.trust_remote_code,
                               gguf_file="" if own_tokenizer else gguf, field=field)
    model.eval()
    return model, tokenizer
