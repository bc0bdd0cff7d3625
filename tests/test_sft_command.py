"""klgrpo sft: TRL's SFTTrainer on prompt/answer rows; the answers become more likely (log-probs computed here),
and the folder it writes starts a GRPO run as model.name_or_path and kl.reference. Needs klgrpo[trl,data]."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from klgrpo.apps.cli import main as cli
from klgrpo.run.trainer import GRPOTrainer
from tests.helpers.configs import make_config, quiet

pytest.importorskip("trl")
pytest.importorskip("datasets")


def _answer_logprob(folder, rows) -> float:
    """Mean over rows of log p(answer | prompt), summed over the answer's tokens (the loss SFT lowers)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    tok = AutoTokenizer.from_pretrained(folder)
    total = 0.0
    for row in rows:
        prompt = tok(row["prompt"])["input_ids"]
        full = tok(row["prompt"] + row["answer"])["input_ids"]
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=torch.tensor([full])).logits[0, :-1], -1)
        targets = torch.tensor(full[1:])
        total += float(logp.gather(-1, targets[:, None])[len(prompt) - 1:].sum())
    return total / len(rows)


def test_sft_raises_the_answers_and_its_folder_starts_grpo(tiny_model_dir, addition_file, tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"model": {"name_or_path": str(tiny_model_dir), "dtype": "float32",
                                                "device": "cpu"}, "data": {"source": str(addition_file)}}))
    out = tmp_path / "sft"
    assert cli(["sft", "--config", str(config), "--output-dir", str(out), "--steps", "25", "--lr", "3e-3"]) == 0
    assert f"model saved to {out}" in capsys.readouterr().out
    summary = json.loads((out / "sft_summary.json").read_text())
    assert summary["steps"] == 25 and summary["rows"] == 70 and summary["last_loss"] < summary["first_loss"]
    rows = [json.loads(line) for line in addition_file.read_text().splitlines()][:20]
    before, after = _answer_logprob(tiny_model_dir, rows), _answer_logprob(out, rows)
    assert after > before + 1.0  # the answers' log-probability rose by more than one nat per row
    cfg = make_config(out, addition_file, tmp_path / "grpo", kl={"reference": str(out)}, train={"steps": 1})
    assert GRPOTrainer(cfg, log=quiet).train()["steps"] == 1
    # a second run into the same folder is refused, in one line
    assert cli(["sft", "--config", str(config), "--output-dir", str(out), "--steps", "1"]) == 2
    assert "already holds a model; pass --overwrite" in capsys.readouterr().err


def test_rows_in_trls_prompt_completion_format():
    from klgrpo.apps.sft import sft_rows

    assert sft_rows(["2+2="], [4], as_chat=False, system_prompt="") == [{"prompt": "2+2=", "completion": "4"}]
    (chat,) = sft_rows(["2+2="], ["4"], as_chat=True, system_prompt="Be brief.")
    assert chat == {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2="}],
                    "completion": [{"role": "assistant", "content": "4"}]}
    given = [{"role": "user", "content": "hi"}]
    assert sft_rows([given], ["yo"], as_chat=False, system_prompt="")[0]["prompt"] == given
