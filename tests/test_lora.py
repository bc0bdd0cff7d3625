"""LoRA: the reference shares every base tensor with the policy, equals the base model exactly, syncs through a
frozen second adapter, survives checkpoint/resume bitwise, and exports merged weights that match the adapter."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("peft")

from klgrpo.apps.lora_memory import reference_memory  # noqa: E402
from klgrpo.backends.lora import (  # noqa: E402
    REFERENCE_ADAPTER,
    adapter_params,
    apply_lora,
    export_merged,
    load_adapter_weights,
    parameter_bytes,
)
from klgrpo.config.schema import GRPOConfig, LoraConfig  # noqa: E402
from klgrpo.core.forward import completion_logprobs  # noqa: E402
from klgrpo.core.reference import AdapterDisabledReference  # noqa: E402
from klgrpo.errors import ConfigError  # noqa: E402
from klgrpo.run.metrics import read_metrics  # noqa: E402
from klgrpo.run.trainer import GRPOTrainer  # noqa: E402
from tests.helpers.configs import make_config as base_config  # noqa: E402
from tests.helpers.configs import quiet

RANK = 4
# The tiny model (hidden 32, intermediate 64, 1 layer, 2 heads of 16, 2 kv heads): "all-linear" adapts
# q,k,v,o (32 -> 32), gate, up (32 -> 64) and down (64 -> 32); lm_head is excluded (tied to the embedding).
# A LoRA pair on in -> out holds r * (in + out) float32 values:
#   4 * r * (32 + 32) + 2 * r * (32 + 64) + r * (64 + 32) = 544 r = 2176 values = 8704 bytes at r = 4.
ADAPTER_BYTES = 4 * 544 * RANK


def make_config(model_dir, data_file, out, **groups) -> GRPOConfig:
    """The trainer tests' run with LoRA at RANK and a larger learning rate for the adapters."""
    model = {"lora": {"r": RANK, "alpha": 8.0}, **groups.pop("model", {})}
    return base_config(model_dir, data_file, out, model=model, **{"optim": {"lr": 5e-2}, **groups})


