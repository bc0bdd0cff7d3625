"""greedy_accuracy / greedy_completions on a model whose greedy output is known by construction."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from klgrpo.apps.demo.tokenizer import build_char_tokenizer
from klgrpo.run.evaluation import exact_match, greedy_accuracy, greedy_completions

TOKENIZER = build_char_tokenizer()
ID = TOKENIZER.convert_tokens_to_ids
EOS = TOKENIZER.eos_token_id

#: The next token of the successor model, as a function of the current token only.
SUCCESSOR = {str(d): str(d + 1) for d in range(8)} | {"8": "<eos>", "9": "0", "=": "3", "+": "<eos>", "-": "-"}


def successor_model() -> LlamaForCausalLM:
    """A Llama whose greedy next token depends only on the current token, through SUCCESSOR.

    Attention and MLP outputs are zeroed (o_proj = down_proj = 0), so the residual stream at each
    position is the embedding of the current token, here the one-hot e_i. RMSNorm maps it to
    sqrt(16) e_i, and the untied lm_head row of SUCCESSOR[i] is the only one with weight on i.
    """
    vocab = len(TOKENIZER)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=vocab, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
        intermediate_size=8, max_position_embeddings=32, tie_word_embeddings=False, pad_token_id=0, eos_token_id=EOS,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.eye(vocab))
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.zero_()
        for token, nxt in SUCCESSOR.items():
            model.lm_head.weight[ID(nxt), ID(token)] = 1.0
    return model


# Prompts of different lengths (left padding inside one batch) and their completions with 3 new tokens:
#   "12="  -> '=' 3, 4, 5          -> "345"
#   "7"    -> 8, <eos>             -> "8"
#   "3+"   -> <eos>                -> ""
#   "29"   -> 0, 1, 2              -> "012"
#   "1-"   -> -, -, -              -> "---"
PROMPTS = ["12=", "7", "3+", "29", "1-"]
COMPLETIONS = ["345", "8", "", "012", "---"]


@pytest.mark.parametrize("batch_size", [256, 2])
def test_greedy_completions_are_the_constructed_ones(batch_size):
    model = successor_model()
    assert greedy_completions(model, TOKENIZER, PROMPTS, max_new_tokens=3, batch_size=batch_size) == COMPLETIONS
    # "12=" with room for 7 new tokens: 3 4 5 6 7 8 <eos> -> cut at EOS.
    assert greedy_completions(model, TOKENIZER, ["12="], max_new_tokens=7) == ["345678"]


def test_greedy_accuracy_exact_value_and_mode_restored():
    model = successor_model()
    answers = [" 345 ", "8", "", "012", "x"]  # stripped exact match: 4 of 5 right
    model.train()
    assert greedy_accuracy(model, TOKENIZER, PROMPTS, answers, max_new_tokens=3, batch_size=2) == pytest.approx(0.8)
    assert model.training and torch.is_grad_enabled()
    assert all(p.grad is None for p in model.parameters())
    model.eval()
    assert greedy_accuracy(model, TOKENIZER, PROMPTS[:2], ["345", "9"], max_new_tokens=3) == pytest.approx(0.5)
    assert not model.training


def test_greedy_accuracy_uses_the_reward_function():
    seen = {}

    def length_reward(prompts, completions, answer, **_):
        seen.update(prompts=prompts, completions=completions, answer=answer)
        return [len(c) for c in completions]

    acc = greedy_accuracy(successor_model(), TOKENIZER, PROMPTS, list("abcde"), max_new_tokens=3,
                          reward_fn=length_reward)
    assert acc == pytest.approx((3 + 1 + 0 + 3 + 3) / 5)
    assert seen == {"prompts": PROMPTS, "completions": COMPLETIONS, "answer": list("abcde")}
    assert exact_match(["p", "p"], [" 7\n", "8"], answer=["7", " 9"]) == [1.0, 0.0]


def test_greedy_accuracy_rejects_bad_input():
    model = successor_model()
    with pytest.raises(ValueError, match="2 prompts but 1 answers"):
        greedy_accuracy(model, TOKENIZER, ["1", "2"], ["1"], max_new_tokens=2)
    with pytest.raises(ValueError, match="no prompts"):
        greedy_accuracy(model, TOKENIZER, [], [], max_new_tokens=2)
    with pytest.raises(ValueError, match="encodes to no tokens"):
        greedy_completions(model, TOKENIZER, ["1", ""], max_new_tokens=2)


def test_left_padded_batch_equals_one_prompt_at_a_time():
    from klgrpo.apps.demo.model import build_tiny_model_for

    model = build_tiny_model_for(TOKENIZER, seed=5, hidden=32, layers=1, heads=2, intermediate=64)
    prompts = ["07+45=", "7+5=", "=", "99-9=", "1"]
    one_by_one = [greedy_completions(model, TOKENIZER, [p], max_new_tokens=4)[0] for p in prompts]
    assert greedy_completions(model, TOKENIZER, prompts, max_new_tokens=4) == one_by_one


def test_every_eos_of_the_generation_config_ends_a_completion():
    model = successor_model()
    model.generation_config.eos_token_id = [EOS, ID("5")]  # as chat models list several
    # "12=" -> 3 4 5: '5' is now an EOS too, so the completion is cut before it.
    assert greedy_completions(model, TOKENIZER, ["12=", "7"], max_new_tokens=6) == ["34", "8"]


def _entropy(logits: torch.Tensor, temperature: float) -> float:
    logp = torch.log_softmax(logits.double() / temperature, -1)
    return float(-(logp.exp() * logp).sum())


@pytest.mark.parametrize("batch_size", [256, 2])
def test_greedy_entropy_counts_each_completion_token_and_its_eos(batch_size):
    from klgrpo.run.evaluation import GreedyEntropy

    model = successor_model()
    # Every counted position reads a SUCCESSOR token: logit a on its successor, 0 on the 15 others, a being
    # RMSNorm's scale of a one-hot. A finished row's padding reads token 0 (all logits 0): log 16 if counted.
    a = 1 / (1 / 16 + model.config.rms_norm_eps) ** 0.5
    logits = torch.zeros(16)
    logits[0] = a
    entropy = GreedyEntropy()
    assert greedy_completions(model, TOKENIZER, PROMPTS, 3, batch_size, entropy, temperature=0.7) == COMPLETIONS
    # "345" 3 tokens, "8" + <eos> 2, "" + <eos> 1, "012" 3, "---" 3
    assert entropy.tokens == 12
    assert entropy.mean == pytest.approx(_entropy(logits, 0.7), rel=1e-6)
    assert GreedyEntropy().mean != GreedyEntropy().mean  # nothing measured: NaN


def test_greedy_entropy_equals_a_hand_greedy_decode():
    from klgrpo.apps.demo.model import build_tiny_model_for
    from klgrpo.run.evaluation import GreedyEntropy

    model = build_tiny_model_for(TOKENIZER, seed=5, hidden=32, layers=1, heads=2, intermediate=64)
    prompts, new_tokens, temperature = ["07+45=", "7+5=", "=", "99-9=", "1"], 4, 1.3
    total, count = 0.0, 0
    with torch.no_grad():  # one prompt at a time, a full forward per token, no generate
        for prompt in prompts:
            ids = TOKENIZER(prompt)["input_ids"]
            for _ in range(new_tokens):
                last = model(torch.tensor([ids])).logits[0, -1]
                total, count = total + _entropy(last, temperature), count + 1
                ids.append(int(last.argmax()))
                if ids[-1] == EOS:
                    break
    entropy = GreedyEntropy()
    greedy_accuracy(model, TOKENIZER, prompts, ["x"] * 5, new_tokens, 2, entropy=entropy, temperature=temperature)
    assert entropy.tokens == count
    assert entropy.mean == pytest.approx(total / count, rel=1e-5)


def test_an_eval_set_named_like_an_entropy_metric_is_refused(tiny_model_dir, addition_file):
    from klgrpo.config.validation import validate_config
    from klgrpo.errors import ConfigError
    from tests.helpers.configs import make_config

    sets = [{"name": "add/entropy", "source": str(addition_file)}]
    with pytest.raises(ConfigError, match=r"eval.sets\[0\].name 'add/entropy' ends in '/entropy'"):
        validate_config(make_config(tiny_model_dir, addition_file, "unused", eval={"sets": sets}))
    sets[0]["name"] = "add/entropy_free"
    validate_config(make_config(tiny_model_dir, addition_file, "unused", eval={"sets": sets}))
