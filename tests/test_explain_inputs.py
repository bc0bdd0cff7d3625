"""``klgrpo explain`` on what users have: ``trl grpo --config`` files, training scripts (read, never run), verl
and OpenRLHF launch scripts, TRL's fields as data, hostile inputs (one line each), and outputs that never replace
a user's file."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from klgrpo.apps.explain import main
from klgrpo.apps.explain.reading import MAX_BYTES, MAX_DEPTH

ROOT = Path(__file__).parents[1]
EXAMPLES = ROOT / "examples" / "explain"


def _report(tmp_path, path, *args) -> dict:
    out = tmp_path / "report.json"
    assert main([str(path), "--json", str(out), "--overwrite", *args]) == 0
    return json.loads(out.read_text())


# ------------------------------------------------------------------------------- the same verdict, any spelling
#: The settings of examples/explain/trl_grpo_config.yaml, trl_train.py and unsloth_train.py, as plain YAML.
PLAIN = {
    "trl_grpo_config.yaml": "beta: 0.04\nloss_type: grpo\nnum_generations: 8\nmax_completion_length: 256\n"
                            "learning_rate: 1.0e-6\n",
    "trl_train.py": "beta: 0.04\nloss_type: grpo\nnum_generations: 8\nmax_completion_length: 256\n"
                    "learning_rate: 1.0e-6\n",
    "unsloth_train.py": "beta: 0.04\nloss_type: grpo\nkl_adaptation_method: dynamic\nreward_threshold: 0.8\n"
                        "dynamic_beta_decay: 0.9\nbeta_min: 0.001\nbeta_schedule_steps: 1000\nnum_generations: 8\n"
                        "max_completion_length: 256\nlearning_rate: 5.0e-6\n",
}


@pytest.mark.parametrize("name", sorted(PLAIN))
def test_a_config_file_and_a_script_give_the_plain_yamls_verdict(tmp_path, name):
    plain = tmp_path / "plain.yaml"
    plain.write_text(PLAIN[name])
    theirs, ours = _report(tmp_path, EXAMPLES / name), _report(tmp_path, plain)
    for key in ("source", "gradient", "gradient_detail", "value", "controller", "aggregation", "risks"):
        assert theirs[key] == ours[key], key
    for group in ("kl", "loss", "train", "rollout", "optim"):
        assert theirs["config"][group] == ours["config"][group], group


def test_trl_grpo_config_maps_model_lora_and_dataset(tmp_path):
    report = _report(tmp_path, EXAMPLES / "trl_grpo_config.yaml")
    assert report["config"]["model"] == {
        "name_or_path": "Qwen/Qwen2.5-0.5B-Instruct", "dtype": "bfloat16",
        "lora": {"r": 16, "alpha": 32.0, "dropout": 0.05, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}}
    assert report["config"]["data"] == {"split": "train", "source": "openai/gsm8k:main"}
    assert set(report["ignored"]) == {"output_dir", "per_device_train_batch_size", "bf16", "logging_steps",
                                      "report_to"}
    assert list(report["unmapped"]) == ["reward_funcs"]


def test_write_of_a_trl_grpo_config_is_a_klgrpo_config(tmp_path):
    from klgrpo.config.schema import GRPOConfig

    out = tmp_path / "klgrpo.yaml"
    assert main([str(EXAMPLES / "trl_grpo_config.yaml"), "--write", str(out)]) == 0
    cfg = GRPOConfig.from_yaml(out)
    assert (cfg.model.name_or_path, cfg.model.lora.r, cfg.data.source, cfg.kl.coef) == \
        ("Qwen/Qwen2.5-0.5B-Instruct", 16, "openai/gsm8k:main", 0.04)


def test_torch_dtype_is_read_as_dtype_and_a_field_of_no_dataclass_is_refused(tmp_path, capsys):
    src = tmp_path / "run.yaml"
    src.write_text("model_name_or_path: m\ntorch_dtype: bfloat16\nbeta: 0.04\n")
    assert _report(tmp_path, src)["config"]["model"] == {"name_or_path": "m", "dtype": "bfloat16"}
    src.write_text("model_name_or_path: m\nlora_alpah: 8\n")
    assert main([str(src)]) == 2
    assert "unknown TRL GRPOConfig field 'lora_alpah'; did you mean lora_alpha?" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------- Python scripts
def test_a_script_is_never_run(tmp_path):
    marker = tmp_path / "ran.txt"
    src = tmp_path / "train.py"
    src.write_text(f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n"
                   f"import os\nos.system('touch ' + {str(marker)!r})\n"
                   "from trl import GRPOConfig\nargs = GRPOConfig(beta=0.04, loss_type='dapo')\n")
    report = _report(tmp_path, src)
    assert not marker.exists()
    assert report["source"] == "trl" and report["config"]["kl"]["coef"] == 0.04


def test_computed_keywords_are_named_and_the_default_is_used(tmp_path):
    src = tmp_path / "train.py"
    src.write_text("import trl\nbeta = 0.1\nopts = {}\n"
                   "cfg = trl.GRPOConfig(beta=beta, loss_type='bnpo', epsilon=0.1 + 0.1, **opts)\n")
    report = _report(tmp_path, src)
    assert report["unmapped"]["beta"] == "computed when the script runs: the verdict uses TRL's default (beta)"
    assert report["unmapped"]["epsilon"].startswith("computed when the script runs")
    assert "**opts" in report["unmapped"]
    assert report["config"]["kl"]["coef"] == 0.0 and report["gradient"]["token_on_policy"] == "zero"


def test_several_calls_are_refused_with_their_lines_and_call_picks_one(tmp_path, capsys):
    src = tmp_path / "train.py"
    src.write_text("from klgrpo.trl import GRPOConfig as C\n\na = C(beta=0.1)\nb = C(beta=0.2,\n"
                   "      kl_controller='dual')\n")
    assert main([str(src)]) == 2
    assert "has 2 GRPOConfig calls (lines 3, 4); pass --call LINE" in capsys.readouterr().err
    report = _report(tmp_path, src, "--call", "4")
    assert report["source"] == "adaptive_kl" and report["config"]["kl"]["controller"] == "dual"
    assert main([str(src), "--call", "2"]) == 2
    assert "no GRPOConfig call on line 2; the calls are on lines 3, 4" in capsys.readouterr().err


#: GRPOConfig snippets in the style of TRL's documentation, with the verdict a hand derivation gives: k3 with the
#: in-graph weight (use_bias_correction_kl, TRL's default) follows the reverse KL per token; without it, forward;
#: beta 0 has no KL term; a per-token loss KL is "neither" at sequence level.
DOC_SNIPPETS = {
    "training_args = GRPOConfig(output_dir='Qwen2-0.5B-GRPO', beta=0.04)": ("reverse", "neither"),
    "GRPOConfig(loss_type='dr_grpo', beta=0.001, use_bias_correction_kl=False)": ("forward", "neither"),
    "GRPOConfig(importance_sampling_level='sequence', loss_type='grpo', beta=0.0)": ("zero", "zero"),
    "GRPOConfig(output_dir='out', num_iterations=1, scale_rewards=False, loss_type='dr_grpo')": ("zero", "zero"),
    "GRPOConfig(beta=0.04, sync_ref_model=True, ref_model_sync_steps=64)": ("reverse", "neither"),
}


@pytest.mark.parametrize("snippet", sorted(DOC_SNIPPETS))
def test_documentation_snippets(tmp_path, snippet):
    src = tmp_path / "snippet.py"
    src.write_text(f"from trl import GRPOConfig\n\n{snippet}\n")
    gradient = _report(tmp_path, src)["gradient"]
    assert (gradient["token_on_policy"], gradient["sequence_on_policy"]) == DOC_SNIPPETS[snippet]


# ------------------------------------------------------------------------------------------------ launch scripts
def test_verl_script_variables_arrays_and_unresolved_settings(tmp_path):
    report = _report(tmp_path, EXAMPLES / "verl_grpo.sh")
    assert report["source"] == "verl" and report["config"]["kl"]["coef"] == 0.001  # $KL_COEF, set in the script
    assert report["gradient"] == {"token_on_policy": "forward", "sequence_on_policy": "neither"}
    src = tmp_path / "run.sh"
    src.write_text("set -x\npython3 -m verl.trainer.main_ppo \\\n    algorithm.adv_estimator=grpo \\\n"
                   "    actor_rollout_ref.actor.use_kl_loss=True \\\n"
                   "    actor_rollout_ref.actor.kl_loss_coef=$1 $@\n")
    report = _report(tmp_path, src)
    assert report["unmapped"]["actor_rollout_ref.actor.kl_loss_coef"] == (
        "set by $1 when the script runs (not a literal in the script): the verdict uses verl's default, 0.001")
    assert "$@" in report["unmapped"]


def test_openrlhf_script_with_an_array_and_a_flag_outside_the_table(tmp_path, capsys):
    report = _report(tmp_path, EXAMPLES / "openrlhf_grpo.sh")
    assert report["source"] == "openrlhf" and report["config"]["loss"]["eps_high"] == 0.28
    assert report["unmapped"]["algo.advantage.is_correction_enable"].startswith("vLLM's importance-sampling")
    assert report["gradient"] == {"token_on_policy": "forward", "sequence_on_policy": "neither"}
    src = tmp_path / "run.sh"
    src.write_text("python3 -m openrlhf.cli.train_ppo_ray --algo.kl.use_loss --algo.kl.new_thing 3\n")
    assert main([str(src)]) == 2
    assert "unknown OpenRLHF flag --algo.kl.new_thing" in capsys.readouterr().err


def test_a_discounted_reward_kl_is_refused(tmp_path, capsys):
    src = tmp_path / "run.sh"
    src.write_text("python3 -m openrlhf.cli.train_ppo_ray --algo.advantage.gamma 0.9 --algo.kl.init_coef 0.01\n")
    assert main([str(src)]) == 2
    assert "--algo.advantage.gamma 0.9 discounts the KL in the reward" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------- TRL's fields as data
def test_trl_fields_are_the_installed_trls():
    pytest.importorskip("trl")
    from klgrpo.apps.explain.trl_fields import FIELDS
    from tools.trl_fields import declared_type, default_of, parsed_dataclasses, type_name

    theirs = {f.name: (cls.__name__, type_name(declared_type(cls, f.name)), default_of(f))
              for cls in parsed_dataclasses() for f in dataclasses.fields(cls)}
    assert FIELDS == theirs


def test_explaining_a_trl_config_imports_no_trl(tmp_path):
    code = ("import sys; from klgrpo.apps.explain import main; "
            f"rc = main([{str(EXAMPLES / 'trl_grpo_config.yaml')!r}]); "
            "sys.exit(rc or ('trl' in sys.modules and 5))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_another_installed_trl_is_named(monkeypatch):
    import importlib.metadata

    from klgrpo.apps.explain import command

    monkeypatch.setattr(importlib.metadata, "version", lambda name: "1.17.2")
    assert command._version_note("trl") == ["TRL 1.17.2 is installed; explain used TRL 1.16.0's fields and defaults"]
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "1.16.3")
    assert command._version_note("trl") == [] and command._version_note("verl") == []


# ----------------------------------------------------------------------------------------------- hostile inputs
def _hostile(tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    """name -> (arguments, a phrase the one line must hold); each writes its input under tmp_path."""
    def put(name: str, data: str | bytes) -> str:
        path = tmp_path / name
        path.write_bytes(data if isinstance(data, bytes) else data.encode())
        return str(path)

    folder = tmp_path / "a_folder"
    folder.mkdir()
    unreadable = put("secret.yaml", "beta: 0.1\n")
    os.chmod(unreadable, 0)
    if os.access(unreadable, os.R_OK):  # root reads it anyway: a path through a file stands in
        unreadable += "/inner.yaml"
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    deep = "a:\n" + "".join("  " * i + f"k{i}:\n" for i in range(1, MAX_DEPTH + 5)) + "  " * (MAX_DEPTH + 5) + "x: 1\n"
    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n" for p, c in zip("abcdefgh", "bcdefghi"))
    return {
        "binary": ([put("model.bin", bytes(range(256)) * 8)], "is a binary file"),
        "png": ([put("plot.png", b"\x89PNG\r\n\x1a\n" + bytes(300))], "is a binary file"),
        "latin-1": ([put("latin.yaml", "beta: caf\xe9\n".encode("latin-1"))], "is not UTF-8 text"),
        "too large": ([put("big.yaml", "beta: " + "x" * (MAX_BYTES + 10) + "\n")], "more than"),
        "one 1 MB value": ([put("huge.yaml", "x" * (1 << 20) + ": 1\n")], "more than"),
        "empty": ([put("empty.yaml", "")], "is empty"),
        "blank": ([put("blank.yaml", "\n  \n\t\n")], "is empty"),
        "folder": ([str(folder)], "is a folder"),
        "missing": ([str(tmp_path / "nope.yaml")], "no such file"),
        "unreadable": ([unreadable], "cannot be read"),
        "fifo": ([str(fifo)], "is not a regular file"),
        "device": (["/dev/zero"], "is not a regular file"),
        "deep yaml": ([put("deep.yaml", deep)], "nests deeper than"),
        "deep flow yaml": ([put("flow.yaml", "a: " + "[" * 5000 + "]" * 5000 + "\n")], "is not valid YAML"),
        "deep json": ([put("deep.json", '{"a": ' + "[" * 100000 + "]" * 100000 + "}")], "deep.json"),
        "alias bomb": ([put("bomb.yaml", bomb)], "holds more than"),
        "python tag": ([put("tag.yaml", "beta: !!python/object/apply:os.system ['touch x']\n")], "not valid YAML"),
        "custom tag": ([put("custom.yaml", "beta: !secret 0.1\n")], "not valid YAML"),
        "timestamp tag": ([put("date.yaml", "beta: 0.1\nseed: 2024-01-01\n")], "holds a date value"),
        "binary tag": ([put("bin.yaml", "beta: !!binary aGVsbG8=\n")], "holds a bytes value"),
        "yaml list": ([put("list.yaml", "- beta\n- 0.1\n")], "is none of the formats"),
        "scalar": ([put("word.yaml", "hello\n")], "is none of the formats"),
        "bad yaml": ([put("bad.yaml", "beta: [0.1\n")], "is not valid YAML"),
        "two launchers": ([put("both.sh", "python3 -m verl.trainer.main_ppo a=1\n"
                                          "python3 -m openrlhf.cli.train_ppo_ray --algo.kl.use_loss\n")],
                          "launches both verl and OpenRLHF"),
        "two runs": ([put("two.sh", "python3 -m verl.trainer.main_ppo a=1\npython3 -m verl.trainer.main_ppo a=2\n")],
                     "launches 2 runs (lines 1, 2)"),
        "no launcher": ([put("other.sh", "#!/bin/bash\necho hello\n")], "runs none of verl's trainers"),
        "unclosed quote": ([put("quote.sh", "python3 -m verl.trainer.main_ppo a='1\n")], "unclosed quote"),
        "python syntax": ([put("broken.py", "from trl import GRPOConfig\nGRPOConfig(beta=\n")], "is not valid Python"),
        "deep python": ([put("deep.py", "x = " + "(" * 10000 + ")" * 10000 + "\n")], "deep.py"),
        "python without a config": ([put("plain.py", "import os\nprint(1)\n")], "without a GRPOConfig"),
        "unknown framework": ([put("deepspeed.json", '{"zero_optimization": {"stage": 3}}')], "is none of the formats"),
        "binary stdin": (["-"], "is a binary file"),
    }


def test_hostile_inputs_end_in_one_line_and_write_nothing(tmp_path, capsys, monkeypatch):
    import io

    cases = _hostile(tmp_path)
    assert len(cases) >= 30
    before = sorted(p.name for p in tmp_path.iterdir())
    for name, (arguments, phrase) in cases.items():
        monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(bytes(range(256)))))
        code = main([*arguments, "--write", str(tmp_path / "w.yaml"), "--json", str(tmp_path / "r.json")])
        captured = capsys.readouterr()
        assert code == 2 and captured.out == "", (name, captured)
        assert captured.err.count("\n") == 1 and phrase in captured.err, (name, captured.err)
        assert arguments == ["-"] or os.path.basename(arguments[0]) in captured.err, (name, captured.err)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no file written, none executed


def test_binary_stdin_through_the_cli_is_one_line():
    done = subprocess.run([sys.executable, "-m", "klgrpo", "explain", "-"], input=bytes(range(256)) * 4,
                          capture_output=True, cwd=ROOT, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    err = done.stderr.decode()
    assert done.returncode == 2 and err.count("\n") == 1 and "<stdin>: is a binary file" in err, err


# --------------------------------------------------------------------------------------------------------- outputs
def test_write_never_replaces_a_file_unless_asked(tmp_path, capsys):
    src = tmp_path / "trl.yaml"
    src.write_text("beta: 0.04\n")
    assert main([str(src), "--write", str(src)]) == 2
    assert f"--write {src} is {src}, an input of this command; pass another path" in capsys.readouterr().err
    assert src.read_text() == "beta: 0.04\n"
    assert main([str(src), "--write", str(src), "--overwrite"]) == 2  # an input is never an output
    assert src.read_text() == "beta: 0.04\n"
    existing = tmp_path / "mine.yaml"
    existing.write_text("my notes\n")
    assert main([str(src), "--write", str(existing)]) == 2
    assert "exists; pass another path, or --overwrite" in capsys.readouterr().err
    assert existing.read_text() == "my notes\n"
    assert main([str(src), "--write", str(existing), "--overwrite"]) == 0
    assert existing.read_text().startswith("# klgrpo config for")


@pytest.mark.parametrize("where, message", [
    ("missing/r.json", "the folder {tmp}/missing does not exist"),
    ("trl.yaml/r.json", "the folder {tmp}/trl.yaml does not exist"),
    ("trl.yaml", "an input of this command"),
    ("", "is empty"),
])
def test_json_into_a_folder_that_is_not_there_or_onto_the_input_is_one_line(tmp_path, capsys, where, message):
    src = tmp_path / "trl.yaml"
    src.write_text("beta: 0.04\n")
    out = str(tmp_path / where) if where else ""
    assert main([str(src), "--json", out]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert message.format(tmp=tmp_path) in captured.err, captured.err
    assert src.read_text() == "beta: 0.04\n"


# ------------------------------------------------------------------------------------------------------ the docs
def _doc_commands() -> list[tuple[str, list[str]]]:
    """(command, the lines the page shows under it) for every ``$ klgrpo explain`` block of docs/explain.md."""
    text = (ROOT / "docs" / "explain.md").read_text()
    out = []
    for block in text.split("```")[1::2]:
        lines = block.strip("\n").splitlines()
        if lines and lines[0].startswith("$ klgrpo explain "):
            out.append((lines[0][2:], lines[1:]))
    return out


def test_the_docs_worked_examples_are_the_commands_output(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    commands = _doc_commands()
    assert len(commands) >= 10
    for command, shown in commands:
        argv = command.split()[2:]
        assert main(argv) == 0, command
        printed = capsys.readouterr().out.splitlines()
        cut = next((i for i, line in enumerate(printed) if line.startswith("  klgrpo config (--write")), len(printed))
        assert printed[:cut] == shown, command


def test_every_example_explains_and_the_docs_show_them_verbatim(tmp_path):
    docs = (ROOT / "docs" / "explain.md").read_text()
    for path in sorted(p for p in EXAMPLES.iterdir() if p.is_file()):
        _report(tmp_path, path)
        if path.name != "unsloth_train.py":  # the docs name it; its verdict is unsloth_dynamic.yaml's (tested above)
            assert path.read_text().rstrip() in docs, path.name
    assert (ROOT / "docs" / "explain_run.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


# ------------------------------------------------------------------------------ refused settings and --version
def _one_line_refusal(capsys, argv) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured
    return captured.err


VERL_REWARD_KL = "algorithm:\n  adv_estimator: grpo\n  use_kl_in_reward: true\n  kl_ctrl:\n    kl_coef: {}\n"
VERL_LOSS_KL = "actor_rollout_ref:\n  actor:\n    use_kl_loss: true\n    kl_loss_coef: 0.001\n    kl_loss_type: {}\n"


@pytest.mark.parametrize("value, shown", [(".nan", "nan"), (".NaN", "nan"), (".inf", "inf"), ("-.inf", "-inf")])
def test_a_verl_reward_kl_coefficient_that_is_no_finite_number_is_refused(tmp_path, capsys, value, shown):
    (tmp_path / "cfg.yaml").write_text(VERL_REWARD_KL.format(value))
    err = _one_line_refusal(capsys, [str(tmp_path / "cfg.yaml")])
    assert f"algorithm.kl_ctrl.kl_coef must be a finite number, got {shown}" in err, err


@pytest.mark.parametrize("value", ["nan", ".inf"])
def test_a_verl_launch_script_coefficient_that_is_no_finite_number_is_refused(tmp_path, capsys, value):
    (tmp_path / "run.sh").write_text("python3 -m verl.trainer.main_ppo \\\n  algorithm.adv_estimator=grpo \\\n"
                                     f"  actor_rollout_ref.actor.use_kl_loss=True \\\n"
                                     f"  actor_rollout_ref.actor.kl_loss_coef={value}\n")
    err = _one_line_refusal(capsys, [str(tmp_path / "run.sh")])
    assert "line 1: actor_rollout_ref.actor.kl_loss_coef must be a" in err, err


@pytest.mark.parametrize("key, text", [
    ("actor_rollout_ref.actor.kl_loss_type", VERL_LOSS_KL.format("bogus")),
    ("algorithm.kl_penalty", "algorithm:\n  adv_estimator: grpo\n  use_kl_in_reward: true\n  kl_penalty: bogus\n"),
])
def test_an_unknown_verl_kl_type_names_the_value_and_the_accepted_ones(tmp_path, capsys, key, text):
    (tmp_path / "cfg.yaml").write_text(text)
    err = _one_line_refusal(capsys, [str(tmp_path / "cfg.yaml")])
    assert f"{key} 'bogus' is no KL type of any verl release" in err, err
    assert all(name in err for name in ("kl, abs, mse", "low_var_kl", "k3+")), err


def test_a_verl_kl_type_of_another_release_names_that_releases_types(tmp_path, capsys):
    (tmp_path / "cfg.yaml").write_text(VERL_LOSS_KL.format("k3+"))
    err = _one_line_refusal(capsys, [str(tmp_path / "cfg.yaml"), "--version", "verl==0.3"])
    assert "kl_loss_type 'k3+' is not a KL type of verl >= 0.2, < 0.4.0 (it has: kl, abs, mse, low_var_kl, full)" in err


TRL_SCRIPT = "from trl import GRPOConfig\nconfig = GRPOConfig(beta=0.04)\n"


@pytest.mark.parametrize("spec, said", [
    ("trl==0.18;trl==0.19", "trl==0.18,==0.19"),
    ("trl>=0.20,<0.19", "trl>=0.20,<0.19"),
    ("trl==0.18,!=0.18", "trl==0.18,!=0.18"),
    ("trl==0.18.1 trl!=0.18", "trl==0.18.1,!=0.18"),
    ("nemo_rl==0.5.0;nemo_rl==0.6.0", "nemo_rl==0.5.0,==0.6.0"),
])
def test_a_version_spec_no_release_satisfies_is_refused(tmp_path, capsys, spec, said):
    (tmp_path / "train.py").write_text(TRL_SCRIPT)
    err = _one_line_refusal(capsys, [str(tmp_path / "train.py"), "--version", spec])
    assert f"--version {spec}: no {said.split('=')[0].rstrip('<>!~')} release satisfies {said}" in err, err


@pytest.mark.parametrize("spec", ["trl>=0.18,<0.20", "trl==0.18;trl>=0.18", "trl>=0.19,<=0.19", "trl==0.18,!=0.18.0"])
def test_a_version_spec_some_release_satisfies_is_read(tmp_path, spec):
    (tmp_path / "train.py").write_text(TRL_SCRIPT)
    assert _report(tmp_path, tmp_path / "train.py", "--version", spec)["source"] == "trl"


@pytest.mark.parametrize("spec", ["trl==" + "1" * 5000, "trl==0.18;" + "x" * 300])
def test_a_version_spec_no_file_can_be_named_by_is_one_line(tmp_path, capsys, spec):
    (tmp_path / "train.py").write_text(TRL_SCRIPT)
    err = _one_line_refusal(capsys, [str(tmp_path / "train.py"), "--version", spec])
    assert len(err) < 400 and "--version trl==" in err, err


@pytest.mark.parametrize("spec, said", [
    ("trl==\uff10.\uff11\uff18",
     "--version 'trl==\uff10.\uff11\uff18': version '\uff10.\uff11\uff18' is no release number"),
    ("trl>=", "--version 'trl>=': version '' is no release number"),
    ("trl==0.5", "--version trl==0.5 is outside every TRL release range klgrpo knows (0.14.0 and later"),
    ("{nul}", "--version {nul}: is a binary file: pass a project file that pins the release"),
])
def test_a_version_spec_that_is_no_release_is_said_as_the_versions(tmp_path, capsys, spec, said):
    """Full-width digits, an empty version, a release older than every table row, a binary file: each line
    names --version (and is no verdict on another release)."""
    (tmp_path / "train.py").write_text(TRL_SCRIPT)
    (tmp_path / "req.txt").write_bytes(b"trl==0.18\x00\n")
    spec, said = (x.replace("{nul}", str(tmp_path / "req.txt")) for x in (spec, said))
    err = _one_line_refusal(capsys, [str(tmp_path / "train.py"), "--version", spec])
    assert said in err, err


def _notebook(path, *cells):
    path.write_text(json.dumps({"cells": list(cells), "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    return str(path)


@pytest.mark.parametrize("source, shown", [
    (42, "int 42"), ({"code": "x = 1"}, "dict {'code': 'x = 1'}"), (["x = 1\n", 5], "list ['x = 1\\n', 5]"),
    (None, "NoneType None"), ([["nested"]], "list [['nested']]"), (list(range(100)), "list [0, 1, 2,"),
])
def test_a_notebook_cell_whose_source_is_not_text_is_one_line_naming_the_cell(tmp_path, capsys, source, shown):
    # cells: a markdown cell, a good code cell, then the bad one: the second code cell
    path = _notebook(tmp_path / "nb.ipynb", {"cell_type": "markdown", "metadata": {}, "source": ["# title"]},
                     {"cell_type": "code", "metadata": {}, "outputs": [], "source": ["from trl import GRPOConfig\n"]},
                     {"cell_type": "code", "metadata": {}, "outputs": [], "source": source})
    err = _one_line_refusal(capsys, [path])
    assert f"nb.ipynb: code cell 2: its source is {shown}" in err and "not text" in err, err
    assert len(err) < 300, err  # a long source is shown cut
