"""rollout.sampler vllm where the vllm package is missing: refused when the config is validated (GRPOTrainer,
``klgrpo train``, its --print-config and the demo's) in one line naming the field and the package, before any
model loads; ``auto`` and the other samplers never need vllm. The test plants the package's absence (or its
presence) so it reads the same in the main environment and in the vLLM one."""

from __future__ import annotations

import pytest
import yaml
from helpers.configs import make_config

from klgrpo.apps import train as train_app
from klgrpo.apps.cli import main as cli
from klgrpo.backends import vllm_sampler
from klgrpo.errors import ConfigError


@pytest.fixture
def no_vllm(monkeypatch):
    monkeypatch.setattr(vllm_sampler, "vllm_installed", lambda: False)


def _refusal_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.strip()]


def test_validation_refuses_vllm_when_missing_and_passes_auto(no_vllm, tiny_model_dir, addition_file, tmp_path):
    cfg = make_config(tiny_model_dir, addition_file, tmp_path / "run", rollout={"sampler": "vllm"})
    with pytest.raises(ConfigError) as refused:
        cfg.validate()
    assert str(refused.value).startswith("rollout.sampler vllm needs the vllm package: pip install vllm")
    for name in ("auto", "kv_loop", "generate", "generate_static"):
        assert (
            make_config(tiny_model_dir, addition_file, tmp_path / name, rollout={"sampler": name}).validate()
            is not None
        )


def test_validation_passes_vllm_where_it_is_installed(monkeypatch, tiny_model_dir, addition_file, tmp_path):
    monkeypatch.setattr(vllm_sampler, "vllm_installed", lambda: True)
    assert (
        make_config(tiny_model_dir, addition_file, tmp_path / "run", rollout={"sampler": "vllm"}).validate() is not None
    )


def test_a_config_rule_is_named_before_the_missing_package(no_vllm, tiny_model_dir, addition_file, tmp_path):
    cfg = make_config(
        tiny_model_dir, addition_file, tmp_path / "run", rollout={"sampler": "vllm"}, loss={"std_ddof": 3}
    )
    with pytest.raises(ConfigError, match=r"^loss\.std_ddof"):
        cfg.validate()


@pytest.mark.parametrize("extra", [["--print-config"], []], ids=["print-config", "train"])
def test_klgrpo_train_refuses_before_loading_the_model(
    no_vllm, monkeypatch, tiny_model_dir, addition_file, tmp_path, capsys, extra
):
    from klgrpo.run import trainer

    def no_trainer(*_, **__):
        raise AssertionError("the trainer was built for a sampler that is not installed")

    monkeypatch.setattr(trainer, "GRPOTrainer", no_trainer)
    config = tmp_path / "run.yaml"
    config.write_text(make_config(tiny_model_dir, addition_file, tmp_path / "run").to_yaml())
    code = cli(["train", "--config", str(config), "--rollout.sampler", "vllm", *extra])
    out, err = capsys.readouterr()
    assert code == 2 and "name_or_path" not in out  # nothing printed as a config
    lines = _refusal_lines(err)
    assert len(lines) == 1 and lines[0].startswith("klgrpo train: error: rollout.sampler vllm needs the vllm package")
    assert not (tmp_path / "run").exists()


def test_the_demo_refuses_before_its_warm_start(no_vllm, monkeypatch, tmp_path, capsys):
    from klgrpo.apps.demo import assets as demo_assets

    def no_sft(*_, **__):
        raise AssertionError("the demo built its assets for a sampler that is not installed")

    monkeypatch.setenv("KLGRPO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(demo_assets, "prepare_demo_assets", no_sft)
    monkeypatch.setattr(demo_assets, "planned_demo_assets", no_sft)
    for extra in (["--print-config"], []):
        assert train_app.main(["--rollout.sampler", "vllm", *extra]) == 2
        out, err = capsys.readouterr()
        assert out == "" and len(_refusal_lines(err)) == 1 and "rollout.sampler vllm" in err


def test_auto_prints_its_config_without_vllm(no_vllm, tiny_model_dir, addition_file, tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text(make_config(tiny_model_dir, addition_file, tmp_path / "run").to_yaml())
    assert cli(["train", "--config", str(config), "--rollout.sampler", "auto", "--print-config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["rollout"]["sampler"] == "auto"
