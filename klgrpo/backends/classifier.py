"""A sequence classifier (a reward model) and its own tokenizer: the config checked without loading the weights,
their size counted on the meta device, the weights loaded frozen in a dtype on a device."""

from __future__ import annotations

import torch

from klgrpo.backends.hf import check_local_model_path, hub_access, unreadable_weights
from klgrpo.errors import ConfigError, first_line

#: What a sequence classifier's architecture name ends with (AutoModelForSequenceClassification's classes).
CLASSIFIER_SUFFIX = "ForSequenceClassification"


def load_classifier_config(name_or_path: str, field: str, trust_remote_code: bool = False):
    """The transformers config of the sequence classifier at ``name_or_path``; one ConfigError line, naming
    ``field``, for a folder without a config or one whose architectures are not a sequence classifier (transformers
    would load such a model with a randomly initialised head and only warn)."""
    check_local_model_path(name_or_path, field)
    access = hub_access(name_or_path, field)
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code, **access)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load a reward model from {name_or_path!r} ({field}): "
                          f"{first_line(exc, limit=None)}") from None
    architectures = list(getattr(config, "architectures", None) or [])
    if not any(str(a).endswith(CLASSIFIER_SUFFIX) for a in architectures):
        named = ", ".join(architectures) or "none"
        raise ConfigError(f"{name_or_path!r} ({field}) is not a sequence classifier: its config.json names the "
                          f"architectures {named}; a reward model is a *{CLASSIFIER_SUFFIX} checkpoint (loadable "
                          f"with AutoModelForSequenceClassification)")
    return config


def classifier_weight_bytes(config, dtype: torch.dtype, trust_remote_code: bool = False) -> int:
    """Bytes of the classifier's parameters in ``dtype``, counted on the meta device (nothing is allocated)."""
    from transformers import AutoModelForSequenceClassification

    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(config, trust_remote_code=trust_remote_code)
    return sum(p.numel() for p in model.parameters()) * dtype.itemsize


def load_classifier(name_or_path: str, device: torch.device, dtype: torch.dtype, field: str,
                    trust_remote_code: bool = False):
    """The sequence classifier in ``dtype`` on ``device``, in eval mode with no gradients; refused in one line when
    its weights lack part of the model (the head would be random)."""
    from transformers import AutoModelForSequenceClassification

    access = hub_access(name_or_path, field)
    try:
        model, info = AutoModelForSequenceClassification.from_pretrained(
            name_or_path, dtype=dtype, trust_remote_code=trust_remote_code, output_loading_info=True, **access)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load a reward model from {name_or_path!r} ({field}): "
                          f"{first_line(exc, limit=None)}") from None
    except Exception as exc:  # truncated or random bytes, a pickle: safetensors' and torch's own error types
        raise unreadable_weights(exc, f"cannot load a reward model from {name_or_path!r} ({field})") from None
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        raise ConfigError(f"reward model {name_or_path!r} ({field}): its weights lack {', '.join(missing[:3])}"
                          f"{' ...' if len(missing) > 3 else ''}, which would start random; give a trained "
                          f"sequence-classification checkpoint")
    model.to(device).eval()
    model.requires_grad_(False)
    return model


def load_classifier_tokenizer(name_or_path: str, field: str, trust_remote_code: bool = False):
    """The classifier's own tokenizer, padding on the right (the positions of the real tokens stay those of an
    unpadded forward, so a score does not depend on the batch it is in)."""
    from transformers import AutoTokenizer

    access = hub_access(name_or_path, field, ("tokenizer_config.json", "tokenizer.json", "config.json"))
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code, **access)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load the tokenizer of the reward model {name_or_path!r} ({field}): "
                          f"{first_line(exc, limit=None)}") from None
    tokenizer.padding_side = "right"
    return tokenizer
