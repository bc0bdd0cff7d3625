"""LoRA (peft): the policy is base + adapter, and the reference costs no second copy of the base weights.

    apply_lora(model, cfg)             wrap the policy in a peft LoRA PeftModel (adapter "default", trainable)
    AdapterDisabledReference(policy)   reference log-probs of the base model: the policy inside peft's
                                       disable_adapter(); after kl.sync_every syncs, base + a frozen second
                                       adapter "reference" (a copy of the adapter, never of the base)
    load_adapter_weights(policy, dir)  put a checkpoint's adapter back into the live PeftModel, bitwise
    export_merged(ckpt, out)           merged full weights (merge_and_unload) + tokenizer, for AutoModelForCausalLM
    parameter_bytes(*modules)          bytes of the distinct storages behind parameters and buffers

TRL refuses reference sync with LoRA (its sync copies full weights into a reference model that LoRA does not
have). Here the synced reference is base + reference adapter, so a sync costs one adapter of memory.
"""

from __future__ import annotations

import copy
import json
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from klgrpo.errors import ConfigError
from klgrpo.models import completion_logprobs, position_ids_from_mask

if TYPE_CHECKING:
    from klgrpo.config import LoraConfig
    from klgrpo.rollout import RolloutBatch

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


def _require_peft_model(model, what: str):
    peft = _peft()
    if not isinstance(model, peft.PeftModel):
        raise ConfigError(f"{what} needs a LoRA policy (a peft PeftModel), got {type(model).__name__}; "
                          f"set model.lora.r > 0 to the rank the checkpoint was trained with")


def apply_lora(model, cfg: "LoraConfig"):
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
        raise ConfigError(f"model.lora.target_modules={targets}: {str(exc).splitlines()[0]}; use module names "
                          f"of this model (e.g. q_proj, v_proj) or ['all-linear']") from None
    base = getattr(model, "name_or_path", "") or ""
    if base and Path(base).is_dir():
        wrapped.peft_config["default"].base_model_name_or_path = str(Path(base).resolve())
    return wrapped


# ------------------------------------------------------------------------------------------- adapters
def _adapter_params(model, adapter: str) -> dict[str, torch.nn.Parameter]:
    """The parameters of one adapter, keyed by their name with the adapter name removed."""
    tag = f".{adapter}."
    return {name.replace(tag, "."): p for name, p in model.named_parameters() if tag in name}


def _is_up_factor(name: str) -> bool:
    """The B factor of delta = B A (Linear: lora_B; Embedding: lora_embedding_B): scaling it scales delta."""
    return ".lora_B." in name or ".lora_embedding_B." in name


