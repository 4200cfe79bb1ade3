"""Tiny causal LMs of real Hugging Face classes built from configs (a Qwen2 with a tied or
untied LM head; Mixture-of-Experts models; a DeepSeek-V3 with latent attention;
sliding-window models; a Gemma 2's config), for tests of what depends on a model class's
structure, and the overrides of a generation too large for a small GPU."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, Gemma2Config, MistralConfig, Qwen2Config

# Two layers of hidden size 32, 4 heads / 2 KV heads, SDPA: the tiny decoders' sizes.
TINY_DECODER: dict[str, object] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "attn_implementation": "sdpa",
}


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


def tiny_moe(kind: str = "qwen2_moe", *, seed: int = 0, **overrides: object) -> torch.nn.Module:
    """A two-layer Mixture-of-Experts causal LM of a real Hugging Face class (``qwen2_moe``
    with a shared expert, ``mixtral``, ``qwen3_moe``): 4 experts of which each token uses 1
    (``num_experts_per_tok``), hidden size 32, vocabulary 64, float32."""
    settings: dict[str, object] = {
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_experts_per_tok": 1,
        "attn_implementation": "sdpa",
    }
    if kind == "mixtral":
        settings["num_local_experts"] = 4
    else:
        settings.update(num_experts=4, moe_intermediate_size=16)
    if kind == "qwen2_moe":
        settings["shared_expert_intermediate_size"] = 16
    settings.update(overrides)
    config = AutoConfig.for_model(kind, **settings)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


def tiny_mla(*, vocab_size: int = 64, seed: int = 0, **overrides: object) -> torch.nn.Module:
    """A two-layer DeepSeek-V3 (multi-head latent attention), float32: each layer caches a
    one-head latent of width 16 (``kv_lora_rank``) and a one-head rotary key of width 4
    (``qk_rope_head_dim``), not its config's 4 KV heads x head dim 4; its MLPs dense (no
    experts, which have no fp64 kernel) unless ``overrides`` say otherwise
    (``first_k_dense_replace=1``: the second layer routes to 2 of 4 experts)."""
    settings: dict[str, object] = {
        "vocab_size": vocab_size,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "first_k_dense_replace": 2,
        "kv_lora_rank": 16,
        "q_lora_rank": None,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4,
        "v_head_dim": 8,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "n_group": 1,
        "topk_group": 1,
        "attn_implementation": "sdpa",
    }
    config = AutoConfig.for_model("deepseek_v3", **{**settings, **overrides})
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


def tiny_sliding(
    kind: str, window: int | None, *, vocab_size: int = 64, seed: int = 0
) -> torch.nn.Module:
    """A two-layer causal LM of a real sliding-window class, float32, seeded alike for any
    ``window`` (None: the same weights attending in full): ``mistral`` slides every layer,
    ``qwen2`` (``use_sliding_window`` from ``max_window_layers=1`` on) only its second, as
    Hugging Face's ``layer_types`` rule puts it, ``gemma3`` (text) only its first: mixes of
    sliding and full layers."""
    common: dict[str, object] = {"vocab_size": vocab_size, **TINY_DECODER}
    if kind == "mistral":
        config = MistralConfig(sliding_window=window, **common)
    elif kind == "gemma3":
        # Its layer types also pick each layer's rotary parameters: attending in full is a
        # window no sequence reaches, not full-attention layers.
        config = AutoConfig.for_model(
            "gemma3_text",
            head_dim=8,
            sliding_window=window or 2**20,
            layer_types=["sliding_attention", "full_attention"],
            **common,
        )
    else:
        config = Qwen2Config(
            use_sliding_window=True, max_window_layers=1, sliding_window=window or 1, **common
        )
        assert config.layer_types == ["full_attention", "sliding_attention"]
        if window is None:
            config.sliding_window, config.layer_types = None, ["full_attention"] * 2
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


def tiny_gemma2_config(**settings: object) -> Gemma2Config:
    """A one-layer Gemma 2 (a real class that soft-caps its logits and has no SDPA attention)
    of hidden size 32, with ``settings`` (its vocabulary size at least)."""
    return Gemma2Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        **settings,
    )


# Overrides of configs/ppo_tiny.yaml for a Qwen2-0.5B-shaped policy generating 512 rows of 1088
# positions on a GPU a worker: its KV cache alone is 2 x 24 layers x 512 x 2 KV heads x 1088 x
# 64 x 2 bytes = 6.4 GiB, more than a GPU of 1 GiB holds.
LARGE_GENERATION = [
    "model.hidden_size=896",
    "model.num_layers=24",
    "model.num_heads=14",
    "model.num_kv_heads=2",
    "model.intermediate_size=4864",
    "model.device=cuda",
    "trainer.gpus_per_worker=1",
    "data.train_batch_size=64",
    "rollout.n=8",
    "algorithm.adv_estimator=grpo",
    "data.max_prompt_length=64",
    "rollout.max_response_length=1024",
    "actor.ppo_mini_batch_size=512",
]
