"""``python -m klgrpo.apps.lora_memory``: parameter memory of policy + reference, frozen copy vs LoRA."""

from __future__ import annotations

from klgrpo.backends.lora import apply_lora, parameter_bytes
from klgrpo.config.schema import LoraConfig
from klgrpo.core.reference import AdapterDisabledReference, FrozenCopyReference


def reference_memory(build_model, cfg: "LoraConfig") -> dict[str, int]:
    """Parameter + buffer bytes of policy and reference together, for each way of holding the reference.
    ``build_model()`` returns a fresh base model."""
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

    from klgrpo.apps.demo.model import build_tiny_model

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
