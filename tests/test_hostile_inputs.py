"""Hostile and careless inputs, one case per defect a hostile-input run found, so none comes back. Every case is
a command as a new user would type it; each must end in exit 2 with ONE line on stderr that names the option,
field or file (no traceback), and leave every file of the case's folder byte for byte as it was.

- outputs: no command writes onto, into or over one of its inputs (also through a symbolic link), and an
  existing file is replaced only with --overwrite (klgrpo/apps/outputs.py);
- resume: a run folder's config.yaml is the run's record (missing, empty or hand-edited: refused), and a
  refused resume changes nothing; a second sweep into a live sweep's folder is refused before it writes;
- checkpoints: flipped bytes or removed checksum entries are refused wherever a checkpoint is read, and only a
  checkpoint that predates checksums passes unchecked;
- values: bounds declared on the fields, a dtype that does not exist, hostile reward-model weights.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from klgrpo.apps.cli import main as cli
from klgrpo.run.trainer import GRPOTrainer
from tests.conftest import write_jsonl
from tests.helpers.checkpoints import strip_checksums
from tests.helpers.configs import make_config, quiet

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def finished_run(tiny_model_dir, addition_file, tmp_path_factory) -> Path:
    """A 2-step run with checkpoints step_1 and step_2 and an eval set; group size 4."""
    root = tmp_path_factory.mktemp("hostile")
    sets = [{"name": "add", "source": str(addition_file), "limit": 4}]
    cfg = make_config(tiny_model_dir, addition_file, root / "run", eval={"sets": sets},
                      train={"steps": 2, "save_every": 1, "keep_checkpoints": 0})
    GRPOTrainer(cfg, log=quiet).train()
    return root / "run"


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() and not p.is_symlink() else b"<dir/link>")
            for p in sorted(folder.rglob("*"))}


def refused(args: list[str], capsys, folder: Path, *expected: str) -> str:
    """Run ``klgrpo ARGS``: exit 2, one line naming ``expected``, ``folder`` unchanged. Returns the line."""
    before = _snapshot(folder)
    capsys.readouterr()
    code = cli(args)
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if line.startswith("klgrpo ")]
    assert code == 2, (args, err)
    assert len(lines) == 1 and "Traceback" not in err, err
    for text in expected:
        assert text in lines[0], (text, lines[0])
    assert _snapshot(folder) == before, "a file was created or changed"
    return lines[0]


def _copy_run(run: Path, root: Path) -> Path:
    return Path(shutil.copytree(run, root / "run", symlinks=True))


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x40  # a bit inside the last tensor's bytes: the file still parses
    path.write_bytes(bytes(data))


# ------------------------------------------------------------------------------------------------------ outputs
def test_eval_json_onto_the_checkpoints_weights_is_refused(finished_run, tmp_path, capsys):
    run = _copy_run(finished_run, tmp_path)
    ckpt = run / "checkpoints" / "step_2"
    refused(["eval", str(ckpt), "--json", str(ckpt / "model.safetensors")], capsys, tmp_path,
            "--json", "model.safetensors is inside the model", "an input of this command")
    (tmp_path / "out.json").symlink_to(ckpt / "trainer_state.json")  # through a link: the same
    refused(["eval", str(ckpt), "--json", str(tmp_path / "out.json"), "--overwrite"], capsys, tmp_path,
            "is inside the model")


def test_eval_json_replaces_an_existing_file_only_with_overwrite(finished_run, tmp_path, capsys):
    run = _copy_run(finished_run, tmp_path)
    ckpt, mine = run / "checkpoints" / "step_2", tmp_path / "mine.json"
    mine.write_text("my notes")
    refused(["eval", str(ckpt), "--json", str(mine)], capsys, tmp_path, f"--json {mine} exists", "--overwrite")
    assert cli(["eval", str(ckpt), "--json", str(mine), "--overwrite"]) == 0
    assert set(json.loads(mine.read_text())["results"]) >= {"eval/add"}


def test_kl_json_onto_the_prompts_is_refused(tiny_model_dir, tmp_path, capsys):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "01+02="}])
    refused(["kl", str(tiny_model_dir), str(tiny_model_dir), "--prompts", str(prompts), "--json", str(prompts),
             "--overwrite"], capsys, tmp_path, "--json", "is --prompts", "an input of this command")


def test_export_out_through_a_link_into_the_checkpoint_is_refused(finished_run, tmp_path, capsys):
    run = _copy_run(finished_run, tmp_path)
    ckpt = run / "checkpoints" / "step_2"
    (tmp_path / "out").symlink_to(ckpt / "sub", target_is_directory=True)
    refused(["export", str(ckpt), str(tmp_path / "out")], capsys, tmp_path, "OUT", "is inside the checkpoint")


def test_explain_run_json_onto_its_log_and_plot_over_a_picture(finished_run, tmp_path, capsys):
    run = _copy_run(finished_run, tmp_path)
    refused(["explain", "--run", str(run), "--json", str(run / "metrics.jsonl"), "--overwrite"], capsys, tmp_path,
            "--json", "metrics.jsonl is inside", "an input of this command")
    picture = tmp_path / "p.png"
    picture.write_bytes(b"my picture")
    refused(["explain", "--run", str(run), "--plot", str(picture)], capsys, tmp_path,
            f"--plot {picture} exists", "--overwrite")


def test_report_never_draws_through_a_link_onto_its_inputs(finished_run, tmp_path, capsys):
    run = _copy_run(finished_run, tmp_path)
    shutil.rmtree(run / "plots", ignore_errors=True)
    (run / "plots").symlink_to(run / "checkpoints" / "step_2", target_is_directory=True)
    refused(["report", str(run)], capsys, tmp_path, "plots/reward.png", "is inside", "checkpoints", "--no-plots")


def test_sweep_never_writes_its_table_over_its_config(tmp_path, capsys):
    folder = tmp_path / "sweep"
    folder.mkdir()
    config = folder / "table.md"
    config.write_text("train:\n  steps: 1\n")
    refused(["sweep", "--grid", "kl.coef=0,0.1", "--config", str(config), "--output-dir", str(folder)], capsys,
            tmp_path, "--output-dir", "holds --config", "write over")


def test_sft_output_dir_inside_the_base_model_is_refused(tiny_model_dir, addition_file, tmp_path, capsys):
    model = Path(shutil.copytree(tiny_model_dir, tmp_path / "base"))
    config = tmp_path / "sft.yaml"
    config.write_text(yaml.safe_dump({"model": {"name_or_path": str(model), "device": "cpu"},
                                      "data": {"source": str(addition_file)}}))
    refused(["sft", "--config", str(config), "--output-dir", str(model / "sft"), "--steps", "1"], capsys, tmp_path,
            "--output-dir", "is inside model.name_or_path")


def test_train_overwrite_never_deletes_its_own_model(finished_run, tmp_path, capsys):
    run = _copy_run(finished_run, tmp_path)
    ckpt = run / "checkpoints" / "step_1"
    refused(["train", "--config", str(run / "config.yaml"), "--model.name_or_path", str(ckpt), "--output-dir",
             str(run), "--overwrite"], capsys, tmp_path, "--output-dir", "holds model.name_or_path")
    refused(["train", "--config", str(run / "config.yaml"), "--model.name_or_path", str(ckpt), "--output-dir",
             str(ckpt / "grpo")], capsys, tmp_path, "--output-dir", "is inside model.name_or_path")


# ------------------------------------------------------------------------------------------------------- resume
def _resume(run: Path, how: str = "auto", *extra: str) -> list[str]:
    return ["train", "--resume", how, "--output-dir", str(run), "--train.steps", "3", *extra]


@pytest.mark.parametrize("how", ["auto", "latest"])
@pytest.mark.parametrize("damage", ["empty", "deleted"])
def test_resume_refuses_a_run_without_its_config(finished_run, tmp_path, capsys, how, damage):
    run = _copy_run(finished_run, tmp_path)
    if damage == "empty":
        (run / "config.yaml").write_text("")
    else:
        (run / "config.yaml").unlink()
    refused(_resume(run, how), capsys, tmp_path, "config.yaml is missing or empty")


@pytest.mark.parametrize("how", ["auto", "latest"])
def test_resume_refuses_a_hand_edited_config_naming_the_field(finished_run, tmp_path, capsys, how):
    run = _copy_run(finished_run, tmp_path)
    text = (run / "config.yaml").read_text()
    assert "group_size: 4" in text
    (run / "config.yaml").write_text(text.replace("group_size: 4", "group_size: 2"))
    refused(_resume(run, how), capsys, tmp_path, "config.yaml was changed since checkpoint step_2",
            "rollout.group_size 4 -> 2", "not resume-safe")


def test_resume_accepts_an_edit_of_a_resume_safe_field(finished_run, tmp_path, capsys):
    run = _copy_run(finished_run, tmp_path)
    data = yaml.safe_load((run / "config.yaml").read_text())
    data["train"]["steps"] = 3  # how long: resume-safe
    (run / "config.yaml").write_text(yaml.safe_dump(data))
    assert cli(["train", "--resume", "latest", "--output-dir", str(run)]) == 0, capsys.readouterr().err
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()][-1] == 3


def test_a_refused_resume_into_a_read_only_checkpoints_folder_changes_nothing(finished_run, tmp_path, capsys):
    run = _copy_run(finished_run, tmp_path)
    checkpoints = run / "checkpoints"
    if os.geteuid() != 0:
        checkpoints.chmod(0o555)
    elif subprocess.run(["mount", "--bind", "-o", "ro", str(checkpoints), str(checkpoints)],
                        capture_output=True).returncode != 0:
        pytest.skip("root here, and no read-only bind mount: every folder is writable")
    try:
        refused(_resume(run, "latest"), capsys, tmp_path, "cannot write in", "checkpoints")
    finally:
        if os.geteuid() != 0:
            checkpoints.chmod(0o755)
        else:
            subprocess.run(["umount", str(checkpoints)], check=True)


def test_a_second_sweep_into_a_live_sweeps_folder_is_refused(tmp_path, capsys):
    folder = tmp_path / "sweep"
    folder.mkdir()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (folder / ".klgrpo.lock").write_text(json.dumps({"pid": live.pid, "host": os.uname().nodename}))
        refused(["sweep", "--grid", "kl.coef=0,0.1", "--output-dir", str(folder)], capsys, tmp_path,
                "being written by another klgrpo sweep", f"PID {live.pid}")
    finally:
        live.kill()
        live.wait()


# -------------------------------------------------------------------------------------------------- checkpoints
def _flipped_checkpoint(run: Path, step: int = 2) -> Path:
    ckpt = run / "checkpoints" / f"step_{step}"
    _flip(ckpt / "model.safetensors")
    return ckpt


def test_train_refuses_a_flipped_checkpoint_as_its_model_or_reference(finished_run, tmp_path, capsys):
    run = _copy_run(finished_run, tmp_path)
    ckpt = _flipped_checkpoint(run)
    base = ["train", "--config", str(run / "config.yaml"), "--output-dir", str(tmp_path / "new")]
    refused([*base, "--model.name_or_path", str(ckpt)], capsys, tmp_path,
            "model.name_or_path", "step_2/model.safetensors cannot be read as saved")
    refused([*base, "--kl.reference", str(ckpt)], capsys, tmp_path,
            "kl.reference", "step_2/model.safetensors cannot be read as saved")


def test_sft_refuses_a_flipped_checkpoint(finished_run, tmp_path, capsys):
    pytest.importorskip("trl", reason="klgrpo sft runs TRL's SFTTrainer")
    run = _copy_run(finished_run, tmp_path)
    config = tmp_path / "sft.yaml"
    config.write_text(yaml.safe_dump({"model": {"name_or_path": str(_flipped_checkpoint(run)), "device": "cpu"},
                                      "data": {"source": str(run.parent / "missing.jsonl")}}))
    data = yaml.safe_load((run / "config.yaml").read_text())["data"]["source"]
    config.write_text(config.read_text().replace(str(run.parent / "missing.jsonl"), data))
    refused(["sft", "--config", str(config), "--output-dir", str(tmp_path / "m"), "--steps", "1"], capsys, tmp_path,
            "model.name_or_path", "cannot be read as saved")


def test_the_trl_bridge_refuses_a_flipped_checkpoint(finished_run, tmp_path):
    pytest.importorskip("trl")
    from klgrpo.errors import ConfigError
    from klgrpo.trl import GRPOConfig
    from klgrpo.trl import GRPOTrainer as TRLBridge
    from tests.helpers.trl_setup import run_args

    ckpt = _flipped_checkpoint(_copy_run(finished_run, tmp_path))
    with pytest.raises(ConfigError, match="model .*step_2/model.safetensors cannot be read as saved"):
        TRLBridge(str(ckpt), reward_funcs=[], args=GRPOConfig(**run_args(tmp_path / "trl")))


def test_stripped_checksums_are_refused_and_a_checkpoint_before_checksums_passes(finished_run, tmp_path, capsys):
    run = _copy_run(finished_run, tmp_path)
    ckpt = _flipped_checkpoint(run)
    strip_checksums(ckpt)
    refused(["eval", str(ckpt)], capsys, tmp_path, "has no weights_sha256 entries", "checkpoint_version 2")
    refused(["export", str(ckpt), str(tmp_path / "out")], capsys, tmp_path, "has no weights_sha256 entries")
    # Also the JSON's version removed: the tensors file's header still says the checkpoint records checksums.
    data = json.loads((ckpt / "trainer_state.json").read_text())
    del data["checkpoint_version"]
    (ckpt / "trainer_state.json").write_text(json.dumps(data))
    refused(["eval", str(ckpt)], capsys, tmp_path, "has no weights_sha256 entries")
    older = run / "checkpoints" / "step_1"
    strip_checksums(older, as_before_checksums=True)  # intact weights, as written before checksums were recorded
    assert cli(["eval", str(older)]) == 0, capsys.readouterr().err


def test_resume_skips_a_flipped_checkpoint_whose_checksums_were_stripped(finished_run, tmp_path):
    from klgrpo.config.schema import GRPOConfig
    from klgrpo.errors import KLGRPOWarning

    run = _copy_run(finished_run, tmp_path)
    strip_checksums(_flipped_checkpoint(run))
    cfg = GRPOConfig.from_yaml(run / "config.yaml").override({"train.steps": 3, "train.output_dir": str(run)})
    trainer = GRPOTrainer(cfg, log=quiet)
    with pytest.warns(KLGRPOWarning, match="step_2 cannot be loaded: .*has no weights_sha256 entries"):
        trainer.resume("latest")
    assert trainer.grpo_step.completed == 1


# ------------------------------------------------------------------------------------------------------- values
@pytest.mark.parametrize("override, expected", [
    ("--loss.vespo_k_pos=1e300", "loss.vespo_k_pos must be in [0, 100.0], got 1e+300"),
    ("--loss.vespo_k_neg=-2", "loss.vespo_k_neg must be in [0, 100.0], got -2.0"),
    ("--loss.entropy_target=-1", "loss.entropy_target must be >= 0, got -1.0"),
])
def test_out_of_range_loss_values_are_refused_by_train(tiny_model_dir, addition_file, tmp_path, capsys, override,
                                                       expected):
    refused(["train", "--model.name_or_path", str(tiny_model_dir), "--data.source", str(addition_file),
             "--output-dir", str(tmp_path / "r"), override], capsys, tmp_path, expected)


def test_kl_refuses_a_dtype_that_does_not_exist(tiny_model_dir, tmp_path, capsys):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "1+2="}])
    refused(["kl", str(tiny_model_dir), str(tiny_model_dir), "--prompts", str(prompts), "--dtype", "float7"], capsys,
            tmp_path, "--dtype: invalid choice: 'float7'", "float32")


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory) -> Path:
    from tests.helpers.reward_model import build_reward_model, rm_tokenizer, save_reward_model

    tokenizer = rm_tokenizer()
    return save_reward_model(tmp_path_factory.mktemp("rm"), build_reward_model(tokenizer, seed=3), tokenizer)


def _hostile_weights(folder: Path, kind: str) -> None:
    import pickle

    weights = folder / "model.safetensors"
    if kind == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif kind == "random":
        weights.write_bytes(bytes(range(256)) * 64)
    else:  # a pickle in place of safetensors: torch's weights_only loader refuses it, nothing is unpickled
        weights.unlink()
        (folder / "pytorch_model.bin").write_bytes(pickle.dumps({"weight": [1.0]}))


@pytest.mark.parametrize("kind, library_error", [("truncated", "SafetensorError"), ("random", "SafetensorError"),
                                                 ("pickled", "UnpicklingError")])
def test_a_reward_model_with_hostile_weights_is_one_line(reward_model_dir, tmp_path, kind, library_error):
    import torch

    from klgrpo.core.rewards import RewardModel, RewardModelContext, RewardModelSpec
    from klgrpo.errors import ConfigError

    folder = Path(shutil.copytree(reward_model_dir, tmp_path / "rm"))
    _hostile_weights(folder, kind)
    model = RewardModel(RewardModelSpec(model=str(folder)))
    with pytest.raises(ConfigError) as err:
        model.load(RewardModelContext(device=torch.device("cpu"), dtype=torch.float32))
    line = str(err.value)
    assert "\n" not in line and f"cannot load a reward model from '{folder}'" in line, line
    assert f"its weights file cannot be read ({library_error}" in line and "a pickled file is not loaded" in line


def test_the_memory_check_refuses_group_size_100000_on_a_large_host():
    """The demo's model (2 layers of 64, 4 heads, MLP 256, 16 tokens), 32 prompts x 100000 completions of 4
    tokens after a 12-token prompt, float32: the update alone keeps 3.2e6 x (2 x 4 x 16 + 16 x 2 x (64 + 2 x 64
    + 2 x 256)) x 4 bytes = 3.2e6 x 22656 x 4 = 270.1 GiB, refused on a host with 128 GiB free."""
    from klgrpo.apps.demo.model import build_tiny_model
    from klgrpo.config.schema import GRPOConfig
    from klgrpo.errors import ConfigError
    from klgrpo.train.step_memory import check_step_memory, estimate_step_memory

    model = build_tiny_model(16, 0, hidden=64, layers=2, heads=4, intermediate=256)
    cfg = GRPOConfig.from_dict({"rollout": {"prompts_per_step": 32, "group_size": 100000, "max_new_tokens": 4}})
    assert estimate_step_memory(cfg, model.config, 4, 12)[1] == 3_200_000 * 22656 * 4
    with pytest.raises(ConfigError, match=r"the update needs at least 270\.08 GiB but 128\.00 GiB are free"):
        check_step_memory(cfg, model, 12, available_bytes=128 * 2 ** 30)


@pytest.mark.slow  # about 7 s of math-verify's own timeouts
def test_math_verify_budget_holds_under_a_power_tower_in_the_answers():
    """A depth-50 tower 2^{2^{...}} as every row's reference answer (a group repeats it) and as a completion:
    each distinct answer is parsed once under timeout_s, and the whole call stays near step_budget_s."""
    pytest.importorskip("math_verify")
    import time

    from klgrpo.core.rewards.builtins import math_verify_match

    tower = "2^{" * 49 + "2" + "}" * 49
    start = time.monotonic()  # unbounded, each of the 8 rows parsed its answer for math-verify's default 5 s
    scores = math_verify_match(["q"] * 8, ["4"] * 8, [f"${tower}$"] * 8, step_budget_s=3, timeout_s=1)
    assert list(scores) == [0.0] * 8 and all(scores.timed_out)
    assert time.monotonic() - start < 3 + 1.5  # the budget, and at most one check's overrun of its alarm
    start = time.monotonic()
    scores = math_verify_match(["q"] * 8, [f"$\\boxed{{{tower}}}$"] * 8, ["4"] * 8, step_budget_s=3, timeout_s=1)
    assert list(scores) == [0.0] * 8 and all(scores.timed_out)
    assert time.monotonic() - start < 3 + 1.5  # the budget, and at most one check's overrun of its alarm


# ---------------------------------------------------------------------------------------------------- DeepSpeed
def _ds_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "ds.json"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("env, expected", [
    ({"ACCELERATE_DEEPSPEED_ZERO_STAGE": "7"},
     "deepspeed_config.zero_stage must be 0, 1, 2 or 3 (the ZeRO stages), got 7"),
    ({"ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "gpu"}, "offload_optimizer_device must be one of none, cpu"),
    ({"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "two"}, "gradient_accumulation_steps must be a whole number"),
    ({"ACCELERATE_DEEPSPEED_CONFIG_FILE": "{tmp}/missing.json"}, "cannot be read (No such file"),
    ({"ACCELERATE_DEEPSPEED_CONFIG_FILE": "file:{\"zero_optimization\": "}, "is not valid JSON"),
    ({"ACCELERATE_DEEPSPEED_CONFIG_FILE": "file:[1, 2]"}, "holds a list, not a JSON object"),
    ({"ACCELERATE_DEEPSPEED_CONFIG_FILE": "file:{\"train_batch_size\": 8}"}, "zero_optimization must be an object"),
    ({"ACCELERATE_DEEPSPEED_CONFIG_FILE": "file:{\"zero_optimization\": {\"stage\": 7}}"},
     "zero_optimization.stage must be 0, 1, 2 or 3"),
    ({"ACCELERATE_DEEPSPEED_CONFIG_FILE": "file:{\"zero_optimization\": {\"stage\": 2}, \"gradient_clipping\": -1}"},
     "gradient_clipping must be a finite number >= 0, got -1"),
    ({"ACCELERATE_DEEPSPEED_CONFIG_FILE":
      "file:{\"zero_optimization\": {\"stage\": 3, \"offload_param\": {\"device\": \"disk\"}}}"},
     "zero_optimization.offload_param.device must be one of none, cpu, nvme, got 'disk'"),
])
def test_a_malformed_deepspeed_launch_is_refused_by_train_before_any_process_group(
        tiny_model_dir, addition_file, tmp_path, capsys, monkeypatch, env, expected):
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    for key, value in env.items():
        value = _ds_file(tmp_path, value.removeprefix("file:")) if value.startswith("file:") else value
        monkeypatch.setenv(key, value.format(tmp=tmp_path))
    refused(["train", "--model.name_or_path", str(tiny_model_dir), "--data.source", str(addition_file),
             "--output-dir", str(tmp_path / "r")], capsys, tmp_path, expected)


def test_the_shipped_deepspeed_settings_pass_the_check(tmp_path):
    from klgrpo.train.deepspeed_config import check_deepspeed_settings

    config = yaml.safe_load((ROOT / "examples/accelerate/deepspeed-zero3.yaml").read_text())["deepspeed_config"]
    check_deepspeed_settings({"ACCELERATE_USE_DEEPSPEED": "true",
                              "ACCELERATE_DEEPSPEED_ZERO_STAGE": str(config["zero_stage"]),
                              "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": config["offload_optimizer_device"],
                              "ACCELERATE_DEEPSPEED_CONFIG_FILE": _ds_file(tmp_path, json.dumps(
                                  {"zero_optimization": {"stage": "auto"}, "train_batch_size": "auto"}))})