def load_base(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def logp_of(model, rollout):
    with torch.no_grad():
        return completion_logprobs(model, rollout, 1.0)[0]


def base_storages(model) -> set[int]:
    return {p.untyped_storage().data_ptr() for n, p in model.named_parameters() if "lora_" not in n}


@pytest.fixture(scope="module")
def lora_run(tiny_model_dir, addition_file, tmp_path_factory):
    """One 3-step LoRA run with KL; the trainer stays alive to compare the checkpoint with the live policy."""
    run = tmp_path_factory.mktemp("lora_run")
    trainer = GRPOTrainer(make_config(tiny_model_dir, addition_file, run, train={"steps": 3}), log=quiet)
    trainer.train()
    return trainer, run / "checkpoints" / "step_3"


def test_reference_shares_base_tensors_and_costs_one_adapter(tiny_model_dir, addition_file, tmp_path):
    base_bytes = parameter_bytes(load_base(tiny_model_dir))
    trainer = GRPOTrainer(make_config(tiny_model_dir, addition_file, tmp_path / "r"), log=quiet)
    ref = trainer.reference
    assert isinstance(ref, AdapterDisabledReference)
    with ref.sampling_model() as ref_module:
        assert base_storages(ref_module) == base_storages(trainer.model)
    assert parameter_bytes(trainer.model, ref.model) == base_bytes + ADAPTER_BYTES
    # The contrast that makes the count meaningful: a full fine-tune with its frozen copy holds the base twice.
    full = GRPOTrainer(make_config(tiny_model_dir, addition_file, tmp_path / "f", model={"lora": {"r": 0}}),
                       log=quiet)
    assert not base_storages(full.reference.model) & base_storages(full.model)
    assert parameter_bytes(full.model, full.reference.model) == 2 * base_bytes
    # The function behind docs/lora.md, with the same hand-computed sizes.
    sizes = reference_memory(lambda: load_base(tiny_model_dir), LoraConfig(r=RANK))
    assert sizes == {"base": base_bytes, "full_finetune+frozen_copy": 2 * base_bytes,
                     "lora+frozen_copy": 2 * base_bytes + ADAPTER_BYTES,
                     "lora+adapter_disabled": base_bytes + ADAPTER_BYTES,
                     "lora+adapter_disabled,synced": base_bytes + 2 * ADAPTER_BYTES}


def test_reference_equals_base_model_after_training(tiny_model_dir, addition_file, tmp_path):
    trainer = GRPOTrainer(make_config(tiny_model_dir, addition_file, tmp_path / "r"), log=quiet)
    trainable = {id(p) for p in trainer.model.parameters() if p.requires_grad}
    for _ in range(2):
        trainer.train_step()
    rollout = trainer.make_batch().rollout
    ref_logp = trainer.reference.logprobs(rollout, 1.0, micro_batch_size=4)
    base_logp = logp_of(load_base(tiny_model_dir), rollout)
    mask = rollout.completion_mask
    torch.testing.assert_close(ref_logp[mask], base_logp[mask], rtol=0, atol=1e-6)
    assert (logp_of(trainer.model, rollout) - base_logp)[mask].abs().max() > 1e-3  # the policy did move
    # The reference forward toggled adapters; the trainable set is exactly what the optimizer holds.
    assert {id(p) for p in trainer.model.parameters() if p.requires_grad} == trainable
    assert trainer.model.active_adapter == "default"


def test_sync_copies_then_mixes_the_adapter_only(tiny_model_dir, addition_file, tmp_path):
    trainer = GRPOTrainer(make_config(tiny_model_dir, addition_file, tmp_path / "s"), log=quiet)
    model, ref = trainer.model, trainer.reference
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    trainer.train_step()
    rollout = trainer.make_batch().rollout

    ref.sync(model, 1.0)
    mask = rollout.completion_mask
    torch.testing.assert_close(ref.logprobs(rollout, 1.0)[mask], logp_of(model, rollout)[mask], rtol=0, atol=1e-6)

    trainer.train_step()  # the policy adapter moves away from the reference adapter
    prev = {k: v.detach().clone() for k, v in adapter_params(model, REFERENCE_ADAPTER).items()}
    policy = {k: v.detach().clone() for k, v in adapter_params(model, "default").items()}
    assert any(not torch.equal(prev[k], policy[k]) for k in prev)
    ref.sync(model, 0.5)
    mixed = adapter_params(model, REFERENCE_ADAPTER)
    for k in prev:  # 0.5 * x is exact in binary floating point, so the mix is bitwise: one rounding in the sum
        assert torch.equal(mixed[k], prev[k] * 0.5 + policy[k] * 0.5), k

    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in adapter_params(model, "default").values()}
    assert not any(p.requires_grad for p in mixed.values())
    assert all(p.requires_grad for p in adapter_params(model, "default").values())
    for n, p in model.named_parameters():
        if "lora_" not in n:
            assert torch.equal(p, base_before[n]) and not p.requires_grad, n


def test_first_sync_with_alpha_scales_the_delta_exactly(tiny_model_dir):
    """Before any sync the reference is the base (delta 0); ref <- a * policy + (1 - a) * base gives
    delta_ref = a * delta_policy, which the first sync realises by scaling B alone (delta = B A is bilinear)."""
    model = apply_lora(load_base(tiny_model_dir), LoraConfig(r=RANK))
    with torch.no_grad():
        for p in adapter_params(model, "default").values():
            p.add_(0.1 * torch.randn_like(p))
    ref = AdapterDisabledReference(model)
    ref.sync(model, 0.25)
    pol, rf = adapter_params(model, "default"), adapter_params(model, REFERENCE_ADAPTER)
    pairs = [k.removesuffix("lora_A.weight") for k in pol if k.endswith("lora_A.weight")]
    assert len(pairs) == 7
    for m in pairs:
        want = 0.25 * pol[m + "lora_B.weight"] @ pol[m + "lora_A.weight"]
        torch.testing.assert_close(rf[m + "lora_B.weight"] @ rf[m + "lora_A.weight"], want, rtol=1e-6, atol=1e-7)


