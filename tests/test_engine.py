"""Engine in one process (no launcher): torch's own backward, clipping and state dicts; and the one-line errors
for settings a sharded engine cannot honour."""

from __future__ import annotations

import pytest
import torch

from klgrpo.config.schema import GRPOConfig
from klgrpo.errors import ConfigError
from klgrpo.train.engine import Engine, FSDP2Engine, start_engine


def test_one_process_is_plain_torch():
    torch.manual_seed(0)
    model, twin = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    twin.load_state_dict(model.state_dict())
    opt, twin_opt = torch.optim.AdamW(model.parameters(), lr=0.1), torch.optim.AdamW(twin.parameters(), lr=0.1)
    engine = start_engine()  # no launcher: one plain process
    assert type(engine) is Engine
    assert (engine.kind, engine.world_size, engine.shards_parameters) == ("single", 1, False)
    assert engine.prepare(model, opt) == (model, opt)
    x = torch.randn(5, 4)
    engine.backward(model(x).square().sum())
    norm, applied = engine.step(model, opt, max_norm=0.5)
    assert applied
    twin(x).square().sum().backward()
    twin_norm = torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.5)
    twin_opt.step()
    assert norm.item() == twin_norm.item() > 0.5  # the norm before clipping
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    assert engine.full_state_dict(model) is None  # save_pretrained's own state dict
    state = engine.optimizer_state_dict(opt)
    assert state["state"][0]["exp_avg"].shape == model.weight.shape
    with engine.full_weights(model) as m:
        assert m is model


def test_sharded_engine_refuses_compile_and_takes_reference_sync():
    # what `accelerate launch --config_file examples/accelerate/fsdp2.yaml` selects
    engine = FSDP2Engine(accelerator=None)
    engine.check(GRPOConfig.from_dict({"kl": {"sync_every": 10}}))  # checkpointed (tests/test_distributed.py)
    with pytest.raises(ConfigError, match="train.compile with fsdp2"):
        engine.check(GRPOConfig.from_dict({"train": {"compile": True}}))
    engine.check(GRPOConfig.from_dict({}))
