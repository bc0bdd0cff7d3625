"""The weights a sampler with its own copy of the model (vLLM) receives: ``named_whole_weights`` yields the
policy tensor by tensor as transformers names it, a LoRA policy merged exactly as peft merges it, and leaves the
training model untouched."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from klgrpo.backends.weights import named_whole_weights, whole_weight_specs

peft = pytest.importorskip("peft")


def lora_model(model_dir, dtype=torch.float32, fan_in_fan_out=False, float32_adapter=True):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM",
                          fan_in_fan_out=fan_in_fan_out)
    wrapped = peft.get_peft_model(model, cfg, autocast_adapter_dtype=float32_adapter)
    torch.manual_seed(3)
    for name, p in wrapped.named_parameters():
        if "lora_B" in name:  # B starts at zero: give the adapter a delta to merge
            p.data.normal_(0, 0.5)
    return wrapped


def test_a_plain_model_is_its_state_dict(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    whole = dict(named_whole_weights(model))
    expected = model.state_dict()
    assert list(whole) == list(expected)
    assert all(torch.equal(whole[k], expected[k]) for k in expected)


@pytest.mark.parametrize("dtype,float32_adapter", [(torch.float32, True), (torch.bfloat16, True),
                                                   (torch.bfloat16, False)])
def test_a_lora_policy_comes_merged_as_peft_merges_it_and_stays_untouched(tiny_model_dir, dtype, float32_adapter):
    """bfloat16: peft keeps the adapter in float32 by default (the delta is added in float32, then rounded) or,
    asked not to, in bfloat16 (multiplied in float32, rounded, then added)."""
    model = lora_model(tiny_model_dir, dtype, float32_adapter=float32_adapter)
    assert next(p for k, p in model.named_parameters() if "lora_A" in k).dtype == (
        torch.float32 if float32_adapter else dtype)
    before = {k: (v.detach().clone(), v._version) for k, v in model.named_parameters()}
    whole = dict(named_whole_weights(model))
    merged = copy.deepcopy(model).merge_and_unload().state_dict()  # peft's own merge
    assert list(whole) == list(merged)
    assert not any("lora_" in k or "base_layer" in k for k in whole)
    for name, value in merged.items():
        assert whole[name].dtype == value.dtype and torch.equal(whole[name], value), name
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype).state_dict()
    q = next(k for k in whole if k.endswith("q_proj.weight"))
    assert not torch.equal(whole[q], base[q])  # the delta is in (B is not zero)
    for name, p in model.named_parameters():  # nothing merged into the model, not even and back
        assert torch.equal(p, before[name][0]) and p._version == before[name][1], name


def test_fan_in_fan_out_layers_are_transposed_as_peft_does(tiny_model_dir):
    """peft's ``fan_in_fan_out`` (GPT-2's Conv1D layout) stores the weight transposed; the delta follows."""
    model = lora_model(tiny_model_dir)
    q = next(k for k, _ in model.named_parameters() if "q_proj.lora_A" in k).split(".lora_A")[0]
    layer = model.get_submodule(q)
    layer.fan_in_fan_out = True  # a square projection: the transposed delta has the weight's shape
    expected = layer.base_layer.weight + layer.get_delta_weight("default")
    whole = dict(named_whole_weights(model))
    name = q.removeprefix("base_model.model.") + ".weight"
    assert torch.equal(whole[name], expected)
    assert not torch.equal(whole[name], layer.base_layer.weight + (layer.lora_B["default"].weight
                                                                   @ layer.lora_A["default"].weight) * 2.0)


def test_each_tensor_is_gathered_once_as_it_is_reached(tiny_model_dir):
    """``gather`` sees every parameter (the adapters' factors included) one at a time, in order, so a sharded
    policy is never gathered whole: the first tensor is yielded before the second is gathered."""
    model = lora_model(tiny_model_dir)
    gathered = []

    def gather(value):
        gathered.append(value)
        return value.detach()

    weights = named_whole_weights(model, gather)
    next(weights)
    assert len(gathered) == 1
    rest = list(weights)
    state = model.get_base_model().state_dict(keep_vars=True)
    assert len(gathered) == len(state) and len(rest) + 1 == len([k for k in state if "lora_" not in k])


@pytest.mark.parametrize("lora", [False, True])
def test_the_announced_specs_are_what_follows(tiny_model_dir, lora):
    """``whole_weight_specs`` (told to a receiver before the tensors) names each tensor ``named_whole_weights``
    then yields, in its order, with its dtype and shape, and gathers nothing."""
    model = lora_model(tiny_model_dir, torch.bfloat16) if lora else AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.bfloat16)
    specs = whole_weight_specs(model)
    assert specs == [(name, value.dtype, list(value.shape)) for name, value in named_whole_weights(model)]
    assert not any("lora_" in name or "base_layer" in name for name, _, _ in specs)
