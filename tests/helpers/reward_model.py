"""Tiny sequence classifiers (reward models) saved locally with their own character tokenizer.

The reward model's tokenizer orders its characters differently from the policy's (tests/conftest.py), so scoring
with the policy's token ids instead of its own gives other numbers.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForSequenceClassification, PreTrainedTokenizerFast

from klgrpo.apps.demo.model import quiet_progress_bars

#: The reward model's characters: the policy's arithmetic characters reversed, then a few for a chat template.
CHARACTERS = "=-+9876543210<>|/ uasertmy:"
PREFERRED = "7"
#: A chat template in the characters above: <user>...</> <assistant>...</> (every turn closed).
CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</>{% endfor %}"


def rm_tokenizer(pad: bool = True, chat_template: str | None = None) -> PreTrainedTokenizerFast:
    special = ["<pad>", "<eos>", "<unk>"] if pad else ["<eos>", "<unk>"]
    vocab = {t: i for i, t in enumerate(special + list(dict.fromkeys(CHARACTERS)))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", unk_token="<unk>",
                                  pad_token="<pad>" if pad else None, clean_up_tokenization_spaces=False,
                                  model_max_length=64)
    if chat_template:
        tok.chat_template = chat_template
    return tok


def build_reward_model(tokenizer, seed: int = 0, num_labels: int = 1, layers: int = 2,
                       max_positions: int = 64) -> LlamaForSequenceClassification:
    """A random-init tiny LlamaForSequenceClassification over ``tokenizer``'s vocabulary."""
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=layers, num_attention_heads=2,
                         num_key_value_heads=2, intermediate_size=32, max_position_embeddings=max_positions,
                         num_labels=num_labels, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForSequenceClassification(config)


def prefers_token(model: LlamaForSequenceClassification, tokenizer, token: str = PREFERRED):
    """Make ``model`` score the last token only, 1 for ``token`` and its cosine with ``token`` for the others: each
    layer's output projections are zeroed (the residual stream carries the embedding through unchanged), and the
    head reads the normalised embedding in the direction of ``token``'s."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        emb = model.model.embed_tokens.weight[tokenizer.convert_tokens_to_ids(token)]
        # RMSNorm maps x to sqrt(d) x / |x|, so this head gives cos(x, emb): 1 for the token itself.
        model.score.weight.copy_((emb / emb.norm() / emb.numel() ** 0.5).unsqueeze(0))
    return model


def save_reward_model(path, model, tokenizer) -> str:
    path = Path(path)
    with quiet_progress_bars():
        model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return str(path)
