"""docs/python_api.md: its run example executes as written (paths and sizes swapped for the tiny local model),
and each way of building a config gives what the command line gives."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from klgrpo import GRPOConfig, GRPOTrainer
from klgrpo.apps.args import parse_args
from klgrpo.errors import ConfigError

DOC = Path(__file__).resolve().parents[1] / "docs" / "python_api.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def test_the_docs_run_example_trains(tiny_model_dir, addition_file, tmp_path, capsys):
    code = _python_blocks()[0]
    swaps = {'"Qwen/Qwen2.5-0.5B-Instruct"': repr(str(tiny_model_dir)), '"prompts.jsonl"': repr(str(addition_file)),
             '"runs/python-api"': repr(str(tmp_path / "run")),
             '"group_size": 8, "prompts_per_step": 16, "max_new_tokens": 128':
                 '"group_size": 2, "prompts_per_step": 2, "max_new_tokens": 4',
             '"train": {"steps": 200, ': '"logging": {"progress": False, "tensorboard": False, "plots": False}, '
                                         '"train": {"steps": 1, "torch_threads": 1, '}
    for old, new in swaps.items():
        assert old in code, old
        code = code.replace(old, new)
    namespace: dict = {}
    exec(compile(code, str(DOC), "exec"), namespace)
    summary = namespace["summary"]
    assert summary["steps"] == 1 and set(summary["eval_after"]) == {"held_out"}
    assert (tmp_path / "run" / "checkpoints" / "step_1" / "model.safetensors").is_file()
    assert str(tmp_path / "run") in capsys.readouterr().out


def test_config_building_matches_the_command_line(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("kl:\n  coef: 0.1\n  estimator: k3\nrollout:\n  group_size: 4\n")
    from_python = GRPOConfig.from_yaml(path).override({"kl.coef": "0.02", "rollout.group_size": 16})
    from_cli = parse_args(["--config", str(path), "--kl.coef", "0.02", "--rollout.group_size", "16"])[0]
    assert from_python.to_dict() == from_cli.to_dict()
    assert (from_python.kl.coef, from_python.kl.estimator, from_python.rollout.group_size) == (0.02, "k3", 16)
    assert GRPOConfig.from_dict(from_python.to_dict()) == from_python
    direct = GRPOConfig()
    direct.kl.coef = 0.02
    assert direct.kl.coef == 0.02 and GRPOConfig().kl.coef == 0.04  # groups are per-instance dataclasses
    with pytest.raises(ConfigError, match="kl.coeff.*did you mean kl.coef"):
        GRPOConfig.from_dict({"kl": {"coeff": 1}})


def test_trainer_takes_a_list_of_rows_and_eval_sets(tiny_model_dir, tmp_path):
    from klgrpo.core.rewards import load_reward_function

    config = GRPOConfig.from_dict({
        "model": {"name_or_path": str(tiny_model_dir), "dtype": "float32", "device": "cpu"},
        "rollout": {"group_size": 2, "prompts_per_step": 2, "max_new_tokens": 3},
        "train": {"steps": 1, "output_dir": str(tmp_path / "run")},
        "logging": {"progress": False, "tensorboard": False, "plots": False}})
    rows = [{"prompt": f"{a}+1=", "answer": str(a + 1)} for a in range(6)]
    sets = {"mine": {"prompts": ["1+1=", "2+2="], "answers": ["2", "4"],
                     "reward_fn": load_reward_function("exact_match")}}
    summary = GRPOTrainer(config, train_dataset=rows, eval_sets=sets, log=lambda line: None).train()
    assert set(summary["eval_before"]) == {"mine"} and summary["eval_before"]["mine"] in (0.0, 0.5, 1.0)