def test_checkpoint_adapter_loads_with_peft_and_matches_policy(lora_run, tiny_model_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    trainer, ckpt = lora_run
    assert (ckpt / "adapter_model.safetensors").exists() and not (ckpt / "model.safetensors").exists()
    base_path = json.loads((ckpt / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert base_path == str(tiny_model_dir.resolve())
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_path), ckpt)
    rollout = trainer.make_batch().rollout
    mask = rollout.completion_mask
    expected = logp_of(trainer.model, rollout)
    torch.testing.assert_close(logp_of(loaded, rollout)[mask], expected[mask], rtol=0, atol=1e-6)
    assert (logp_of(load_base(tiny_model_dir), rollout) - expected)[mask].abs().max() > 1e-3


def test_load_adapter_weights_is_bitwise_and_in_place(lora_run, tiny_model_dir):
    from safetensors.torch import load_file

    _, ckpt = lora_run
    model = apply_lora(load_base(tiny_model_dir), LoraConfig(r=RANK))
    params = adapter_params(model, "default")
    ptrs = {k: p.data_ptr() for k, p in params.items()}
    load_adapter_weights(model, ckpt)
    saved = load_file(str(ckpt / "adapter_model.safetensors"))
    assert len(saved) == len(params) == 14
    for k, v in saved.items():  # saved keys: "...q_proj.lora_A.weight", live: "...q_proj.lora_A.default.weight"
        assert torch.equal(params[k], v) and params[k].data_ptr() == ptrs[k], k
    with pytest.raises(ConfigError, match="model.lora"):
        load_adapter_weights(apply_lora(load_base(tiny_model_dir), LoraConfig(r=2)), ckpt)
    with pytest.raises(ConfigError, match="model.lora.r"):
        load_adapter_weights(load_base(tiny_model_dir), ckpt)


def test_export_merged_matches_adapter_logits(lora_run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trainer, ckpt = lora_run
    out = export_merged(ckpt, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    assert AutoTokenizer.from_pretrained(out)("1+2=").input_ids
    rollout = trainer.make_batch().rollout
    kwargs = dict(input_ids=rollout.input_ids, attention_mask=rollout.attention_mask)
    with torch.no_grad():
        want = trainer.model(**kwargs).logits
        got = merged(**kwargs).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def _rows(run):
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "wall_time"))} for r in read_metrics(run)]


@pytest.mark.parametrize("sync_every", [0, 1])
def test_resume_equals_uninterrupted(tiny_model_dir, addition_file, tmp_path, sync_every):
    from safetensors.torch import load_file

    groups = dict(train={"steps": 4},
                  kl={"coef": 0.1, "controller": "adaptive", "target": 0.01, "horizon": 100,
                      "sync_every": sync_every, "sync_alpha": 0.5})
    GRPOTrainer(make_config(tiny_model_dir, addition_file, tmp_path / "a", **groups), log=quiet).train()
    part = make_config(tiny_model_dir, addition_file, tmp_path / "b", **groups).override({"train.steps": 3})
    GRPOTrainer(part, log=quiet).train()
    GRPOTrainer(make_config(tiny_model_dir, addition_file, tmp_path / "b", **groups), log=quiet).train(
        resume="latest")
    rows_a, rows_b = _rows(tmp_path / "a"), _rows(tmp_path / "b")
    assert rows_a == rows_b and rows_a[-1]["kl/k3"] > 0
    files = ["adapter_model.safetensors"] + ([f"{REFERENCE_ADAPTER}/adapter_model.safetensors"] if sync_every else [])
    assert (tmp_path / "a/checkpoints/step_4" / REFERENCE_ADAPTER).exists() == bool(sync_every)
    for name in files:
        a = load_file(str(tmp_path / "a/checkpoints/step_4" / name))
        b = load_file(str(tmp_path / "b/checkpoints/step_4" / name))
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), (name, k)


def test_missing_peft_is_a_config_error(tiny_model_dir, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "peft", None)  # import peft now raises ImportError
    with pytest.raises(ConfigError, match=r'pip install "klgrpo\[lora\]"'):
        apply_lora(load_base(tiny_model_dir), LoraConfig(r=RANK))
