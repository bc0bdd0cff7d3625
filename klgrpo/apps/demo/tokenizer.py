"""A character-level tokenizer for the demo's arithmetic, built as a real transformers tokenizer.

Every character is one token (a WordLevel model over single characters after a per-character split),
so ``save_pretrained`` / ``AutoTokenizer.from_pretrained`` round-trip exactly and the rest of klgrpo
treats it like any hub tokenizer.

Conventions the trainer relies on:
- no BOS token and no post-processor: ``tokenizer(text)`` gives the characters' ids and nothing else,
  whatever ``add_special_tokens`` says, so rollout, SFT and evaluation cannot disagree about a BOS;
- ``<pad>`` is id 0, ``<eos>`` id 1 (ends every answer), ``<unk>`` id 2 (any character outside the
  vocabulary, e.g. a space);
- decoding concatenates characters (no spaces inserted).
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN, UNK_TOKEN)
#: The characters of the arithmetic tasks, in id order after the special tokens.
CHARACTERS = "0123456789+-="


def char_vocabulary(characters: str = CHARACTERS) -> dict[str, int]:
    """Token -> id: the special tokens first (pad=0, eos=1, unk=2), then one id per character."""
    tokens = list(SPECIAL_TOKENS) + list(dict.fromkeys(characters))
    return {token: i for i, token in enumerate(tokens)}


def build_char_tokenizer(characters: str = CHARACTERS) -> PreTrainedTokenizerFast:
    """A fast tokenizer with one token per character of ``characters`` plus pad/eos/unk (16 tokens by default)."""
    core = Tokenizer(models.WordLevel(vocab=char_vocabulary(characters), unk_token=UNK_TOKEN))
    # Split before every character ("isolated": each match becomes its own piece).
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=64,
    )
