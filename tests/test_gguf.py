"""GGUF loading: a tiny Llama (GQA, tied embeddings) and byte-level BPE tokenizer written as a GGUF file here,
loaded through klgrpo's loader in each spelling, trained for a step, checkpointed and loaded back."""

from __future__ import annotations

import json
import sys

import pytest
import torch

pytest.importorskip("gguf")

from klgrpo.backends.hf import load_causal_lm, load_tokenizer, split_gguf  # noqa: E402
from klgrpo.config.schema import GRPOConfig, ModelConfig  # noqa: E402
from klgrpo.errors import ConfigError  # noqa: E402
from tests.helpers.configs import make_config, quiet  # noqa: E402
from tests.helpers.gguf_model import write_tiny_gguf  # noqa: E402

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """(folder, file name, the transformers model the file holds)."""
    folder = tmp_path_factory.mktemp("gguf")
    model = write_tiny_gguf(folder / "tiny.gguf")
    return folder, "tiny.gguf", model


def _ids(tok, text="What is 12+7? 12 t"):
    return tok(text, return_tensors="pt").input_ids


@pytest.mark.parametrize("spelling", ["folder+gguf_file", "path to the .gguf file"])
def test_gguf_loads_the_written_weights_exactly(tiny_gguf, spelling):
    folder, name, written = tiny_gguf
    args = (str(folder), name) if spelling == "folder+gguf_file" else (str(folder / name), "")
    model = load_causal_lm(args[0], ModelConfig(), CPU, torch.float32, gguf_file=args[1])
    tok = load_tokenizer(args[0], gguf_file=args[1])
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_key_value_heads == 2
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as the file has no output.weight
    ids = _ids(tok)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, written(ids).logits)  # float32 tensors: bit-for-bit


def test_gguf_tokenizer_has_the_files_vocabulary_merges_and_chat_template(tiny_gguf):
    folder, name, _ = tiny_gguf
    tok = load_tokenizer(str(folder), gguf_file=name)
    assert tok.padding_side == "left" and tok.eos_token == "<|im_end|>" and tok.pad_token_id == 2
    text = tok.apply_chat_template([{"role": "user", "content": "12+7?"}], add_generation_prompt=True,
                                   tokenize=False)
    assert text == "<|im_start|>user\n12+7?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text).input_ids
    assert ids[0] == 1 and ids.count(2) == 1  # special tokens stay whole
    assert tok.convert_tokens_to_ids("12") in ids  # the merge "1 2" applied
    assert tok.decode(ids) == text


def test_package_spelling_resolves_to_the_installed_package_folder():
    from pathlib import Path

    import klgrpo

    folder = Path(klgrpo.__file__).parent
    assert split_gguf("package:klgrpo/backends/x.gguf") == (str(folder / "backends"), "x.gguf")
    assert split_gguf("package:klgrpo", "m.gguf") == (str(folder), "m.gguf")
    assert split_gguf("org/model") == ("org/model", "")
    with pytest.raises(ConfigError, match="package:no_such_package_xyz .*names no installed Python package"):
        split_gguf("package:no_such_package_xyz/m.gguf")


def test_missing_gguf_file_or_package_is_one_clear_line(tiny_gguf, monkeypatch):
    folder, name, _ = tiny_gguf
    with pytest.raises(ConfigError, match="no GGUF file 'nope.gguf' in"):
        load_causal_lm(str(folder), ModelConfig(), CPU, torch.float32, gguf_file="nope.gguf")
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf now raises ImportError
    for load in (lambda: load_tokenizer(str(folder / name)),
                 lambda: load_causal_lm(str(folder), ModelConfig(), CPU, torch.float32, gguf_file=name)):
        with pytest.raises(ConfigError, match=r'needs the gguf package: pip install "klgrpo\[gguf\]"'):
            load()


def test_gguf_file_without_a_folder_is_refused():
    cfg = GRPOConfig.from_dict({"model": {"gguf_file": "m.gguf"}, "data": {"source": "x.jsonl"}})
    with pytest.raises(ConfigError, match="model.gguf_file needs model.name_or_path"):
        cfg.validate()


def test_training_from_a_gguf_file_checkpoints_an_ordinary_model(tiny_gguf, tmp_path):
    from transformers import AutoModelForCausalLM

    from klgrpo.run.trainer import GRPOTrainer

    folder, name, written = tiny_gguf
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a)}) + "\n" for a in range(8)))
    some_letter = {"name": "format", "kwargs": {"pattern": "[a-z]"}}  # varies across the random model's samples
    cfg = make_config(folder, data, tmp_path / "run", model={"gguf_file": name}, rewards={"functions": [some_letter]},
                      kl={"coef": 0.1, "reference": str(folder / name)},  # the reference from the file too
                      train={"steps": 1, "output_dir": str(tmp_path / "run"), "seed": 0})
    trainer = GRPOTrainer(cfg, log=quiet)
    trainer.train()
    ckpt = trainer.run_dir / "checkpoints" / "step_1"
    config = json.loads((ckpt / "config.json").read_text())
    assert "quantization_config" not in config  # an ordinary checkpoint: loads without the GGUF file
    reloaded = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    changed = any(not torch.equal(a, b) for a, b in zip(reloaded.state_dict().values(),
                                                         written.state_dict().values()))
    assert changed and trainer.step == 1
    assert torch.equal(reloaded.state_dict()["lm_head.weight"], reloaded.state_dict()["model.embed_tokens.weight"])


def test_lora_on_a_gguf_base_exports_merged_weights(tiny_gguf, tmp_path):
    """model.lora with lora.save_merged: the merge reloads the base from the GGUF file (folder + gguf_file)."""
    pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from klgrpo.run.trainer import GRPOTrainer

    folder, name, written = tiny_gguf
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a)}) + "\n" for a in range(8)))
    cfg = make_config(folder, data, tmp_path / "run", model={"gguf_file": name,
                                                             "lora": {"r": 4, "save_merged": True}},
                      rewards={"functions": [{"name": "format", "kwargs": {"pattern": "[a-z]"}}]}, optim={"lr": 0.1},
                      train={"steps": 1, "output_dir": str(tmp_path / "run"), "seed": 0})
    trainer = GRPOTrainer(cfg, log=quiet)
    trainer.train()
    merged = AutoModelForCausalLM.from_pretrained(trainer.run_dir / "merged", dtype=torch.float32)
    assert "quantization_config" not in json.loads((trainer.run_dir / "merged" / "config.json").read_text())
    w = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged.state_dict()[w], written.state_dict()[w])  # the adapter is merged in
