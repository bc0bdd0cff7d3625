"""How models are loaded and run: transformers (hf), LoRA adapters (peft), and klgrpo's optional KV decoder.

Nothing here knows about GRPO; core/ asks these modules for a model, its tokenizer and fast sampling.
"""
