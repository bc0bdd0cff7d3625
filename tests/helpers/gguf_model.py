"""A tiny GGUF file written locally: a random-init Llama (GQA, tied embeddings) and a byte-level BPE tokenizer
with a ChatML template, in llama.cpp's layout, so klgrpo's GGUF loading is tested without the 98 MB SmolLM2 file.

``write_tiny_gguf`` returns the HF model it wrote, so a test can compare what loads back against it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "1 2", "Ġ 1"]  # a few byte-level merges, so BPE merging is exercised
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _byte_alphabet() -> list[str]:
    """The 256 byte-level BPE symbols, in byte order (GPT-2's byte-to-unicode table)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    codes, extra = {}, 0
    for b in range(256):
        if b in printable:
            codes[b] = chr(b)
        else:
            codes[b] = chr(256 + extra)
            extra += 1
    return [codes[b] for b in range(256)]


def tiny_vocabulary() -> list[str]:
    return SPECIAL_TOKENS + _byte_alphabet() + ["".join(m.split(" ")) for m in MERGES]


def _rope_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp stores q/k rows with each head's two rotary halves interleaved; transformers undoes this on load."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: str | Path, seed: int = 0, hidden: int = 32, layers: int = 2, heads: int = 4,
                    kv_heads: int = 2, intermediate: int = 64):
    """Write the GGUF file at ``path`` (float32 tensors); returns the transformers LlamaForCausalLM it holds."""
    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = tiny_vocabulary()
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=intermediate,
                         max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # non-trivial norm weights, so a misplaced norm would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama-test")
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_vocab_size(len(vocab))
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(vocab)
    writer.add_token_types([gguf.TokenType.CONTROL] * len(SPECIAL_TOKENS)
                           + [gguf.TokenType.NORMAL] * (len(vocab) - len(SPECIAL_TOKENS)))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_chat_template(CHATML)

    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])  # no output.weight: tied
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors = {
            "attn_norm": sd[p + "input_layernorm.weight"],
            "attn_q": _rope_permute(sd[p + "self_attn.q_proj.weight"], heads),
            "attn_k": _rope_permute(sd[p + "self_attn.k_proj.weight"], kv_heads),
            "attn_v": sd[p + "self_attn.v_proj.weight"],
            "attn_output": sd[p + "self_attn.o_proj.weight"],
            "ffn_norm": sd[p + "post_attention_layernorm.weight"],
            "ffn_gate": sd[p + "mlp.gate_proj.weight"],
            "ffn_up": sd[p + "mlp.up_proj.weight"],
            "ffn_down": sd[p + "mlp.down_proj.weight"],
        }
        for name, value in tensors.items():
            writer.add_tensor(f"blk.{i}.{name}.weight", np.ascontiguousarray(value))
    writer.add_tensor("output_norm.weight", sd["model.norm.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model
