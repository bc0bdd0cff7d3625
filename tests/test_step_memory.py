"""The pre-flight memory check: a step whose rollout or update cannot fit is refused in one line before the first
rollout (klgrpo/config/validation.py: estimate_step_memory, check_step_memory)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from klgrpo.config.schema import GRPOConfig
from klgrpo.errors import ConfigError
from klgrpo.train.step_memory import available_memory_bytes, check_step_memory, estimate_step_memory

GIB = 2 ** 30


def _longest(tokenizer, prompts, cfg) -> int:
    from klgrpo.core.rollout import longest_prompt_tokens

    return longest_prompt_tokens(tokenizer, prompts, cfg.data.system_prompt, cfg.data.as_chat)


def _cfg(prompts=2, group=4, new_tokens=3, micro=0) -> GRPOConfig:
    return GRPOConfig.from_dict({"rollout": {"prompts_per_step": prompts, "group_size": group,
                                             "max_new_tokens": new_tokens},
                                 "train": {"micro_batch_size": micro}})


TINY = SimpleNamespace(num_hidden_layers=2, hidden_size=8, num_attention_heads=2, num_key_value_heads=1,
                       vocab_size=10)


@pytest.mark.parametrize("micro, world, expected", [
    # 2 x 4 = 8 sequences of 5 + 3 = 8 positions, float32 (4 bytes); head_dim 8 / 2 = 4, one key/value head.
    # rollout: 8 seq x 8 pos x 2 layers x (keys + values) 2 x 4 x 4 bytes = 4096
    # update:  8 seq x (2 x 3 completion positions x 10 vocab + 8 pos x 2 layers x (8 hidden + 2 x 4 keys/values
    #          + 2 x 0 intermediate)) x 4 = 8 x (60 + 256) x 4 = 10112
    (0, 1, (4096, 10112)),
    # micro-batches of 2 split the update (2 x 316 x 4 = 2528), not the rollout (4096)
    (2, 1, (4096, 2528)),
    # two processes: 4 sequences each; rollout 2048, update of 2 = 2528
    (2, 2, (2048, 2528)),
])
def test_estimate_is_the_hand_derived_count(micro, world, expected):
    assert estimate_step_memory(_cfg(micro=micro), TINY, 4, longest_prompt=5, world_size=world) == expected


def test_estimate_reads_head_dim_when_the_config_gives_it():
    # head_dim 16 (not 8 / 2): rollout 8 x 8 x 2 x 2 x 16 x 2 bytes = 8192;
    # update 8 x (60 + 8 x 2 x (8 + 2 x 16)) x 2 = 8 x 700 x 2 = 11200
    config = SimpleNamespace(**vars(TINY), head_dim=16)
    assert estimate_step_memory(_cfg(), config, 2, longest_prompt=5) == (8192, 11200)


def test_a_135m_model_with_8x8x256_fits_24_gb():
    """SmolLM2-135M's sizes (config.json) in bfloat16, 8 prompts x 8 completions of 256 tokens after a prompt of
    400 tokens (longer than GSM8K's): rollout 64 x 656 x 30 x 2 x 192 x 2 = 0.90 GiB; update 64 x (2 x 256 x 49152
    + 656 x 30 x (576 + 2 x 192 + 2 x 1536)) x 2 = 64 x 104515584 x 2 = 12.46 GiB."""
    smollm2 = SimpleNamespace(num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                              head_dim=64, vocab_size=49152, intermediate_size=1536)
    rollout, update = estimate_step_memory(_cfg(prompts=8, group=8, new_tokens=256), smollm2, 2, longest_prompt=400)
    assert (rollout, update) == (64 * 656 * 30 * 2 * 192 * 2, 64 * 104515584 * 2)
    assert max(rollout, update) < 24 * 10 ** 9


@pytest.fixture(scope="module")
def demo_pieces(tmp_path_factory):
    """The demo's model sizes, tokenizer, training prompts and config (random weights: the check reads sizes)."""
    from dataclasses import asdict

    from klgrpo.apps.demo.assets import DEFAULT_SETTINGS, planned_demo_assets
    from klgrpo.apps.demo.model import build_tiny_model_for
    from klgrpo.apps.demo.tasks import make_splits
    from klgrpo.apps.demo.tokenizer import build_char_tokenizer
    from klgrpo.apps.demo_run import demo_config

    tokenizer = build_char_tokenizer()
    model = build_tiny_model_for(tokenizer, 0, **asdict(DEFAULT_SETTINGS.model))
    prompts = make_splits("addition").train.prompts
    cfg = demo_config(planned_demo_assets(0, cache_dir=tmp_path_factory.mktemp("cache")))
    return cfg, model, tokenizer, prompts


def test_the_demo_passes_on_this_machine(demo_pieces):
    cfg, model, tokenizer, prompts = demo_pieces
    check_step_memory(cfg, model, _longest(tokenizer, prompts, cfg))  # the machine's own free memory
    # and a 64 MiB budget
    check_step_memory(cfg, model, _longest(tokenizer, prompts, cfg), available_bytes=64 * 2 ** 20)


def test_a_demo_rollout_far_beyond_memory_is_refused_in_one_line(demo_pieces):
    """--rollout.group_size 100000: 3.2 million sequences; their key/value cache alone is 30.5 GiB (6 + 4
    positions x 2 layers x keys and values x 64 wide x 4 bytes = 10240 bytes a sequence). Micro-batches do not
    help, and the line says so."""
    cfg, model, tokenizer, prompts = demo_pieces
    cfg.rollout.group_size = 100000
    cfg.train.micro_batch_size = 8
    with pytest.raises(ConfigError) as refused:
        check_step_memory(cfg, model, _longest(tokenizer, prompts, cfg), available_bytes=16 * GIB)
    message = str(refused.value)
    assert "\n" not in message
    for part in (f"the rollout needs at least {32 * 100000 * 10240 / GIB:.2f} GiB but 16.00 GiB are free",
                 "rollout.prompts_per_step=32", "rollout.group_size=100000", "rollout.max_new_tokens=4",
                 "train.micro_batch_size splits only the update"):
        assert part in message


