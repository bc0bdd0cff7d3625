"""klgrpo kl: the exact per-token KL between two models equals verify-kl's exact categorical KL at each prefix
(one-token completions: the prompt's next-token distributions) and a float64 brute force over the vocabulary at
longer completions; a model against itself gives 0 everywhere; the table and the JSON."""

from __future__ import annotations

import json

import pytest
import torch

from klgrpo.apps import kl as kl_app
from klgrpo.apps.cli import main as cli
from klgrpo.verify.categorical import CategoricalProblem, kl_values_and_gradients
from tests.conftest import write_jsonl


@pytest.fixture(scope="module")
def model_pair(tiny_model_dir, tmp_path_factory):
    """(policy folder, reference folder, prompt file): the tiny model and a copy with perturbed weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("kl_pair")
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.3 * torch.randn_like(p))
    ref.save_pretrained(root / "ref")
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(root / "ref")
    prompts = write_jsonl(root / "prompts.jsonl", [{"prompt": f"{a:02d}+{b:02d}="} for a, b in
                                                   [(1, 2), (13, 40), (7, 7), (22, 9), (30, 31)]])
    return str(tiny_model_dir), str(root / "ref"), str(prompts)


def _args(policy, reference, prompts, **kw):
    argv = [policy, reference, "--prompts", prompts, "--device", "cpu"]
    for key, value in kw.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    return kl_app._parser().parse_args(argv)


def _next_token_logits(folder, prompt: str) -> torch.Tensor:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    ids = AutoTokenizer.from_pretrained(folder)(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return model(input_ids=ids).logits[0, -1]


def test_one_token_completions_give_verify_kls_exact_categorical_kl(model_pair):
    policy, reference, prompts = model_pair
    report = kl_app.measure(_args(policy, reference, prompts, samples=3, max_new_tokens=1))
    exact = []
    for row in open(prompts):
        prompt = json.loads(row)["prompt"]
        p, r = _next_token_logits(policy, prompt), _next_token_logits(reference, prompt)
        exact.append(kl_values_and_gradients(CategoricalProblem(logits=p, ref_logits=r, mu_logits=p))["reverse"])
    assert report["tokens"] == 15 and report["sequences"] == 15  # 5 prompts x 3 one-token completions
    full = report["per_token"]["full"]
    assert min(exact) > 1e-3  # the pair differs
    assert full["mean"] == pytest.approx(sum(exact) / len(exact), rel=1e-5)
    assert full["min"] == pytest.approx(min(exact), rel=1e-5) and full["max"] == pytest.approx(max(exact), rel=1e-5)
    assert report["per_sequence"]["full"]["mean"] == pytest.approx(full["mean"], rel=1e-12)  # one token each


def test_longer_completions_match_a_float64_brute_force(model_pair):
    from transformers import AutoModelForCausalLM

    from klgrpo.apps.models import load_model_for_inference
    from klgrpo.config.schema import ModelConfig
    from klgrpo.core.full_kl import completion_logprobs_and_full_kl
    from klgrpo.core.reference import FrozenCopyReference
    from klgrpo.core.rollout import SamplingParams, generate_groups

    policy_dir, reference_dir, _ = model_pair
    policy, tok = load_model_for_inference(policy_dir, ModelConfig(name_or_path=policy_dir, device="cpu",
                                                                   dtype="float32"), "POLICY")
    reference = FrozenCopyReference(AutoModelForCausalLM.from_pretrained(reference_dir))
    torch.manual_seed(0)
    rollout = generate_groups(policy, tok, ["01+02=", "13+40="], SamplingParams(group_size=2, max_new_tokens=4))
    values = kl_app._token_values(policy, reference, rollout, 1.0, completion_logprobs_and_full_kl)
    p64 = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float64)
    r64 = AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float64)
    mask, t = rollout.completion_mask.bool(), rollout.completion_ids.shape[1]
    for i in range(rollout.size):
        keep = rollout.attention_mask[i].bool()
        ids = rollout.input_ids[i][keep].unsqueeze(0)  # this row without its left padding
        with torch.no_grad():
            a = torch.log_softmax(p64(input_ids=ids).logits[0], -1)
            r = torch.log_softmax(r64(input_ids=ids).logits[0], -1)
        n = int(mask[i].sum())
        start = ids.shape[1] - (int(rollout.attention_mask[i, rollout.prompt_len:].sum())) - 1
        brute = (a.exp() * (a - r)).sum(-1)[start:start + n]
        torch.testing.assert_close(values["full"][i, :n], brute, rtol=1e-4, atol=1e-6)
        l = a.gather(-1, ids[0, 1:, None])[:, 0] - r.gather(-1, ids[0, 1:, None])[:, 0]
        torch.testing.assert_close(values["k1"][i, :n], l[start:start + n], rtol=1e-4, atol=1e-5)
        for name, logp_all in (("entropy_policy", a), ("entropy_reference", r)):  # both models' entropies
            brute_entropy = -(logp_all.exp() * logp_all).sum(-1)[start:start + n]
            torch.testing.assert_close(values[name][i, :n], brute_entropy, rtol=1e-4, atol=1e-5)
        assert t >= n > 0


def test_a_model_against_itself_is_zero_and_the_cli_prints_and_writes(model_pair, tmp_path, capsys):
    policy, _, prompts = model_pair
    out = tmp_path / "kl.json"
    assert cli(["kl", policy, policy, "--prompts", prompts, "--samples", "2", "--max-new-tokens", "3",
                "--device", "cpu", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    for name in kl_app.ESTIMATES:  # zero up to float32 rounding (the two copies run different kernels)
        stats = report["per_token"][name]
        assert max(abs(stats["max"]), abs(stats["min"])) < 1e-6, name
    assert report["entropy"]["policy"] == pytest.approx(report["entropy"]["reference"], abs=1e-5)  # same model
    assert report["entropy"]["policy"] > 0.01
    text = capsys.readouterr().out
    assert "5 prompts x 2 completions sampled from the policy" in text and f"written to {out}" in text
    assert "mean entropy per token at these prefixes (nats): policy " in text
    assert cli(["kl", policy, policy, "--prompts", prompts, "--samples", "0"]) == 2
    assert "--samples must be >= 1" in capsys.readouterr().err


def test_the_default_length_is_what_the_context_leaves_after_the_longest_prompt(model_pair, tmp_path, capsys):
    """The tiny model's context is 32 positions: the default completion length is 32 minus the longest prompt's
    tokens (64 would not fit); a length given is kept; a prompt that fills the context is one line, exit 2."""
    from transformers import AutoConfig, AutoTokenizer

    policy, reference, prompts = model_pair
    context = AutoConfig.from_pretrained(policy).max_position_embeddings
    tokenizer = AutoTokenizer.from_pretrained(policy)
    longest = max(len(tokenizer(json.loads(line)["prompt"])["input_ids"]) for line in open(prompts))
    assert context == 32 and 0 < context - longest < kl_app.DEFAULT_MAX_NEW_TOKENS
    out = tmp_path / "kl.json"
    assert cli(["kl", policy, reference, "--prompts", prompts, "--samples", "1", "--device", "cpu",
                "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert (report["max_new_tokens"], report["max_new_tokens_from"]) == (context - longest, "context")
    assert f"up to {context - longest} tokens (what the model's context leaves" in capsys.readouterr().out
    assert cli(["kl", policy, reference, "--prompts", prompts, "--samples", "1", "--device", "cpu",
                "--max-new-tokens", "3", "--json", str(out), "--overwrite"]) == 0
    report = json.loads(out.read_text())
    assert (report["max_new_tokens"], report["max_new_tokens_from"]) == (3, "--max-new-tokens")
    capsys.readouterr()
    too_long = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "1+2="}, {"prompt": "1" * 40}])
    assert cli(["kl", policy, reference, "--prompts", str(too_long), "--device", "cpu"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith(f"klgrpo kl: error: prompt 1 of {too_long} has ")
    assert "max_position_embeddings" in err[0]


def test_the_help_states_how_the_default_length_is_derived(capsys):
    with pytest.raises(SystemExit):
        cli(["kl", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"default {kl_app.DEFAULT_MAX_NEW_TOKENS}, or what POLICY's context leaves after the longest prompt" in text
    assert "max_position_embeddings" in text