@contextmanager
def _keep_requires_grad(model):
    """peft's adapter switching rewrites requires_grad flags; restore every flag as it was."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


def _load_adapter_file(model, path: Path, adapter: str) -> None:
    """Copy the tensors of a saved adapter (peft's key format) into ``adapter``'s live parameters, in place."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file

    saved = load_file(str(path))
    expected = get_peft_model_state_dict(model, adapter_name=adapter)
    if saved.keys() != expected.keys() or any(saved[k].shape != expected[k].shape for k in saved):
        raise ConfigError(f"{path} does not match the live LoRA adapter (different model.lora.r, target_modules "
                          f"or base model); resume with the model.lora settings the checkpoint was trained with")
    with _keep_requires_grad(model):
        set_peft_model_state_dict(model, saved, adapter_name=adapter)
    loaded = get_peft_model_state_dict(model, adapter_name=adapter)
    for k, v in saved.items():  # in-place copy into the optimizer's own tensors: bitwise, or an error
        if not torch.equal(loaded[k].cpu(), v.to(loaded[k].dtype)):
            raise RuntimeError(f"adapter tensor {k} did not load exactly from {path}")


def load_adapter_weights(peft_model, ckpt_dir) -> None:
    """Load the trainable adapter written by ``save_pretrained`` into the live PeftModel, bitwise, in place
    (the optimizer keeps pointing at the same tensors)."""
    _require_peft_model(peft_model, "resuming a LoRA checkpoint")
    path = Path(ckpt_dir) / ADAPTER_WEIGHTS
    if not path.exists():
        raise ConfigError(f"{ckpt_dir} has no {ADAPTER_WEIGHTS}: not a LoRA checkpoint; resume it with "
                          f"model.lora.r 0")
    _load_adapter_file(peft_model, path, peft_model.active_adapter)


# ------------------------------------------------------------------------------------------ reference
class AdapterDisabledReference:
    """The reference of a LoRA policy, sharing every base tensor with it.

    Before any sync the reference is the base model: the policy's forward inside ``disable_adapter()``
    (exactly the base, since the initial adapter is a zero delta). ``sync`` creates a frozen adapter
    ``"reference"`` beside the trainable one; from then on the reference forward switches to it and back.
    """

    def __init__(self, model):
        _require_peft_model(model, "AdapterDisabledReference")
        self.model = model
        self.policy_adapter = model.active_adapter
        self.synced = False  # once synced, the reference adapter exists and goes into checkpoints

    @contextmanager
    def sampling_model(self):
        """The policy module switched to the reference (for the duration of the block); yields the model."""
        with _keep_requires_grad(self.model):
            if not self.synced:
                with self.model.disable_adapter():
                    yield self.model
                return
            self.model.set_adapter(REFERENCE_ADAPTER, inference_mode=True)
            try:
                yield self.model
            finally:
                self.model.set_adapter(self.policy_adapter)

    @torch.no_grad()
    def logprobs(self, batch: "RolloutBatch", temperature: float, micro_batch_size: int = 0) -> Tensor:
        size = micro_batch_size or batch.size
        with self.sampling_model() as model:
            parts = [completion_logprobs(model, batch, temperature, rows=slice(s, min(s + size, batch.size)))[0]
                     for s in range(0, batch.size, size)]
        return torch.cat(parts, dim=0)

    @torch.no_grad()
    def logits(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        with self.sampling_model() as model:
            return model(input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=position_ids_from_mask(attention_mask), use_cache=False).logits

    def _ensure_reference_adapter(self) -> None:
        if REFERENCE_ADAPTER in self.model.peft_config:
            return
        cfg = copy.deepcopy(self.model.peft_config[self.policy_adapter])
        cfg.lora_dropout = 0.0  # the reference forward is deterministic
        cfg.inference_mode = True
        devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
        # The new adapter's random init would draw from the global RNG and shift sampling after a sync;
        # its values are overwritten right away, so draw from a forked RNG.
        with _keep_requires_grad(self.model), torch.random.fork_rng(devices=devices):
            self.model.add_adapter(REFERENCE_ADAPTER, cfg)
        for p in _adapter_params(self.model, REFERENCE_ADAPTER).values():
            p.requires_grad_(False)

    @torch.no_grad()
    def sync(self, policy, alpha: float = 1.0) -> None:
        """reference <- alpha * policy + (1 - alpha) * reference, on the adapter only.

        First sync (reference = base, delta_ref = 0): the reference adapter becomes the policy adapter with
        its B factors scaled by alpha, so delta_ref = B_ref A_ref = alpha * B A exactly, which is what mixing
        full weights would give. Later syncs mix A and B parameter-wise (A_ref <- alpha A + (1 - alpha) A_ref,
        same for B); delta = B A is bilinear, so this is the usual adapter-space EMA, exact at alpha = 1.
        """
        if policy is not self.model:
            raise ValueError("AdapterDisabledReference.sync: the policy must be the PeftModel it was built on")
        first = not self.synced
        self._ensure_reference_adapter()
        src = _adapter_params(self.model, self.policy_adapter)
        dst = _adapter_params(self.model, REFERENCE_ADAPTER)
        if src.keys() != dst.keys():
            raise RuntimeError("the reference adapter does not mirror the policy adapter")
        for name, p in src.items():
            q, value = dst[name], p.detach().to(dst[name].dtype)
            if first:
                q.copy_(value)
                if _is_up_factor(name) and alpha != 1.0:
                    q.mul_(alpha)
            else:
                q.mul_(1.0 - alpha).add_(value, alpha=alpha)
        self.synced = True

    def save(self, folder: Path) -> None:
        """Once synced: <folder>/reference/ holds the reference adapter in peft's format."""
        if not self.synced:
            return
        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file

        out = Path(folder) / REFERENCE_ADAPTER
        out.mkdir(parents=True, exist_ok=True)
        state = get_peft_model_state_dict(self.model, adapter_name=REFERENCE_ADAPTER)
        save_file({k: v.detach().contiguous() for k, v in state.items()}, str(out / ADAPTER_WEIGHTS),
                  metadata={"format": "pt"})
        self.model.peft_config[REFERENCE_ADAPTER].save_pretrained(str(out))

    def load(self, folder: Path) -> None:
        path = Path(folder) / REFERENCE_ADAPTER / ADAPTER_WEIGHTS
        if not path.exists():
            return
        self._ensure_reference_adapter()
        _load_adapter_file(self.model, path, REFERENCE_ADAPTER)
        for p in _adapter_params(self.model, REFERENCE_ADAPTER).values():
            p.requires_grad_(False)
        self.synced = True


# --------------------------------------------------------------------------------------------- export
def export_merged(checkpoint_dir, out_dir, base_model: str | None = None) -> Path:
    """Merge a checkpoint's adapter into its base (merge_and_unload) and save full weights + tokenizer to
    ``out_dir``, loadable with ``AutoModelForCausalLM.from_pretrained(out_dir)``. The base is ``base_model``
    or the adapter_config.json's ``base_model_name_or_path``; the tokenizer is the checkpoint's if it has one."""
    peft = _peft()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt, out = Path(checkpoint_dir), Path(out_dir)
    config_file = ckpt / "adapter_config.json"
    if not config_file.exists():
        raise ConfigError(f"{ckpt} has no adapter_config.json: not a LoRA checkpoint (a full checkpoint is "
                          f"already loadable with AutoModelForCausalLM)")
    base = base_model or json.loads(config_file.read_text()).get("base_model_name_or_path")
    if not base:
        raise ConfigError(f"{config_file} does not name its base model; pass base_model= (the folder or hub "
                          f"name the adapter was trained on)")
    try:
        model = AutoModelForCausalLM.from_pretrained(base, dtype="auto")
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load the base model {base!r} to merge into: {str(exc).splitlines()[0]}; "
                          f"pass base_model=") from None
    merged = peft.PeftModel.from_pretrained(model, str(ckpt)).merge_and_unload()
    out.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(out, safe_serialization=True)
    if (ckpt / "tokenizer_config.json").exists():
        AutoTokenizer.from_pretrained(ckpt).save_pretrained(out)
    else:
        try:
            AutoTokenizer.from_pretrained(base).save_pretrained(out)
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


def reference_memory(build_model, cfg: "LoraConfig") -> dict[str, int]:
    """Parameter + buffer bytes of policy and reference together, for each way of holding the reference.
    ``build_model()`` returns a fresh base model."""
    from klgrpo.reference import FrozenCopyReference

    full = build_model()
    full_ref = FrozenCopyReference.copy_of(full)
    lora = apply_lora(build_model(), cfg)
    lora_copy_ref = FrozenCopyReference(build_model())  # what kl.reference = <the base folder> builds
    disabled = AdapterDisabledReference(lora)
    result = {
        "base": parameter_bytes(full),
        "full_finetune+frozen_copy": parameter_bytes(full, full_ref.model),
        "lora+frozen_copy": parameter_bytes(lora, lora_copy_ref.model),
        "lora+adapter_disabled": parameter_bytes(lora, disabled.model),
    }
    disabled.sync(lora, 1.0)
    result["lora+adapter_disabled,synced"] = parameter_bytes(lora, disabled.model)
    return result


def _main(argv=None) -> None:
    import argparse

    from klgrpo.config import LoraConfig
    from klgrpo.demo.model import build_tiny_model

    ap = argparse.ArgumentParser(description="policy + reference parameter memory, frozen copy vs LoRA")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=0, help="0: 4 x hidden")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--r", type=int, default=16)
    a = ap.parse_args(argv)
    sizes = dict(hidden=a.hidden, layers=a.layers, heads=a.heads, intermediate=a.intermediate or 4 * a.hidden)
    result = reference_memory(lambda: build_tiny_model(a.vocab, 0, **sizes), LoraConfig(r=a.r))
    for name, n in result.items():
        print(f"{name:32s} {n:>14,d} bytes  {n / 2**20:9.2f} MiB  {n / result['base']:.3f} x base")


if __name__ == "__main__":
    _main()