def test_an_update_beyond_memory_points_at_micro_batches(tiny_model_dir):
    from transformers import AutoTokenizer

    from klgrpo.apps.demo.model import build_tiny_model

    model = build_tiny_model(1000, 0, hidden=32, layers=1, heads=2, intermediate=64)  # a vocabulary of 1000
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    # 64 sequences of 6 + 3 = 9 positions; one layer of 32, two heads of 16, float32:
    # rollout 64 x 9 x 1 x 2 x 32 x 4 = 147456;
    # update 64 x (2 x 3 x 1000 + 9 x 1 x (32 + 2 x 32 + 2 x 64)) x 4 = 64 x 8016 x 4 = 2052096
    cfg, prompts = _cfg(prompts=8, group=8), ["12+34=", "1+2="]
    with pytest.raises(ConfigError, match="the update needs at least .*; set train.micro_batch_size"):
        check_step_memory(cfg, model, _longest(tokenizer, prompts, cfg), available_bytes=2052095)
    check_step_memory(cfg, model, _longest(tokenizer, prompts, cfg), available_bytes=2052096)
    cfg.train.micro_batch_size = 8  # an eighth of the update: 256512
    check_step_memory(cfg, model, _longest(tokenizer, prompts, cfg), available_bytes=256512)
    with pytest.raises(ConfigError, match="the rollout needs at least"):
        check_step_memory(cfg, model, _longest(tokenizer, prompts, cfg), available_bytes=147455)


def test_a_tiny_budget_refuses_what_a_larger_one_accepts(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg, prompts = _cfg(), ["12+34=", "1+2="]
    # 6 tokens of "12+34=" (a character each) + 3 = 9 positions; one layer of 32, two heads of 16, float32;
    # rollout 8 x 9 x 1 x 2 x 32 x 4 = 18432; update 8 x (2 x 3 x vocab + 9 x (32 + 2 x 32 + 2 x 64)) x 4
    need = max(18432, 8 * (6 * model.config.vocab_size + 9 * 224) * 4)  # the larger phase
    check_step_memory(cfg, model, _longest(tokenizer, prompts, cfg), available_bytes=need)
    with pytest.raises(ConfigError, match="rollout.group_size=4"):
        check_step_memory(cfg, model, _longest(tokenizer, prompts, cfg), available_bytes=need - 1)


def test_free_memory_is_known_on_the_cpu():
    import torch

    free = available_memory_bytes(torch.device("cpu"))
    assert free is not None and free > 0
    assert available_memory_bytes(torch.device("meta")) is None


def test_the_trainer_refuses_a_step_beyond_memory_before_writing_anything(tiny_model_dir, addition_file, tmp_path,
                                                                         monkeypatch):
    from klgrpo.run.trainer import GRPOTrainer
    from tests.helpers.configs import make_config

    # The trainer asks the machine how much is free; here the machine has 1 KiB.
    monkeypatch.setattr("klgrpo.train.step_memory.available_memory_bytes", lambda device: 1024)
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match="the rollout needs at least .* rollout.group_size=4"):
        GRPOTrainer(make_config(tiny_model_dir, addition_file, out), log=lambda m: None)
    assert not out.exists()


def test_the_address_space_limit_counts(tmp_path, monkeypatch):
    """``ulimit -v``: what RLIMIT_AS leaves beside the process's virtual size bounds the free memory."""
    import resource

    import torch

    from klgrpo.train.step_memory import address_space_left

    status = tmp_path / "status"
    status.write_text("Name:\tpython\nVmPeak:\t 9000000 kB\nVmSize:\t 1048576 kB\n")
    monkeypatch.setattr(resource, "getrlimit", lambda which: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    assert address_space_left(str(status)) is None  # no limit set
    monkeypatch.setattr(resource, "getrlimit", lambda which: (3 * 2 ** 30, resource.RLIM_INFINITY))
    assert address_space_left(str(status)) == 2 * 2 ** 30  # 3 GiB limit - 1 GiB already mapped
    assert available_memory_bytes(torch.device("cpu")) <= 3 * 2 ** 30


def test_the_cgroup_memory_limit_counts(tmp_path):
    from klgrpo.train.step_memory import cgroup_memory_left

    own = tmp_path / "cgroup"
    own.write_text("0::/job/42\n")
    v2 = tmp_path / "v2" / "job" / "42"
    v2.mkdir(parents=True)
    (v2 / "memory.max").write_text("4294967296\n")
    (v2 / "memory.current").write_text("1073741824\n")
    assert cgroup_memory_left(str(tmp_path / "v2"), str(own)) == 3 * 2 ** 30
    (v2 / "memory.max").write_text("max\n")
    assert cgroup_memory_left(str(tmp_path / "v2"), str(own)) is None  # no limit set
    v1 = tmp_path / "v1" / "memory"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text("2147483648\n")
    (v1 / "memory.usage_in_bytes").write_text("536870912\n")
    assert cgroup_memory_left(str(tmp_path / "v1"), str(tmp_path / "none")) == 1536 * 2 ** 20
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    assert cgroup_memory_left(str(tmp_path / "v1"), str(tmp_path / "none")) is None
