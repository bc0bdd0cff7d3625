"""`klgrpo train` driven through bad inputs (configs, datasets, rewards, paths, checkpoints), as a new user
would type them. For each: a non-zero exit, ONE line on stderr naming the field / file / row and the remedy,
no traceback, and no run folder left half-written (none created, or the one that was there unchanged)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REWARDS_PY = '''
def huge(prompts, completions, **kw):
    return [1e38] * len(completions)

def not_a_number(prompts, completions, **kw):
    return [float("nan")] * len(completions)

def boom(prompts, completions, **kw):
    raise ValueError("the grader crashed")

def short(prompts, completions, **kw):
    return [1.0]

def quits(prompts, completions, **kw):
    import sys
    sys.exit(0)
'''

# "Billion laughs": ten aliases nested nine deep expand to 10**9 values.
ALIAS_BOMB = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{n}: &{n} [{', '.join(['*' + p] * 10)}]\n" for p, n in zip("abcdefgh", "bcdefghi"))


class Ctx:
    """Files of one case, in a fresh folder; ``out`` is the run folder the case names."""

    def __init__(self, model: Path, data: Path, finished_run: Path, root: Path):
        self.model, self.data, self.finished_run, self.root = model, data, finished_run, root
        self.out = root / "run"
        self.live: subprocess.Popen | None = None

    def base(self, *extra, model=None, data=None, out=None) -> list[str]:
        return ["--model.name_or_path", str(model or self.model), "--data.source", str(data or self.data),
                "--output-dir", str(out or self.out), "--rollout.group_size", "4", "--rollout.prompts_per_step", "4",
                "--rollout.max_new_tokens", "4", "--train.steps", "1", "--logging.progress", "false",
                "--logging.tensorboard", "false", "--logging.plots", "false", *extra]

    def file(self, name: str, content: str | bytes) -> Path:
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
        return path

    def existing_run(self) -> Path:
        shutil.copytree(self.finished_run, self.out)
        return self.out

    def rewards(self, fn: str) -> str:
        return f"[{{name: '{self.file('my_rewards.py', REWARDS_PY)}:{fn}'}}]"

    def lock_by_live_process(self) -> None:
        import json

        self.live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / ".klgrpo.lock").write_text(json.dumps({"pid": self.live.pid, "host": socket.gethostname()}))


def _corrupt(ctx: Ctx, name: str, keep: int) -> Path:
    run = ctx.existing_run()
    path = run / "checkpoints" / "step_1" / name
    path.write_bytes(path.read_bytes()[:keep])
    return run / "checkpoints" / "step_1"


def _legacy(ctx: Ctx) -> Path:
    run = ctx.existing_run()
    step = run / "checkpoints" / "step_1"
    for f in ("trainer_state.json", "trainer_state.safetensors"):
        (step / f).unlink()
    (step / "trainer_state.pt").write_bytes(b"\x80\x04N.")
    return step


# (id, arguments after `klgrpo train`, what the line must contain: the field/file/row, and the remedy)
CASES = [
    # ---- config values
    ("lr_inf", lambda c: c.base("--optim.lr", ".inf"), ["optim.lr is inf", "finite number"]),
    ("lr_nan", lambda c: c.base("--optim.lr", "nan"), ["optim.lr is NaN", "give it a number"]),
    ("lr_negative", lambda c: c.base("--optim.lr", "-1e-4"), ["optim.lr must be > 0"]),
    ("save_every_negative", lambda c: c.base("--train.save_every", "-1"), ["train.save_every must be >= 0"]),
    ("wall_negative", lambda c: c.base("--train.max_wall_seconds", "-5"), ["train.max_wall_seconds must be >= 0"]),
    ("temperature_inf", lambda c: c.base("--rollout.temperature", ".inf"), ["rollout.temperature is inf"]),
    ("top_k_negative", lambda c: c.base("--rollout.top_k", "-1"), ["rollout.top_k must be >= 0", "turns top-k off"]),
    ("warmup_negative", lambda c: c.base("--optim.warmup_steps", "-3"), ["optim.warmup_steps must be >= 0"]),
    ("eps_low_above_one", lambda c: c.base("--loss.eps_low", "1.5"), ["loss.eps_low must be in [0, 1]"]),
    ("coef_text", lambda c: c.base("--kl.coef", "abc"), ["kl.coef in command line must be float"]),
    ("field_typo", lambda c: c.base("--kl.coeff", "0.1"), ["'kl.coeff'", "did you mean kl.coef"]),
    ("bad_choice", lambda c: c.base("--kl.estimator", "k4"), ["kl.estimator", "choose one of"]),
    ("group_of_one", lambda c: c.base("--rollout.group_size", "1"), ["rollout.group_size must be >= 2"]),
    ("group_fraction", lambda c: c.base("--rollout.group_size", "2.5"), ["rollout.group_size", "must be int"]),
    ("micro_batch", lambda c: c.base("--train.micro_batch_size", "5"), ["train.micro_batch_size=5", "divide"]),
    ("beta2_one", lambda c: c.base("--optim.beta2", "1"), ["optim.beta2", "[0, 1)"]),
    ("skips_zero", lambda c: c.base("--train.max_skipped_steps", "0"), ["train.max_skipped_steps must be >= 1"]),
    ("top_p_zero", lambda c: c.base("--rollout.top_p", "0"), ["rollout.top_p must be in (0, 1]"]),
    ("decay_two", lambda c: c.base("--kl.decay", "2"), ["kl.decay must be in (0, 1]"]),
    ("steps_zero", lambda c: c.base("--train.steps", "0"), ["train.steps must be >= 1"]),
    ("weight_inf", lambda c: c.base("--rewards.functions", "[{name: exact_match, weight: .inf}]"),
     ["rewards.functions[0].weight", "finite"]),
    ("clamp_negative", lambda c: c.base("--kl.log_ratio_clamp", "-1"), ["kl.log_ratio_clamp must be >= 0"]),
    ("replay_without_source", lambda c: c.base("--kl.replay.coef", "1"), ["kl.replay.source"]),
    ("no_data", lambda c: c.base("--data.source", ""), ["data.source is empty", "name a prompt file"]),
    ("broken_yaml_value", lambda c: c.base("--kl.coef", "[1,"), ["kl.coef", "not a valid value"]),
    ("no_rewards", lambda c: c.base("--rewards.functions", "[]"), ["rewards.functions is empty"]),
    ("seed_negative", lambda c: c.base("--train.seed", "-1"), ["train.seed must be an integer in [0, 4294967295]"]),
    ("seed_too_big", lambda c: c.base("--train.seed", str(2**32)), ["train.seed", "4294967295"]),
    ("yaml_alias_bomb", lambda c: c.base("--config", str(c.file("c.yaml", ALIAS_BOMB + "rewards:\n  functions:\n"
                                                                     "    - {name: format, kwargs: {pattern: '0', "
                                                                     "bomb: *i}}\n"))),
     ["c.yaml", "aliases", "expand to more than"]),
    ("yaml_alias_bomb_value", lambda c: c.base("--eval.sets", "[" + ALIAS_BOMB.replace("\n", ", ").rstrip(", ") + "]"),
     ["eval.sets", "expand to more than"]),
    ("dist_timeout_zero", lambda c: c.base("--train.dist_timeout_s", "0"), ["train.dist_timeout_s must be > 0"]),
    # ---- arguments and paths
    ("config_missing", lambda c: c.base("--config", str(c.root / "missing.yaml")), ["missing.yaml does not exist"]),
    ("config_folder", lambda c: c.base("--config", str(c.root)), ["is a folder", "pass --config a YAML file"]),
    ("config_not_utf8", lambda c: c.base("--config", str(c.file("c.yaml", b"kl:\n  coef: \xff\n"))),
     ["c.yaml", "UTF-8"]),
    ("config_bad_yaml", lambda c: c.base("--config", str(c.file("c.yaml", "kl: [\n"))), ["c.yaml is not valid YAML"]),
    ("config_tab_indent", lambda c: c.base("--config", str(c.file("c.yaml", "kl:\n\tcoef: 0.1\n"))),
     ["c.yaml, line 2 column 1", "a tab character", "use spaces"]),
    ("config_a_list", lambda c: c.base("--config", str(c.file("c.yaml", "- 1\n"))), ["c.yaml must hold a mapping"]),
    ("config_unknown_field", lambda c: c.base("--config", str(c.file("c.yaml", "kl:\n  coeff: 1\n"))),
     ["kl.coeff", "c.yaml", "did you mean kl.coef"]),
    ("positional", lambda c: c.base("foo"), ["unexpected argument 'foo'"]),
    ("option_without_value", lambda c: c.base("--kl.coef"), ["--kl.coef needs a value"]),
    ("resume_nothing", lambda c: c.base("--resume", "latest"), ["no checkpoint in", "--output-dir"]),
    ("resume_not_a_checkpoint", lambda c: c.base("--resume", str(c.root / "nowhere")), ["not a checkpoint folder"]),
    ("resume_without_output_dir", lambda c: ["--model.name_or_path", str(c.model), "--resume", "latest"],
     ["--resume latest needs --output-dir"]),
    ("output_dangling_link", lambda c: c.base(out=_link(c.root / "dangling", c.root / "nowhere")),
     ["train.output_dir", "symbolic link to a missing folder"]),
    ("output_link_loop", lambda c: c.base(out=_link(c.root / "loop1", _link(c.root / "loop2", c.root / "loop1"))),
     ["train.output_dir", "a loop of links"]),
    ("model_weights_truncated", lambda c: c.base(model=_model_with(c, b"\x10\x00\x00\x00garbage")),
     ["model.name_or_path", "weights file cannot be read", "SafetensorError"]),
    ("model_weights_pickled", lambda c: c.base(model=_model_with(c, _PICKLE, "pytorch_model.bin")),
     ["model.name_or_path", "weights file cannot be read", "UnpicklingError"]),
    ("output_is_file", lambda c: c.base(out=c.file("taken", "x")), ["train.output_dir", "is a file"]),
    ("output_inside_file", lambda c: c.base(out=c.file("taken", "x") / "run"), ["inside", "which is a file"]),
    ("output_read_only", lambda c: c.base(out="/proc/klgrpo_cannot_write/run"), ["cannot write in /proc",
                                                                                 "writable folder"]),
    ("existing_run", lambda c: [c.existing_run(), *c.base()][1:], ["already holds a run", "--resume latest",
                                                                   "--output-dir", "--overwrite"]),
    ("resume_and_overwrite", lambda c: [c.existing_run(), *c.base("--resume", "latest", "--overwrite")][1:],
     ["--resume", "--overwrite", "only one"]),
    ("resume_changed_group", lambda c: [c.existing_run(), *c.base("--resume", "latest", "--rollout.group_size",
                                                                  "8")][1:], ["rollout.group_size 4 -> 8",
                                                                              "--output-dir"]),
    ("resume_changed_seed", lambda c: [c.existing_run(), *c.base("--resume", "latest", "--train.seed", "5")][1:],
     ["train.seed 0 -> 5"]),
    ("locked_folder", lambda c: [c.lock_by_live_process(), *c.base()][1:], ["being written by another klgrpo run",
                                                                             "another --output-dir"]),
    ("device_garbage", lambda c: c.base("--model.device", "tpu9"), ["model.device='tpu9'", "cpu"]),
    ("model_path_typo", lambda c: c.base(model=c.root / "modles" / "tiny"), ["model.name_or_path", "no such folder"]),
    ("model_is_file", lambda c: c.base(model=c.file("weights.bin", "x")), ["model.name_or_path", "is a file"]),
    ("reference_missing", lambda c: c.base("--kl.reference", str(c.root / "ref_typo")),
     ["kl.reference", "no such folder"]),
    ("tokenizer_missing", lambda c: c.base("--model.tokenizer", "./tok_typo"), ["model.tokenizer", "no such folder"]),
    # ---- datasets
    ("data_missing", lambda c: c.base(data=c.root / "nope.jsonl"), ["nope.jsonl not found", "data.source"]),
    ("data_not_utf8", lambda c: c.base(data=c.file("d.jsonl", b'{"prompt": "1+1="}\n{"prompt": "\xff"}\n')),
     ["d.jsonl line 2", "not UTF-8", "save the file as UTF-8"]),
    ("data_bad_json", lambda c: c.base(data=c.file("d.jsonl", '{"prompt": "1"}\n{"prompt": \n')),
     ["d.jsonl line 2 is not valid JSON"]),
    ("data_no_prompt_column", lambda c: c.base(data=c.file("d.jsonl", '{"question": "1"}\n')),
     ["d.jsonl has no column 'prompt'"]),
    ("data_bad_extension", lambda c: c.base(data=c.file("d.txt", "1+1=\n")), ["d.txt", "extension", "convert"]),
    ("data_empty", lambda c: c.base(data=c.file("d.jsonl", "")), ["d.jsonl contains no rows"]),
    ("data_empty_prompt", lambda c: c.base(data=c.file("d.jsonl", '{"prompt": "1"}\n{"prompt": ""}\n')),
     ["line 2", "empty"]),
    ("eval_missing", lambda c: c.base("--eval.sets", f"[{{name: t, source: {c.root / 'ev.jsonl'}}}]"),
     ["ev.jsonl", "eval.sets[0].source"]),
    ("eval_without_name", lambda c: c.base("--eval.sets", "[{source: x.jsonl}]"), ["eval.sets[0] needs a name"]),
    ("replay_missing", lambda c: c.base("--kl.replay.coef", "1", "--kl.replay.source", str(c.root / "rp.jsonl")),
     ["rp.jsonl", "kl.replay.source"]),
    # ---- rewards
    ("reward_unknown", lambda c: c.base("--rewards.functions", "[exact_matc]"), ["exact_matc"]),
    ("reward_file_missing", lambda c: c.base("--rewards.functions", "['nofile.py:score']"), ["nofile.py"]),
    ("reward_huge", lambda c: c.base("--rewards.functions", c.rewards("huge")), ["huge", "1e+38", "rescale"]),
    ("reward_nan", lambda c: c.base("--rewards.functions", c.rewards("not_a_number")), ["not_a_number", "finite"]),
    ("reward_raises", lambda c: c.base("--rewards.functions", c.rewards("boom")), ["boom", "the grader crashed"]),
    ("reward_short", lambda c: c.base("--rewards.functions", c.rewards("short")), ["short", "returned 1 values"]),
    ("reward_sys_exit", lambda c: c.base("--rewards.functions", c.rewards("quits")), ["quits", "sys.exit(0)"]),
    ("prompt_beyond_context", lambda c: c.base(data=c.file("d.jsonl", '{"prompt": "' + "1+" * 40 + '1="}\n')),
     ["prompt 0 of", "more than the model's context of 32", "rollout.max_new_tokens"]),
    ("reward_weight_text", lambda c: c.base("--rewards.functions", "[{name: exact_match, weight: heavy}]"),
     ["weight", "heavy"]),
    ("reward_model_not_a_classifier", lambda c: c.base("--rewards.functions", f"[{{model: {c.model}}}]"),
     ["is not a sequence classifier", "architectures LlamaForCausalLM", "AutoModelForSequenceClassification"]),
    ("reward_model_several_labels", lambda c: c.base("--rewards.functions", f"[{{model: {_reward_model(c, 2)}}}]"),
     ["has a head of 2 labels", "set label in its rewards.functions entry"]),
    ("reward_model_batch_size", lambda c: c.base("--rewards.functions", "[{model: rm, batch_size: 0}]"),
     ["rewards.functions[0]", "batch_size must be an integer >= 1"]),
    # ---- checkpoints
    ("checkpoint_truncated_weights", lambda c: c.base("--resume", str(_corrupt(c, "model.safetensors", 50))),
     ["step_1/model.safetensors cannot be read", "intact checkpoint"]),
    ("checkpoint_truncated_state", lambda c: c.base("--resume", str(_corrupt(c, "trainer_state.safetensors", 20))),
     ["trainer_state.safetensors cannot be read"]),
    ("checkpoint_bad_json", lambda c: c.base("--resume", str(_corrupt(c, "trainer_state.json", 10))),
     ["trainer_state.json is not a klgrpo state file"]),
    ("checkpoint_pickled", lambda c: c.base("--resume", "latest", out=_legacy(c).parent.parent),
     ["trainer_state.pt", "unpickling can run code"]),
]

_PICKLE = b"\x80\x04\x95\x0b\x00\x00\x00\x00\x00\x00\x00}\x94\x8c\x01a\x94K\x01s."  # pickle.dumps({"a": 1})


def _link(path: Path, target: Path) -> Path:
    path.symlink_to(target)
    return path


def _reward_model(c: Ctx, num_labels: int) -> Path:
    from tests.helpers.reward_model import build_reward_model, rm_tokenizer, save_reward_model

    tokenizer = rm_tokenizer()
    return Path(save_reward_model(c.root / "rm", build_reward_model(tokenizer, num_labels=num_labels), tokenizer))


def _model_with(c: Ctx, weights: bytes, name: str = "model.safetensors") -> Path:
    """A copy of the tiny model folder whose weights file is ``weights`` (and named ``name``)."""
    folder = c.root / "broken_model"
    shutil.copytree(c.model, folder)
    (folder / "model.safetensors").unlink()
    (folder / name).write_bytes(weights)
    return folder


if not torch.cuda.is_available():
    CASES.append(("device_cuda_without_gpu", lambda c: c.base("--model.device", "cuda"),
                  ["model.device='cuda'", "no CUDA GPU", "--model.device cpu"]))


@pytest.fixture(scope="module")
def finished_run(tiny_model_dir, addition_file, tmp_path_factory):
    from klgrpo.apps.cli import main

    out = tmp_path_factory.mktemp("finished") / "run"
    ctx = Ctx(tiny_model_dir, addition_file, out, out.parent)
    assert main(["train", *ctx.base(out=out)]) == 0
    return out


def _snapshot(folder: Path) -> dict[str, bytes] | None:
    if not folder.exists():
        return None
    if folder.is_file():
        return {"": folder.read_bytes()}
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else b"<dir>")
            for p in sorted(folder.rglob("*"))}


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_one_line(case, tiny_model_dir, addition_file, finished_run, tmp_path, capsys):
    from klgrpo.apps.cli import main

    name, make_args, expected = case
    ctx = Ctx(tiny_model_dir, addition_file, finished_run, tmp_path)
    try:
        args = make_args(ctx)
        out = Path(args[args.index("--output-dir") + 1]) if "--output-dir" in args else ctx.out
        before = _snapshot(out)
        capsys.readouterr()
        code = main(["train", *map(str, args)])
        err = capsys.readouterr().err
    finally:
        if ctx.live is not None:
            ctx.live.kill()
            ctx.live.wait()
    lines = err.strip().splitlines()
    assert code != 0, name
    assert len(lines) == 1, err
    assert "Traceback" not in err and lines[0].startswith("klgrpo train: error: ")
    for text in expected:
        assert text in lines[0], (text, lines[0])
    assert _snapshot(out) == before, "the run folder was created or changed"
    assert not list(tmp_path.rglob(".tmp_step_*")) and not list(tmp_path.rglob(".*.tmp"))


def test_there_are_at_least_forty_cases():
    assert len(CASES) >= 40


def test_a_bare_double_dash_ends_nothing_and_is_skipped():
    """`klgrpo train --config c.yaml -- --kl.coef 0`, as a sweep's command line reads, means the same as without
    the `--` (every override is an option), not "unexpected argument '0'"."""
    from klgrpo.apps.args import read_argv

    with_dash = read_argv(["--config", "c.yaml", "--", "--kl.coef", "0", "--optim.lr=1e-4"])
    without = read_argv(["--config", "c.yaml", "--kl.coef", "0", "--optim.lr=1e-4"])
    assert with_dash == without and with_dash.overrides == {"kl.coef": "0", "optim.lr": "1e-4"}
