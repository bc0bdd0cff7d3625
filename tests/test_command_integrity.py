"""`klgrpo eval`, `kl` and `export` never score or copy weights that are not the ones saved: a weights file that
lacks a tensor, holds another, had its bytes flipped or its header altered, two models with different tokenizers,
a run whose config.yaml is empty. Each case: exit 2, ONE line on stderr naming the file or tensor, no traceback,
and every file of the case's folder byte for byte as before. A resume skips a checkpoint whose checksum fails."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest

from klgrpo.apps.cli import main as cli
from klgrpo.run.trainer import GRPOTrainer
from tests.conftest import write_jsonl
from tests.helpers.configs import make_config, quiet

DROPPED = "model.layers.0.self_attn.q_proj.weight"
ALTERED = "model.layers.0.mlp.up_proj.weight"


@pytest.fixture(scope="module")
def finished_run(tiny_model_dir, addition_file, tmp_path_factory):
    """A 2-step run with checkpoints step_1 and step_2 and an eval set (its config.yaml serves `klgrpo eval`)."""
    root = tmp_path_factory.mktemp("integrity")
    sets = [{"name": "add", "source": str(addition_file), "limit": 4}]
    cfg = make_config(tiny_model_dir, addition_file, root / "run", eval={"sets": sets},
                      train={"steps": 2, "save_every": 1, "keep_checkpoints": 0})
    GRPOTrainer(cfg, log=quiet).train()
    return root / "run"


class Case:
    """The files of one case in a fresh folder ``root``."""

    def __init__(self, root: Path, model: Path, run: Path, data: Path):
        self.root, self.model_dir, self.finished_run, self.data = root, model, run, data

    def run(self) -> Path:
        shutil.copytree(self.finished_run, self.root / "run")
        return self.root / "run"

    def checkpoint(self, step: int = 2) -> Path:
        return self.run() / "checkpoints" / f"step_{step}"

    def model(self, name: str = "model") -> Path:
        return Path(shutil.copytree(self.model_dir, self.root / name))

    def prompts(self) -> Path:
        return write_jsonl(self.root / "prompts.jsonl", [{"prompt": "01+02="}, {"prompt": "13+40="}])


def _weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def _save_weights(folder: Path, tensors: dict) -> Path:
    from safetensors.torch import save_file

    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def lacking(folder: Path) -> Path:
    tensors = _weights(folder)
    del tensors[DROPPED]
    return _save_weights(folder, tensors)


def with_extra(folder: Path) -> Path:
    import torch

    return _save_weights(folder, {**_weights(folder), "model.extra_head.weight": torch.zeros(3)})


def flipped(folder: Path, name: str = "model.safetensors") -> Path:
    path = folder / name
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x40  # a bit inside the last tensor's bytes: the file still parses
    path.write_bytes(bytes(data))
    return folder


def header_altered(folder: Path, change) -> Path:
    """Rewrite one entry of model.safetensors' JSON header in place (same header length, the data untouched)."""
    path = folder / "model.safetensors"
    data = path.read_bytes()
    size = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + size])
    change(header[ALTERED])
    text = json.dumps(header, separators=(",", ":")).encode()
    path.write_bytes(data[:8] + text + b" " * (size - len(text)) + data[8 + size:])
    return folder


def reversed_shape(entry):
    entry["shape"] = entry["shape"][::-1]


def integer_dtype(entry):
    entry["dtype"] = "I32"  # the same size as F32: the data still fits the header


def swapped_tokenizer(folder: Path) -> Path:
    """The same characters with the ids of "1" and "2" exchanged."""
    path = folder / "tokenizer.json"
    spec = json.loads(path.read_text())
    vocab = spec["model"]["vocab"]
    vocab["1"], vocab["2"] = vocab["2"], vocab["1"]
    path.write_text(json.dumps(spec))
    return folder


def empty_config(run: Path) -> Path:
    (run / "config.yaml").write_text("")
    return run


def _eval(c: Case, model: Path, *extra) -> list[str]:
    return ["eval", str(model), "--config", str(c.finished_run / "config.yaml"), *extra]


def _kl(c: Case, policy: Path, reference: Path, *extra) -> list[str]:
    return ["kl", str(policy), str(reference), "--prompts", str(c.prompts()), "--device", "cpu",
            "--max-new-tokens", "2", "--samples", "2", *extra]


