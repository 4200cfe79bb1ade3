"""A tiny Qwen2 causal LM built from a config (tied or untied LM head), for tests of what
depends on a real model class's structure."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, Qwen2Config


def tiny_qwen2(*, tied: bool, vocab_size: int = 100, seed: int = 0) -> torch.nn.Module:
    """Two layers of hidden size 32, grouped-query attention 4 / 2; ``tied``: the LM head is
    the embedding (as Qwen2.5-0.5B's)."""
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)
