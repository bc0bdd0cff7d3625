"""``klgrpo train --print-config`` checks the config as ``klgrpo train`` does: a config train would refuse is
refused in the same one line (exit 2) instead of printed as if it ran; and rollout.divergence_mask's own mistakes
(an unknown or repeated mask name, a pasted blob) are named before its threshold's."""

from __future__ import annotations

import pytest
import yaml

from klgrpo.apps.cli import main as cli


@pytest.fixture
def base_config(tmp_path):
    """A run config on a local model folder and prompt file: the checks read the config only, never the files."""
    config = {"model": {"name_or_path": str(tmp_path / "model"), "device": "cpu"},
              "data": {"source": str(tmp_path / "prompts.jsonl")}, "train": {"steps": 4}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _one_line(args: list[str], capsys) -> str:
    capsys.readouterr()
    code = cli(args)
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert code == 2, captured
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    assert "rollout:" not in captured.out, "a refused config was printed"
    return lines[0]


SERVER = ["--rollout.sampler", "vllm_server"]


@pytest.mark.parametrize(("override", "field"), [
    (["--rollout.divergence_mask", "token_k1"], "rollout.divergence_threshold"),  # a mask without its bound
    (["--rollout.divergence_threshold", "0.5_2"], "rollout.divergence_threshold"),  # a bound without a mask
    (["--rollout.warn_ess_below", "-1"], "rollout.warn_ess_below"),
    (["--rollout.warn_chi2_above", ".nan"], "rollout.warn_chi2_above"),
    (["--rollout.sampler_correction", "token_truncate", "--rollout.sampler_correction_min", "5"],
     "rollout.sampler_correction"),
    ([*SERVER, "--rollout.vllm.server_url", "localhost:8000"], "rollout.vllm.server_url"),
    ([*SERVER, "--rollout.vllm.server_url", "http://127.0.0.1:9", "--rollout.vllm.server_timeout", "0"],
     "rollout.vllm.server_timeout"),
    (["--kl.on_runaway", "rollback", "--kl.runaway_beta_factor", "0"], "kl.runaway_beta_factor"),
    (["--kl.controller", "adaptive", "--kl.horizon", "-1"], "kl.horizon"),
    (["--train.seed", "-1"], "train.seed"),
], ids=lambda value: value if isinstance(value, str) else value[0].lstrip("-"))
def test_print_config_refuses_what_train_refuses(base_config, capsys, override, field):
    args = ["--config", str(base_config), *override]
    printed = _one_line(["train", *args, "--print-config"], capsys)
    assert field in printed, printed
    # the same line as the run itself gives, before any model loads (the model folder does not exist)
    assert _one_line(["train", *args, "--output-dir", str(base_config.parent / "run")], capsys) == printed


def test_print_config_still_prints_a_valid_config(base_config, capsys):
    capsys.readouterr()
    assert cli(["train", "--config", str(base_config), "--rollout.divergence_mask", "token_k1",
                "--rollout.divergence_threshold", "0.5_2.0", "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["rollout"]["divergence_mask"] == "token_k1"
    assert printed["rollout"]["divergence_threshold"] == "0.5_2.0"


def test_the_demos_print_config_refuses_what_its_run_refuses(capsys):
    # no model configured: the demo's resolved config, whose assets are located, not built
    line = _one_line(["train", "--rollout.divergence_mask", "token_k3", "--print-config"], capsys)
    assert "rollout.divergence_threshold" in line, line


@pytest.mark.parametrize(("mask", "threshold", "named"), [
    ("bogus", "", "unknown mask 'bogus'"),  # named before the missing threshold
    ("token_k1,tökén_k2", "0.5_2", "unknown mask 'tökén_k2'"),
    ("TOKEN_K1", "0.5_2", "unknown mask 'TOKEN_K1'"),
    ("token_k1,token_k1", "0.5_2", "names token_k1 twice"),
])
def test_a_divergence_masks_own_mistake_is_named_first(base_config, capsys, mask, threshold, named):
    line = _one_line(["train", "--config", str(base_config), "--rollout.divergence_mask", mask,
                      "--rollout.divergence_threshold", repr(threshold), "--print-config"], capsys)
    assert "rollout.divergence_mask" in line and named in line, line


def test_a_pasted_blob_is_not_echoed_whole(base_config, capsys):
    blob = "x" * 5000
    for field, value in (("rollout.divergence_mask", blob), ("rollout.divergence_threshold", blob)):
        args = ["--rollout.divergence_mask", "token_k2", f"--{field}", value]
        line = _one_line(["train", "--config", str(base_config), *args, "--print-config"], capsys)
        assert field in line and "5000 characters" in line and len(line) < 400, line[:300]