CASES = [
    ("eval_weights_lack_a_tensor", lambda c: _eval(c, lacking(c.model())),
     ["lacks 1 of the model's", DROPPED, "not a checkpoint of this model"]),
    ("eval_weights_hold_an_extra_tensor", lambda c: _eval(c, with_extra(c.model())),
     ["holds 1 weights the model does not have", "model.extra_head.weight"]),
    ("kl_policy_lacks_a_tensor", lambda c: _kl(c, lacking(c.model()), c.model_dir),
     ["lacks 1 of the model's", DROPPED]),
    ("kl_reference_lacks_a_tensor", lambda c: _kl(c, c.model_dir, lacking(c.model())), [DROPPED]),
    ("eval_checkpoint_bytes_flipped", lambda c: ["eval", str(flipped(c.checkpoint()))],
     ["step_2/model.safetensors cannot be read as saved", "intact checkpoint"]),
    ("eval_checkpoint_lacks_a_tensor", lambda c: ["eval", str(lacking(c.checkpoint()))],
     ["step_2/model.safetensors cannot be read as saved"]),
    ("kl_checkpoint_bytes_flipped", lambda c: _kl(c, flipped(c.checkpoint()), c.model_dir),
     ["cannot be read as saved"]),
    ("export_checkpoint_bytes_flipped", lambda c: ["export", str(flipped(c.checkpoint())), str(c.root / "out")],
     ["step_2/model.safetensors cannot be read as saved"]),
    ("export_into_the_checkpoint", lambda c: ["export", str(c.checkpoint()), str(c.root / "run/checkpoints/step_2/m")],
     ["is inside the checkpoint", "another path"]),
    ("export_into_empty_path", lambda c: ["export", str(c.checkpoint()), ""], ["OUT is empty"]),
    ("export_model_lacks_a_tensor", lambda c: ["export", str(lacking(c.model())), str(c.root / "out")],
     ["lacks 1 of the model's", DROPPED]),
    ("eval_header_shape_altered", lambda c: _eval(c, header_altered(c.model(), reversed_shape)),
     ["has 1 weights of another shape", ALTERED]),
    ("kl_header_dtype_altered", lambda c: _kl(c, header_altered(c.model(), integer_dtype), c.model_dir),
     [ALTERED, "stored as I32", "floating-point"]),
    ("kl_different_tokenizers", lambda c: _kl(c, c.model_dir, swapped_tokenizer(c.model())),
     ["different tokenizers", "01+02=", "different ids"]),
    ("eval_run_with_empty_config", lambda c: ["eval", str(empty_config(c.run()) / "checkpoints" / "step_2")],
     ["no config for", "--config FILE"]),
    ("train_resume_run_with_empty_config",
     lambda c: ["train", "--resume", "latest", "--output-dir", str(empty_config(c.run())), "--train.steps", "3"],
     ["config.yaml is missing or empty", "--config"]),
    ("kl_max_new_tokens_beyond_context", lambda c: _kl(c, c.model_dir, c.model_dir, "--max-new-tokens", "1e9"),
     ["--max-new-tokens 1000000000", "context of", "lower --max-new-tokens"]),
    ("eval_max_new_tokens_beyond_context", lambda c: _eval(c, c.model_dir, "--eval.max_new_tokens", "1000000000"),
     ["eval set add", "context of", "lower eval.max_new_tokens"]),
    ("eval_json_into_missing_folder", lambda c: _eval(c, c.model_dir, "--json", str(c.root / "no" / "r.json")),
     ["--json", "does not exist"]),
    ("kl_json_into_missing_folder", lambda c: _kl(c, c.model_dir, c.model_dir, "--json", str(c.root / "no/r.json")),
     ["--json", "does not exist"]),
    ("kl_max_new_tokens_not_whole", lambda c: _kl(c, c.model_dir, c.model_dir, "--max-new-tokens", "2.5"),
     ["--max-new-tokens: '2.5' is not a whole number", "klgrpo kl --help"]),
    ("eval_json_is_a_folder", lambda c: _eval(c, c.model_dir, "--json", str(c.root)), ["is not a file name"]),
]

if os.geteuid() != 0:  # root writes into read-only folders
    def _read_only(c: Case) -> Path:
        folder = c.root / "locked"
        folder.mkdir()
        folder.chmod(0o555)
        return folder / "r.json"

    CASES.append(("eval_json_into_read_only_folder", lambda c: _eval(c, c.model_dir, "--json", str(_read_only(c))),
                  ["--json", "permission denied"]))


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else b"<dir>")
            for p in sorted(folder.rglob("*")) if os.access(p, os.R_OK)}


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_refused_in_one_line_and_nothing_changes(case, tiny_model_dir, finished_run, addition_file, tmp_path, capsys):
    name, make_args, expected = case
    args = make_args(Case(tmp_path, tiny_model_dir, finished_run, addition_file))
    before = _snapshot(tmp_path)
    capsys.readouterr()
    code = cli(args)
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if not line.startswith("warning:")]
    assert code == 2, (name, err)
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"klgrpo {args[0]}: error: "), lines[0]
    for text in expected:
        assert text in lines[0], (text, lines[0])
    assert _snapshot(tmp_path) == before, "a file of the case was created or changed"


def test_the_checksums_cover_every_weights_file(finished_run):
    from klgrpo.store.checkpoint import STATE_STEM, WEIGHTS_SUMS
    from klgrpo.store.state_io import file_sha256, read_state_doc

    ckpt = finished_run / "checkpoints" / "step_2"
    doc = read_state_doc(ckpt, STATE_STEM)
    assert doc[WEIGHTS_SUMS] == {"model.safetensors": file_sha256(ckpt / "model.safetensors")}
    assert doc["sha256"] == file_sha256(ckpt / "trainer_state.safetensors")


@pytest.mark.parametrize("name", ["model.safetensors", "trainer_state.safetensors"])
def test_resume_latest_skips_a_checkpoint_whose_bytes_changed(name, finished_run, tmp_path, capsys):
    run = Path(shutil.copytree(finished_run, tmp_path / "run"))
    flipped(run / "checkpoints" / "step_2", name)
    assert cli(["train", "--resume", "latest", "--output-dir", str(run), "--train.steps", "3"]) == 0
    err = capsys.readouterr().err
    assert f"checkpoint step_2 cannot be loaded: {run / 'checkpoints' / 'step_2' / name} cannot be read as saved" in err
    assert f"resuming from {run / 'checkpoints' / 'step_1'} instead" in err
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2, 3]  # step 2 again from step_1, then 3
