"""Hostile inputs on klgrpo's command line: every case runs ``python -m klgrpo ...`` as a subprocess with a
timeout and is classified by what a user sees.

    .venv/bin/python tools/hostile_inputs.py               # every case, a table and the totals
    .venv/bin/python tools/hostile_inputs.py --only explain  # the cases whose name holds "explain"
    .venv/bin/python tools/hostile_inputs.py --json out.json

Outcomes: ``one line`` (exit 2, one error line on stderr, naming what the case expects it to name), ``accepted``
(exit 0), ``traceback`` (a Python traceback or an exit status other than 0, 2 and 3), ``hang`` (past the
timeout), ``silent`` (a bad value accepted with exit 0, or exit 2 with nothing said), ``multi-line`` (exit 2
with several error lines), ``vague`` (one line that does not name the field or file), ``changed`` (a file the
case guards was changed or removed). A case passes when its outcome is the one it expects.

The cases are data (CASES): ``args`` with ``{placeholders}`` filled from the workspace the script builds in a
temporary folder (a tiny local model, a prompt file, a finished two-step run, YAML files, a FIFO, ...);
``expect`` is ``refuse`` (one line), ``accept`` or ``either``; ``names`` the words the line must hold;
``guard`` the workspace paths that must be byte for byte the same afterwards. Cases run one at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 60

# the tiny run every train case starts from: a local model, 2 prompts x 2 completions, 1 step, no trackers
BASE = {
    "model": {"name_or_path": "{model}", "dtype": "float32", "device": "cpu"},
    "data": {"source": "{data}"},
    "rollout": {"group_size": 2, "prompts_per_step": 2, "max_new_tokens": 2},
    "rewards": {"functions": [{"name": "format", "kwargs": {"pattern": "0"}}]},
    "kl": {"coef": 0.1},
    "train": {"steps": 1, "seed": 0, "torch_threads": 1},
    "logging": {"progress": False, "tensorboard": False, "plots": False, "report_to": []},
}

P = ["train", "--config", "{base}", "--print-config"]  # the resolved config only
T = ["train", "--config", "{base}", "--output-dir", "{out}"]  # a real (one-step) run


def _refuse(name, args, *names, guard=(), stdin=None):
    return {"name": name, "args": args, "expect": "refuse", "names": list(names), "guard": list(guard),
            "stdin": stdin}


def _accept(name, args, guard=()):
    return {"name": name, "args": args, "expect": "accept", "names": [], "guard": list(guard), "stdin": None}


def _either(name, args, *names, guard=()):
    return {"name": name, "args": args, "expect": "either", "names": list(names), "guard": list(guard),
            "stdin": None}


def _train_cases() -> list[dict]:
    cases = []
    bad_masks = ["bogus", "2_1", "nan", ",,", "token_k1,,token_k2", "x" * 5000, "tökén_k1", "token_k1 token_k2",
                 "TOKEN_K1", "token_k1,token_k1", "'[token_k1]'"]
    for i, value in enumerate(bad_masks):
        for mode, base in (("print", P), ("train", T)):
            cases.append(_refuse(f"train/{mode}/divergence_mask#{i}", base + ["--rollout.divergence_mask", value],
                                 "rollout.divergence_mask"))
    cases.append(_accept("train/print/divergence_mask empty", P + ["--rollout.divergence_mask", "''"]))
    bad_thresholds = ["2_1", "nan", "nan_2", "0.5_inf", ",,", "abc", "-1", "0.5_2.0,0.1,0.2", "x" * 5000, "½_2",
                      "0_0", "inf"]
    for i, value in enumerate(bad_thresholds):
        for mode, base in (("print", P), ("train", T)):
            cases.append(_refuse(f"train/{mode}/divergence_threshold#{i}",
                                 base + ["--rollout.divergence_mask", "token_k1,token_k2",
                                         "--rollout.divergence_threshold", value], "rollout.divergence_threshold"))
    cases.append(_refuse("train/print/threshold without mask", P + ["--rollout.divergence_threshold", "0.5_2"],
                         "rollout.divergence_threshold"))
    cases.append(_accept("train/print/divergence ok", P + ["--rollout.divergence_mask", "token_k1",
                                                          "--rollout.divergence_threshold", "0.5_2.0"]))
    for value in ("bogus", "''", "nan", "[drop]", "DROP"):
        cases.append(_refuse(f"train/print/masked_tokens={value[:10]}", P + ["--kl.masked_tokens", value],
                             "kl.masked_tokens"))
    for value in ("bogus", "''", "1", "SAMPLER"):
        cases.append(_refuse(f"train/print/old_logprobs={value}", P + ["--rollout.old_logprobs", value],
                             "rollout.old_logprobs"))
    sampler = ["--rollout.old_logprobs", "sampler"]
    cases.append(_refuse("train/train/old_logprobs sampler+vllm", T + sampler + ["--rollout.sampler", "vllm"],
                         "rollout.old_logprobs"))
    cases.append(_refuse("train/train/old_logprobs sampler+bfloat16", T + sampler + ["--model.dtype", "bfloat16"],
                         "rollout.old_logprobs"))
    cases.append(_refuse("train/train/old_logprobs sampler+correction",
                         T + sampler + ["--rollout.sampler_correction", "token_truncate"], "rollout.old_logprobs"))
    cases.append(_refuse("train/print/old_logprobs sampler+vllm_server",
                         P + sampler + ["--rollout.sampler", "vllm_server", "--rollout.vllm.server_url",
                                        "http://127.0.0.1:9"], "rollout.old_logprobs"))
    for field in ("warn_ess_below", "warn_chi2_above"):
        for value in ("-1", "nan", "abc", ".inf", "-.inf", "[1]"):
            cases.append(_refuse(f"train/print/{field}={value}", P + [f"--rollout.{field}", value],
                                 f"rollout.{field}"))
        cases.append(_refuse(f"train/train/{field}=-0.5", T + [f"--rollout.{field}", "-0.5"], f"rollout.{field}"))
    cases.append(_refuse("train/print/warn_ess_below=2", P + ["--rollout.warn_ess_below", "2"],
                         "rollout.warn_ess_below"))
    for field, value in (("sampler_correction_min", "-1"), ("sampler_correction_max", "-1"),
                         ("sampler_correction_min", "nan"), ("sampler_correction_max", ".inf"),
                         ("sampler_correction_min", "5")):
        cases.append(_refuse(f"train/print/{field}={value}",
                             P + ["--rollout.sampler_correction", "token_truncate", f"--rollout.{field}", value],
                             "rollout.sampler_correction"))
    cases.append(_refuse("train/print/sampler_correction=bogus", P + ["--rollout.sampler_correction", "bogus"],
                         "rollout.sampler_correction"))
    server = P + ["--rollout.sampler", "vllm_server"]
    for i, url in enumerate(["''", "localhost:8000", "ftp://h:1", "http://", "http://h:99999", "http://h:abc",
                             "http://[::1", "x" * 5000, "http://h:8000/\x01"]):
        cases.append(_refuse(f"train/print/server_url#{i}", server + ["--rollout.vllm.server_url", url],
                             "rollout.vllm.server_url"))
    ok_url = server + ["--rollout.vllm.server_url", "http://127.0.0.1:9"]
    cases.append(_refuse("train/print/weights_dir file", ok_url + ["--rollout.vllm.weights_dir", "{data}"],
                         "rollout.vllm.weights_dir"))
    creatable = _either if os.geteuid() == 0 else _refuse  # root can make /nonexistent/x/y: then it is accepted
    cases.append(creatable("train/print/weights_dir missing parent",
                           ok_url + ["--rollout.vllm.weights_dir", "/nonexistent/x/y"], "rollout.vllm.weights_dir"))
    for field, value in (("server_timeout", "0"), ("server_timeout", "-5"), ("server_timeout", "nan"),
                         ("server_timeout", ".inf"), ("server_retries", "-1"), ("server_retries", "1.5"),
                         ("server_retries", "abc"), ("server_retries", "1000000")):
        cases.append(_refuse(f"train/print/{field}={value}", ok_url + [f"--rollout.vllm.{field}", value],
                             f"rollout.vllm.{field}"))
    for field, value in (("on_runaway", "bogus"), ("on_runaway", "''"), ("runaway_above", "-1"),
                         ("runaway_above", "nan"), ("runaway_beta_factor", "0"), ("runaway_beta_factor", "-2"),
                         ("runaway_lr_factor", "0"), ("runaway_lr_factor", ".inf"), ("runaway_max_rollbacks", "-1"),
                         ("runaway_max_rollbacks", "1.5"), ("warn_window", "0")):
        cases.append(_refuse(f"train/print/kl.{field}={value}",
                             P + ["--kl.on_runaway", "rollback", f"--kl.{field}", value], f"kl.{field}"))
    adaptive = ["--kl.controller", "adaptive"]
    for value in ("-1", "0", "inf", ".inf", "nan", "'auto '", "AUTO"):
        cases.append(_refuse(f"train/print/horizon={value}", P + adaptive + ["--kl.horizon", value], "kl.horizon"))
    cases.append(_refuse("train/print/horizon auto steps 0",
                         P + adaptive + ["--kl.horizon", "auto", "--train.steps", "0"], "train.steps"))
    cases.append(_accept("train/print/horizon auto", P + adaptive + ["--kl.horizon", "auto"]))
    for field, value in (("steps", "-1"), ("steps", "1.5"), ("steps", "1e3"), ("steps", "true"),
                         ("steps", "99999999999999999999999"), ("seed", "-1"), ("seed", "1.5"), ("seed", "abc"),
                         ("seed", "99999999999999999999999")):
        cases.append(_refuse(f"train/print/train.{field}={value}", P + [f"--train.{field}", value],
                             f"train.{field}"))
    cases.append(_refuse("train/train/train.steps=0", T + ["--train.steps", "0"], "train.steps"))
    return cases


def _yaml_cases() -> list[dict]:
    cases = []
    for name in ("empty.yaml", "list.yaml", "binary.yaml", "huge.yaml", "tabs.yaml", "nul.yaml", "anchors.yaml",
                 "scalar.yaml", "badgroup.yaml", "nested_list.yaml"):
        cases.append(_either(f"yaml/{name}", ["train", "--config", "{ws}/yaml/" + name, "--print-config"], name))
    cases.append(_refuse("yaml/a folder", ["train", "--config", "{ws}/yaml", "--print-config"], "yaml"))
    cases.append(_refuse("yaml/a FIFO", ["train", "--config", "{fifo}", "--print-config"], "fifo"))
    unreadable = _either if os.geteuid() == 0 else _refuse  # root reads a file of mode 000
    cases.append(unreadable("yaml/unreadable", ["train", "--config", "{ws}/yaml/unreadable.yaml", "--print-config"],
                            "unreadable.yaml"))
    cases.append(_refuse("yaml/missing", ["train", "--config", "{ws}/yaml/none.yaml", "--print-config"],
                         "none.yaml"))
    cases.append(_refuse("yaml/dev-zero", ["train", "--config", "/dev/zero", "--print-config"], "/dev/zero"))
    return cases


def _explain_cases() -> list[dict]:
    cases = []
    trl = "{ws}/explain/trl.py"
    specs = ["trl==0.1", "trl==0.18;trl==0.19", "x" * 5000, "{ws}/explain/nul_requirements.txt", "trl==０.１８",
             "trl>=", "trl", ";;", "unknownpkg==1.0", "trl==0.18;" * 500]
    for i, spec in enumerate(specs):
        cases.append(_refuse(f"explain/--version#{i}", ["explain", trl, "--version", spec], "--version"))
    for name in ("nb_bad_source.ipynb", "nb_not_json.ipynb", "nb_list.ipynb", "nb_no_cells.ipynb",
                 "nb_cells_dict.ipynb", "nb_empty.ipynb"):
        cases.append(_either(f"explain/{name}", ["explain", "{ws}/explain/" + name], name))
    for name in ("verl_nan.yaml", "verl_inf.yaml", "verl_bad_type.yaml", "verl_coef_str.yaml"):
        cases.append(_refuse(f"explain/{name}", ["explain", "{ws}/explain/" + name], "kl"))
    cases.append(_refuse("explain/a FIFO file", ["explain", "{fifo}"], "fifo"))
    cases.append(_refuse("explain/a folder", ["explain", "{ws}/explain"], "explain"))
    cases.append(_refuse("explain/binary", ["explain", "{ws}/yaml/binary.yaml"], "binary.yaml"))
    cases.append(_refuse("explain/--write over input", ["explain", trl, "--write", trl], "--write",
                         guard=["explain/trl.py"]))
    cases.append(_refuse("explain/--write existing", ["explain", trl, "--write", "{ws}/explain/existing.yaml"],
                         "--overwrite", guard=["explain/existing.yaml"]))
    cases.append(_refuse("explain/--json existing", ["explain", trl, "--json", "{ws}/explain/existing.yaml"],
                         "--overwrite", guard=["explain/existing.yaml"]))
    for name in ("tb_damaged", "tb_empty_file", "fifo_metrics", "empty_metrics", "nan_metrics", "trl_no_state",
                 "missing", "metrics_not_json", "metrics_a_list", "metrics_huge_line"):
        cases.append(_either(f"explain/--run {name}", ["explain", "--run", "{ws}/runs/" + name], name))
    cases.append(_refuse("explain/--run a file", ["explain", "--run", "{data}"], "--run"))
    cases.append(_refuse("explain/--run --warn-above nan", ["explain", "--run", "{run}", "--warn-above", "nan"],
                         "--warn-above"))
    cases.append(_refuse("explain/--run --warn-below -1", ["explain", "--run", "{run}", "--warn-below", "-1"],
                         "--warn-below"))
    cases.append(_refuse("explain/--run --plot existing", ["explain", "--run", "{run}", "--plot",
                                                           "{ws}/explain/existing.yaml"], "--overwrite",
                         guard=["explain/existing.yaml"]))
    return cases


def _other_cases() -> list[dict]:
    run_guard = ["run"]
    cases = [
        _refuse("report/missing folder", ["report", "{ws}/nope"], "nope"),
        _refuse("report/a file", ["report", "{data}"], "add.jsonl"),
        _refuse("report/empty folder", ["report", "{ws}/empty"], "empty"),
        _refuse("report/plots symlink", ["report", "{ws}/runs/plots_link"], "plots", guard=["outside"]),
        _refuse("report/plots a file", ["report", "{ws}/runs/plots_file"], "plots", guard=["runs/plots_file"]),
        _either("report/empty metrics", ["report", "{ws}/runs/report_empty_metrics"], "metrics"),
        _either("report/nan metrics", ["report", "--no-plots", "{ws}/runs/report_nan_metrics"], "metrics"),
        _refuse("report/FIFO metrics", ["report", "--no-plots", "{ws}/runs/fifo_metrics"], "metrics.jsonl"),
        _refuse("kl/missing prompts", ["kl", "{model}", "{model}", "--prompts", "{ws}/nope.jsonl"], "--prompts"),
        _refuse("kl/prompts FIFO", ["kl", "{model}", "{model}", "--prompts", "{fifo}"], "--prompts"),
        _refuse("kl/samples 0", ["kl", "{model}", "{model}", "--prompts", "{data}", "--samples", "0"], "--samples"),
        _refuse("kl/temperature nan", ["kl", "{model}", "{model}", "--prompts", "{data}", "--temperature", "nan"],
                "--temperature"),
        _refuse("kl/json existing", ["kl", "{model}", "{model}", "--prompts", "{data}", "--limit", "1",
                                     "--samples", "1", "--max-new-tokens", "1", "--json", "{ws}/explain/existing.yaml"],
                "--overwrite", guard=["explain/existing.yaml"]),
        _refuse("kl/json onto prompts", ["kl", "{model}", "{model}", "--prompts", "{data}", "--json", "{data}",
                                         "--overwrite"], "--json", guard=["add.jsonl"]),
        _refuse("kl/missing policy", ["kl", "{ws}/nope", "{model}", "--prompts", "{data}"], "nope"),
        _refuse("eval/missing checkpoint", ["eval", "{ws}/nope"], "nope"),
        _refuse("eval/checkpoint no config", ["eval", "{model}"], "--config"),
        _refuse("eval/--set unknown", ["eval", "{ckpt}", "--set", "nope"], "nope"),
        _refuse("eval/json onto config", ["eval", "{ckpt}", "--json", "{run}/config.yaml", "--overwrite"], "--json",
                guard=run_guard),
        _refuse("export/missing", ["export", "{ws}/nope", "{ws}/exp1"], "nope"),
        _refuse("export/out exists non-empty", ["export", "{ckpt}", "{ws}/explain"], "explain",
                guard=["explain"]),
        _refuse("export/out inside checkpoint", ["export", "{ckpt}", "{ckpt}/sub"], "OUT", guard=run_guard),
        _refuse("export/out = checkpoint", ["export", "{ckpt}", "{ckpt}"], "OUT", guard=run_guard),
        _refuse("export/truncated checkpoint", ["export", "{ws}/broken/truncated", "{ws}/exp2"], "safetensors",
                guard=["broken/truncated"]),
        _refuse("export/checksum mismatch", ["export", "{ws}/broken/flipped", "{ws}/exp3"], "checksum",
                guard=["broken/flipped"]),
        _refuse("sweep/bad grid", ["sweep", "--grid", "kl.coef", "--dry-run"], "--grid"),
        _refuse("sweep/unknown field", ["sweep", "--grid", "kl.nope=1,2", "--dry-run"], "kl.nope"),
        _refuse("sweep/empty values", ["sweep", "--grid", "kl.coef=,", "--dry-run"], "kl.coef"),
        _refuse("sweep/bad value", ["sweep", "--grid", "kl.coef=-1,2", "--dry-run"], "kl.coef"),
        _refuse("sweep/seeds abc", ["sweep", "--grid", "kl.coef=0,1", "--seeds", "a,b", "--dry-run"], "--seeds"),
        _refuse("sweep/jobs 0", ["sweep", "--grid", "kl.coef=0,1", "--jobs", "0", "--dry-run"], "--jobs"),
        _refuse("sweep/output a file", ["sweep", "--grid", "kl.coef=0,1", "--output-dir", "{data}", "--dry-run"],
                "--output-dir", guard=["add.jsonl"]),
        _refuse("sweep/baseline not in grid", ["sweep", "--grid", "kl.coef=0,1", "--baseline", "kl.coef=5",
                                               "--dry-run"], "--baseline"),
        _refuse("sweep/config FIFO", ["sweep", "--grid", "kl.coef=0,1", "--config", "{fifo}", "--dry-run"], "fifo"),
        _refuse("verify-kl/--from-run missing", ["verify-kl", "--from-run", "{ws}/nope"], "nope"),
        _refuse("verify-kl/--from-run no dumps", ["verify-kl", "--from-run", "{ws}/runs/report_empty_metrics"],
                "kl_dumps"),
        _refuse("verify-kl/--from-run broken dump", ["verify-kl", "--from-run", "{ws}/runs/bad_dumps"],
                "step_1.safetensors", guard=["runs/bad_dumps"]),
        _refuse("verify-kl/--from-run FIFO dump", ["verify-kl", "--from-run", "{ws}/runs/fifo_dumps"],
                "step_1.safetensors"),
        _refuse("verify-kl/--json onto input", ["verify-kl", "--from-run", "{ws}/runs/dumps_ok", "--json",
                                                "{ws}/runs/dumps_ok/kl_dumps/step_1.safetensors"], "--json",
                guard=["runs/dumps_ok"]),
    ]
    # a damaged newest checkpoint: the resume says so, continues from the one before and keeps the damaged one
    # aside as checkpoints/damaged_step_2, byte for byte (tests/test_command_integrity.py checks the bytes)
    for name in ("truncated", "flipped", "state_type", "state_not_json", "no_weights"):
        cases.append(_accept(f"resume/{name}", ["train", "--resume", "latest", "--train.steps", "4",
                                                "--output-dir", "{ws}/resume/" + name]))
    return cases


CASES = _train_cases() + _yaml_cases() + _explain_cases() + _other_cases()


# ------------------------------------------------------------------------------------------------ workspace
def build_workspace(ws: Path) -> dict[str, str]:
    """The files the cases read: a tiny model, a prompt file, a finished run and its damaged copies."""
    import yaml

    from klgrpo.apps.demo.model import save_tiny_model_and_tokenizer

    model = save_tiny_model_and_tokenizer(ws / "model", seed=0, hidden=32, layers=1, heads=2, intermediate=64)
    data = ws / "add.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                            for a in range(5) for b in range(4)))
    places = {"ws": str(ws), "model": str(model), "data": str(data), "fifo": str(ws / "a_fifo")}
    base = json.loads(json.dumps(BASE).replace("{model}", str(model)).replace("{data}", str(data)))
    (ws / "base.yaml").write_text(yaml.safe_dump(base))
    places["base"] = str(ws / "base.yaml")
    os.mkfifo(ws / "a_fifo")
    (ws / "empty").mkdir()
    (ws / "outside").mkdir()
    (ws / "outside" / "keep.txt").write_text("not klgrpo's\n")
    run = ws / "run"
    _klgrpo(["train", "--config", str(ws / "base.yaml"), "--output-dir", str(run), "--train.steps", "2",
             "--train.save_every", "1", "--train.keep_checkpoints", "0", "--kl.dump_every", "1",
             "--eval.sets", json.dumps([{"name": "add", "source": str(data), "limit": 2}])], check=True)
    places["run"], places["ckpt"] = str(run), str(run / "checkpoints" / "step_2")
    _yaml_files(ws / "yaml")
    _explain_files(ws / "explain")
    _run_folders(ws / "runs", run)
    _broken_checkpoints(ws, run)
    return places


def _yaml_files(folder: Path) -> None:
    folder.mkdir()
    (folder / "empty.yaml").write_text("")
    (folder / "list.yaml").write_text("- a\n- b\n")
    (folder / "binary.yaml").write_bytes(bytes(range(256)) * 8)
    (folder / "huge.yaml").write_text("kl:\n  coef: 0.1\n" + "# " + "x" * 100 + "\n" * 1 + ("a: 1\n" * 200000))
    (folder / "tabs.yaml").write_text("kl:\n\tcoef: 0.1\n")
    (folder / "nul.yaml").write_bytes(b"kl:\n  coef: 0.1\x00\n")
    (folder / "anchors.yaml").write_text("a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, "
        f"*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]\n" for i in range(8)))
    (folder / "scalar.yaml").write_text("42\n")
    (folder / "badgroup.yaml").write_text("kl: 5\n")
    (folder / "nested_list.yaml").write_text("kl:\n  - coef: 1\n")
    unreadable = folder / "unreadable.yaml"
    unreadable.write_text("kl: {coef: 0.1}\n")
    unreadable.chmod(0)


def _explain_files(folder: Path) -> None:
    folder.mkdir()
    (folder / "trl.py").write_text("from trl import GRPOConfig\nGRPOConfig(beta=0.04, loss_type='grpo')\n")
    (folder / "existing.yaml").write_text("kept: true\n")
    (folder / "nul_requirements.txt").write_bytes(b"trl==0.18\x00\n")
    code = "from trl import GRPOConfig\nGRPOConfig(beta=0.04)\n"
    cell = {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None}
    notebooks = {
        "nb_bad_source.ipynb": {"cells": [{**cell, "source": 5}, {**cell, "source": code}], "nbformat": 4},
        "nb_list.ipynb": [1, 2, 3],
        "nb_no_cells.ipynb": {"nbformat": 4},
        "nb_cells_dict.ipynb": {"cells": {"a": 1}, "nbformat": 4},
        "nb_empty.ipynb": {"cells": [], "nbformat": 4},
    }
    for name, body in notebooks.items():
        (folder / name).write_text(json.dumps(body))
    (folder / "nb_not_json.ipynb").write_text("{not json")
    verl = "algorithm:\n  use_kl_in_reward: true\n  kl_ctrl:\n    type: fixed\n    kl_coef: {coef}\n" \
           "actor_rollout_ref:\n  actor:\n    use_kl_loss: false\n"
    (folder / "verl_nan.yaml").write_text(verl.replace("{coef}", ".nan"))
    (folder / "verl_inf.yaml").write_text(verl.replace("{coef}", ".inf"))
    (folder / "verl_coef_str.yaml").write_text(verl.replace("{coef}", "lots"))
    (folder / "verl_bad_type.yaml").write_text("actor_rollout_ref:\n  actor:\n    use_kl_loss: true\n"
                                               "    kl_loss_coef: 0.001\n    kl_loss_type: bogus_kl\n")


def _run_folders(folder: Path, run: Path) -> None:
    folder.mkdir()
    tb = folder / "tb_damaged" / "tb"
    tb.mkdir(parents=True)
    (tb / "events.out.tfevents.1.host").write_bytes(b"\x18\x00\x00\x00\x00\x00\x00\x00garbage" * 20)
    (folder / "tb_empty_file" / "tb").mkdir(parents=True)
    (folder / "tb_empty_file" / "tb" / "events.out.tfevents.2.host").write_bytes(b"")
    for name in ("fifo_metrics", "empty_metrics", "nan_metrics", "metrics_not_json", "metrics_a_list",
                 "metrics_huge_line"):
        (folder / name).mkdir()
    os.mkfifo(folder / "fifo_metrics" / "metrics.jsonl")
    (folder / "empty_metrics" / "metrics.jsonl").write_text("")
    (folder / "nan_metrics" / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "adaptive_kl/raw_kl": float("nan")}) + "\n" for s in range(1, 4)))
    (folder / "metrics_not_json" / "metrics.jsonl").write_text("{nope\n")
    (folder / "metrics_a_list" / "metrics.jsonl").write_text("[1, 2]\n")
    (folder / "metrics_huge_line" / "metrics.jsonl").write_text('{"step": 1, "x": "' + "y" * 3_000_000 + '"}\n')
    (folder / "trl_no_state" / "checkpoint-4").mkdir(parents=True)
    (folder / "trl_no_state" / "checkpoint-4" / "config.json").write_text("{}")
    for name in ("report_empty_metrics", "report_nan_metrics", "plots_link", "plots_file"):
        shutil.copytree(run, folder / name, ignore=shutil.ignore_patterns("checkpoints", "kl_dumps"))
    (folder / "report_empty_metrics" / "metrics.jsonl").write_text("")
    (folder / "report_nan_metrics" / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "reward/mean": float("nan"), "adaptive_kl/raw_kl": float("nan")}) + "\n"
                for s in range(1, 4)))
    shutil.rmtree(folder / "plots_link" / "plots", ignore_errors=True)
    (folder / "plots_link" / "plots").symlink_to(folder.parent / "outside")
    shutil.rmtree(folder / "plots_file" / "plots", ignore_errors=True)
    (folder / "plots_file" / "plots").write_text("a file where plots/ goes\n")
    shutil.copytree(run / "kl_dumps", folder / "dumps_ok" / "kl_dumps")
    (folder / "bad_dumps" / "kl_dumps").mkdir(parents=True)
    (folder / "bad_dumps" / "kl_dumps" / "step_1.safetensors").write_bytes(b"\xff" * 64)
    (folder / "fifo_dumps" / "kl_dumps").mkdir(parents=True)
    os.mkfifo(folder / "fifo_dumps" / "kl_dumps" / "step_1.safetensors")


def _weights(checkpoint: Path) -> Path:
    """The model's weights file (not trainer_state.safetensors, the optimizer's, which export never reads)."""
    return checkpoint / "model.safetensors"


def _broken_checkpoints(ws: Path, run: Path) -> None:
    step = run / "checkpoints" / "step_2"
    (ws / "broken").mkdir()
    for name in ("truncated", "flipped"):
        shutil.copytree(step, ws / "broken" / name)
    _truncate(_weights(ws / "broken" / "truncated"))
    _flip(_weights(ws / "broken" / "flipped"))
    (ws / "resume").mkdir()
    for name in ("truncated", "flipped", "state_type", "state_not_json", "no_weights"):
        shutil.copytree(run, ws / "resume" / name)
    for name in ("truncated", "flipped", "state_type", "state_not_json", "no_weights"):
        # --resume latest takes the newest checkpoint: the damage goes there
        newest = ws / "resume" / name / "checkpoints" / "step_2"
        if name == "truncated":
            _truncate(_weights(newest))
        elif name == "flipped":
            _flip(_weights(newest))
        elif name == "no_weights":
            _weights(newest).unlink()
        else:
            states = [p for p in newest.rglob("*.json") if "state" in p.name and "checksum" not in p.name]
            target = states[0] if states else newest / "trainer_state.json"
            target.write_text('{"step": "two", "beta": [1]}' if name == "state_type" else "{not json")


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))


# ------------------------------------------------------------------------------------------------ running
def _klgrpo(args: list[str], check: bool = False, stdin: str | None = None, cwd: Path | None = None):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-m", "klgrpo", *args], capture_output=True, text=True,
                          errors="replace", timeout=TIMEOUT_S, env=env, input=stdin or "", cwd=cwd)
    if check and proc.returncode != 0:
        raise SystemExit(f"workspace step failed: klgrpo {' '.join(args)}\n{proc.stderr[-3000:]}")
    return proc


def _snapshot(ws: Path, paths: list[str]) -> dict[str, bytes]:
    snap = {}
    for rel in paths:
        root = ws / rel
        items = [root] if not root.is_dir() or root.is_symlink() else sorted(root.rglob("*"))
        for p in items:
            key = str(p.relative_to(ws))
            if p.is_symlink():
                snap[key] = b"->" + str(os.readlink(p)).encode()
            elif p.is_file():
                snap[key] = p.read_bytes()
            elif p.is_dir():
                snap[key] = b"<dir>"
            else:
                snap[key] = b"<special>" if p.exists() else b"<missing>"
        if root.is_symlink():
            snap.update(_snapshot(ws, [str(Path(os.path.realpath(root)).relative_to(ws))]))
    return snap


def classify(case: dict, proc, guard_before: dict, guard_after: dict) -> tuple[str, str]:
    """(outcome, the line or the reason) of one finished case."""
    err = proc.stderr or ""
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("warning:")]
    if guard_before != guard_after:
        gone = sorted(k for k in guard_before if guard_before[k] != guard_after.get(k))
        return "changed", f"changed: {', '.join(gone[:3]) or 'new files'}"
    if "Traceback (most recent call last)" in err or proc.returncode not in (0, 2, 3):
        last = lines[-1] if lines else ""
        return "traceback", f"exit {proc.returncode}: {last[:160]}"
    if proc.returncode == 0:
        return ("silent" if case["expect"] == "refuse" else "accepted"), "exit 0"
    if proc.returncode == 2 and not lines:
        return "silent", "exit 2, nothing on stderr"
    if len(lines) > 1:
        return "multi-line", f"{len(lines)} lines: {lines[0][:120]}"
    line = lines[0] if lines else ""
    if not all(word.lower() in line.lower() for word in case["names"]):
        return "vague", line[:200]
    return "one line", line[:200]


def passed(case: dict, outcome: str) -> bool:
    return {"refuse": outcome == "one line", "accept": outcome == "accepted",
            "either": outcome in ("one line", "accepted")}[case["expect"]]


def _fill(args: list[str], places: dict[str, str]) -> list[str]:
    out = []
    for arg in args:
        for key, value in places.items():
            arg = arg.replace("{" + key + "}", value)
        out.append(arg)
    return out


def run_cases(cases: list[dict], ws: Path, places: dict[str, str]) -> list[dict]:
    results = []
    for i, case in enumerate(cases):
        places = {**places, "out": str(ws / "out" / f"case_{i}")}
        before = _snapshot(ws, case["guard"])
        t0 = time.perf_counter()
        try:
            proc = _klgrpo(_fill(case["args"], places), stdin=case["stdin"], cwd=ws / "empty")
        except subprocess.TimeoutExpired:
            outcome, detail = "hang", f"no answer in {TIMEOUT_S} s"
        else:
            outcome, detail = classify(case, proc, before, _snapshot(ws, case["guard"]))
        results.append({"name": case["name"], "expect": case["expect"], "outcome": outcome, "detail": detail,
                        "ok": passed(case, outcome), "seconds": round(time.perf_counter() - t0, 1)})
        row = results[-1]
        print(f"{'ok ' if row['ok'] else 'BAD'} {row['name'][:48]:48} {row['outcome']:10} {row['detail'][:150]}",
              flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="run only the cases whose name holds this text (or one of A,B,...)")
    parser.add_argument("--json", default="", help="also write the results here")
    parser.add_argument("--keep", action="store_true", help="keep the temporary workspace (its path is printed)")
    opts = parser.parse_args(argv)
    cases = [c for c in CASES if any(part in c["name"] for part in opts.only.split(","))]
    ws = Path(tempfile.mkdtemp(prefix="klgrpo-hostile-"))
    try:
        places = build_workspace(ws)
        results = run_cases(cases, ws, places)
    finally:
        unreadable = ws / "yaml" / "unreadable.yaml"
        if unreadable.exists():
            unreadable.chmod(stat.S_IRUSR | stat.S_IWUSR)
        if opts.keep:
            print(f"workspace: {ws}")
        else:
            shutil.rmtree(ws, ignore_errors=True)
    totals: dict[str, int] = {}
    for row in results:
        totals[row["outcome"]] = totals.get(row["outcome"], 0) + 1
    good = sum(row["ok"] for row in results)
    print(f"\n{len(results)} cases: {good} as expected, {len(results) - good} not; outcomes: "
          + ", ".join(f"{k} {v}" for k, v in sorted(totals.items())))
    if opts.json:
        Path(opts.json).write_text(json.dumps({"totals": totals, "expected": good, "results": results}, indent=1))
    return 0 if good == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
