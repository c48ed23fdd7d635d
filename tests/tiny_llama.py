"""A tiny random Llama built on the spot (never downloaded), saved with save_pretrained, for the
transformers capture backend's tests and bench: real transformers modeling code, random weights."""

from __future__ import annotations

from pathlib import Path


def make_tiny_llama(directory: str | Path, vocab_size: int, hidden: int = 64, layers: int = 8,
                    attn: str = "eager", seed: int = 0, dtype: str = "bfloat16") -> str:
    """Build, save and return the path of a random LlamaForCausalLM (``layers`` >= 5 gives EAGLE-3's three
    distinct default aux layers). eager attention: a padded batch's rows equal each sample's own pass."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    heads = max(2, hidden // 32)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 3,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                      max_position_embeddings=8192, attn_implementation=attn)
    model = LlamaForCausalLM(cfg).to(getattr(torch, dtype))
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    return str(path)
