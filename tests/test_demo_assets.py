"""The demo's assets: char tokenizer, tiny model, arithmetic splits, SFT warm start, cache."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from klgrpo.apps.demo import assets as demo_assets
from klgrpo.apps.demo.assets import DemoSettings, ModelSizes, prepare_demo_assets
from klgrpo.apps.demo.model import build_tiny_model, build_tiny_model_for, save_tiny_model_and_tokenizer
from klgrpo.apps.demo.sft import SFTSettings, encode_examples, evaluate_answer_loss, run_sft
from klgrpo.apps.demo.tasks import SKILLS, all_pairs, format_answer, format_prompt, make_splits, read_jsonl
from klgrpo.apps.demo.tokenizer import build_char_tokenizer
from klgrpo.backends.hf import default_cache_root

TINY = ModelSizes(hidden=16, layers=1, heads=2, intermediate=32, max_positions=16)


# ---- tokenizer -------------------------------------------------------------------------------------

def test_tokenizer_ids_and_save_load_round_trip(tmp_path):
    tokenizer = build_char_tokenizer()
    # ids: <pad>=0 <eos>=1 <unk>=2, then '0'..'9' = 3..12, '+'=13, '-'=14, '='=15
    text = "07+45=052<eos>"
    expected = [3, 10, 13, 7, 8, 15, 3, 8, 5, 1]
    assert len(tokenizer) == 16
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id) == (0, 1, None)
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    for tok in (tokenizer, loaded):
        assert tok(text)["input_ids"] == expected
        assert tok(text, add_special_tokens=False)["input_ids"] == expected  # no BOS is ever added
        assert tok.decode(expected) == text
        assert tok.decode(expected, skip_special_tokens=True) == "07+45=052"
        assert tok("9 -")["input_ids"] == [12, 2, 14]  # a space is <unk>
        assert (tok.pad_token_id, tok.eos_token_id, tok.padding_side) == (0, 1, "left")
    assert loaded.get_vocab() == tokenizer.get_vocab()


# ---- tasks -----------------------------------------------------------------------------------------

def test_task_formats_by_hand():
    assert (format_prompt("addition", 7, 45), format_answer("addition", 7, 45)) == ("07+45=", "052")
    assert (format_prompt("addition", 99, 99), format_answer("addition", 99, 99)) == ("99+99=", "198")
    assert (format_prompt("addition", 0, 0), format_answer("addition", 0, 0)) == ("00+00=", "000")
    assert (format_prompt("subtraction", 73, 45), format_answer("subtraction", 73, 45)) == ("73-45=", "028")
    assert (format_prompt("subtraction", 5, 5), format_answer("subtraction", 5, 5)) == ("05-05=", "000")
    assert len(all_pairs("addition")) == 100 * 100
    assert len(all_pairs("subtraction")) == 100 * 101 // 2  # a >= b
    with pytest.raises(ValueError, match="unknown skill"):
        format_prompt("division", 1, 2)


@pytest.mark.parametrize("skill", SKILLS)
def test_splits_are_disjoint_deterministic_and_correct(skill):
    splits = make_splits(skill)
    again = make_splits(skill)
    assert splits == again
    parts = {name: set(getattr(splits, name).prompts) for name in ("train", "validation", "test", "replay")}
    assert [len(parts[n]) for n in ("validation", "test", "replay")] == [200, 200, 1000]
    assert sum(len(p) for p in parts.values()) == len(all_pairs(skill))  # no duplicates, nothing dropped
    names = list(parts)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            assert not parts[a] & parts[b], f"{skill}: {a} and {b} overlap"
    sign = 1 if skill == "addition" else -1
    for prompt, answer in zip(splits.test.prompts, splits.test.answers):
        a, b = int(prompt[:2]), int(prompt[3:5])
        assert len(prompt) == 6 and len(answer) == 3 and int(answer) == a + sign * b >= 0


# ---- model and SFT ---------------------------------------------------------------------------------

def test_tiny_model_is_seeded_tied_and_saves_for_auto_classes(tmp_path):
    model = build_tiny_model(16, seed=3)
    assert sum(p.numel() for p in model.parameters()) == 132_416  # "about 132k parameters" (klgrpo/apps/demo/model.py)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    save_tiny_model_and_tokenizer(tmp_path, seed=3)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    assert (loaded.config.pad_token_id, loaded.config.eos_token_id) == (0, 1)
    assert loaded.generation_config.pad_token_id == 0 and loaded.generation_config.eos_token_id == 1
    for (name, p), q in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(p, q), name
    assert not torch.equal(build_tiny_model(16, seed=4).model.embed_tokens.weight, model.model.embed_tokens.weight)


def test_encode_examples_puts_loss_on_answer_and_eos_only():
    tokenizer = build_char_tokenizer()
    batch = encode_examples(tokenizer, ["1+2=", "07+45="], ["3", "052"])
    # "1+2=3<eos>" right-padded to 10 tokens; labels only on "3" and <eos>.
    assert batch.input_ids_NT[0].tolist() == [4, 13, 5, 15, 6, 1, 0, 0, 0, 0]
    assert batch.attention_mask_NT[0].tolist() == [1] * 6 + [0] * 4
    assert batch.labels_NT[0].tolist() == [-100] * 4 + [6, 1] + [-100] * 4
    assert batch.labels_NT[1].tolist() == [-100] * 6 + [3, 8, 5, 1]


def test_short_sft_lowers_the_answer_loss_and_is_repeatable():
    tokenizer = build_char_tokenizer()
    splits = {s: make_splits(s) for s in SKILLS}
    train = {s: splits[s].train for s in SKILLS}
    val = splits["addition"].validation
    settings = SFTSettings(max_steps=30, eval_every=1000, batch_size=64)

    model = build_tiny_model_for(tokenizer, seed=0)
    before = evaluate_answer_loss(model, tokenizer, val.prompts, val.answers)
    stats = run_sft(model, tokenizer, train, val, settings, seed=0, log=lambda _: None)
    after = evaluate_answer_loss(model, tokenizer, val.prompts, val.answers)
    # Random init predicts about uniformly over 16 tokens: ln 16 = 2.77.
    assert abs(before - math.log(16)) < 0.25
    # Knowing only the format (EOS after 3 digits, first digit of a sum is 0 or 1) gives
    # (ln 2 + 2 ln 10 + 0) / 4 = 1.32; 30 steps get most of the way there (measured 1.4-1.6).
    assert after < 1.8
    assert stats["steps"] == 30 and stats["val_accuracy"] == [[30, stats["final_val_accuracy"]]]
    assert not stats["reached_target"]

    # Bit-for-bit repeatable per seed (a few steps of a tinier model suffice to show it).
    def weights(seed):
        m = build_tiny_model_for(tokenizer, seed=seed, **vars(TINY))
        run_sft(m, tokenizer, train, val, SFTSettings(max_steps=3, eval_every=1000, batch_size=16), seed=seed,
                log=lambda _: None)
        return torch.cat([p.detach().flatten() for p in m.parameters()])

    assert torch.equal(weights(1), weights(1))


# ---- prepare_demo_assets ---------------------------------------------------------------------------

@pytest.fixture
def tiny_settings(monkeypatch):
    settings = DemoSettings(model=TINY, sft=SFTSettings(max_steps=4, eval_every=2, batch_size=16), n_replay=100)
    monkeypatch.setattr(demo_assets, "DEFAULT_SETTINGS", settings)
    return settings


def test_prepare_demo_assets_builds_then_loads_from_cache(tmp_path, tiny_settings, monkeypatch):
    lines: list[str] = []
    first = prepare_demo_assets(seed=0, cache_dir=tmp_path, log=lines.append)
    assert not first.from_cache
    assert first.sft_stats["steps"] == 4 and [s for s, _ in first.sft_stats["val_accuracy"]] == [2, 4]
    assert any("SFT: 4 steps" in line for line in lines)
    assert first.cache_dir.parent == tmp_path / "demo"
    assert [p.name for p in (tmp_path / "demo").iterdir()] == [first.cache_dir.name]  # no temporary left over

    def no_training(*args, **kwargs):
        raise AssertionError("a cached call must not train")

    monkeypatch.setattr(demo_assets, "run_sft", no_training)
    lines.clear()
    second = prepare_demo_assets(seed=0, cache_dir=tmp_path, log=lines.append)
    assert second.from_cache and second.model_dir == first.model_dir and second.sft_stats == first.sft_stats
    assert len(lines) == 1 and "cache" in lines[0]

    # Files: columns, sizes, and no test prompt anywhere else.
    train = read_jsonl(first.train_file)
    tests = {s: read_jsonl(p) for s, p in first.eval_files.items()}
    replay = read_jsonl(first.replay_file)
    assert set(first.eval_files) == {"addition", "subtraction"}
    assert set(train[0]) == {"prompt", "answer"} and set(replay[0]) == {"prompt"} and len(replay) == 100
    assert all(set(r) == {"prompt", "answer"} and len(rows) == 200 for rows in tests.values() for r in rows)
    assert len(train) == 10_000 - 200 - 200 - 100 and all("+" in r["prompt"] for r in train)
    elsewhere = {r["prompt"] for r in train + replay}
    elsewhere |= {r["prompt"] for p in first.val_files.values() for r in read_jsonl(p)}
    assert not elsewhere & {r["prompt"] for rows in tests.values() for r in rows}

    # The model folder is a normal transformers checkpoint.
    model = AutoModelForCausalLM.from_pretrained(first.model_dir)
    tokenizer = AutoTokenizer.from_pretrained(first.model_dir)
    assert model.config.hidden_size == TINY.hidden and (first.model_dir / "model.safetensors").is_file()
    assert tokenizer("07+45=")["input_ids"] == [3, 10, 13, 7, 8, 15]
    assert json.loads((first.cache_dir / "assets.json").read_text())["seed"] == 0


def test_prepare_demo_assets_leaves_no_half_cache_after_a_crash(tmp_path, tiny_settings, monkeypatch):
    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    real_sft = demo_assets.run_sft
    monkeypatch.setattr(demo_assets, "run_sft", crash)
    with pytest.raises(KeyboardInterrupt):
        prepare_demo_assets(seed=1, cache_dir=tmp_path, log=lambda _: None)
    assert list((tmp_path / "demo").iterdir()) == []
    monkeypatch.setattr(demo_assets, "run_sft", real_sft)
    assets = prepare_demo_assets(seed=1, cache_dir=tmp_path, log=lambda _: None)
    assert not assets.from_cache

    # A cache folder with a file missing is rebuilt, not trusted.
    assets.replay_file.unlink()
    lines: list[str] = []
    rebuilt = prepare_demo_assets(seed=1, cache_dir=tmp_path, log=lines.append)
    assert not rebuilt.from_cache and rebuilt.replay_file.is_file() and "incomplete" in lines[0]


def test_cache_key_and_cache_root(tmp_path, monkeypatch):
    settings = DemoSettings()
    assert demo_assets.cache_key(0, settings) == demo_assets.cache_key(0, DemoSettings())
    assert demo_assets.cache_key(0, settings) != demo_assets.cache_key(1, settings)
    assert demo_assets.cache_key(0, settings) != demo_assets.cache_key(0, DemoSettings(sft=SFTSettings(lr=1e-3)))
    monkeypatch.setenv("KLGRPO_CACHE", str(tmp_path / "k"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert default_cache_root() == tmp_path / "k"
    monkeypatch.delenv("KLGRPO_CACHE")
    assert default_cache_root() == tmp_path / "x" / "klgrpo"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_root() == tmp_path / "home" / ".cache" / "klgrpo"
