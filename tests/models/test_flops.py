"""FLOPs counting, the GPU peak table, and the built-in model's model.vocab_size."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GemmaConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    OPTConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

from tests.model_support import tiny_moe, tiny_qwen2
from verlite.config import ConfigError, ModelConfig
from verlite.models import build_policy, build_value_model, builtin_vocab_size
from verlite.models.flops import (
    DecoderShape,
    bf16_peak_flops,
    causal_pairs,
    decoder_flops,
    hbm_bandwidth,
)

TINY = ModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)


def test_dense_parameters_count_the_lm_head_once_whether_tied_or_not() -> None:
    untied, tied = DecoderShape.of(tiny_qwen2(tied=False)), DecoderShape.of(tiny_qwen2(tied=True))
    assert tied == untied
    model = tiny_qwen2(tied=False)
    embedding = model.get_input_embeddings().weight.numel()
    assert untied.dense_params == sum(p.numel() for p in model.parameters()) - embedding
    assert (untied.attention_width, untied.num_layers) == (32, 2)


def test_flops_of_a_pass() -> None:
    model = build_policy(TINY, vocab_size=50, max_positions=16, seed=0)
    shape = DecoderShape.of(model)
    forward = 2.0 * shape.dense_params * 10 + 4.0 * 32 * 2 * 55
    assert decoder_flops(model, tokens=10, attended=55, backward=False) == forward
    assert shape.flops(tokens=10, attended=55, backward=True) == 3 * forward
    # The value model: its trunk and scalar head, no LM head.
    value = DecoderShape.of(build_value_model(TINY, vocab_size=50, max_positions=16, seed=0))
    assert value.dense_params == shape.dense_params - 50 * 32 + 32 + 1


# A pass over 10 tokens whose queries attend 55 keys in all.
TOKENS, PAIRS = 10, 55


def _tiny(config: PretrainedConfig) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def test_attention_is_counted_at_heads_times_head_dim_when_that_is_not_hidden() -> None:
    # Qwen3 sets head_dim: 4 heads of 16 are twice the hidden size of 32.
    h, heads, kv_heads, d, inner, layers, vocab = 32, 4, 2, 16, 64, 2, 100
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=h,
        intermediate_size=inner,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=d,
        tie_word_embeddings=False,
    )
    attention = (
        h * heads * d + 2 * h * kv_heads * d + heads * d * h + 2 * d
    )  # q, k, v, o; q/k norms
    layer = attention + 3 * h * inner + 2 * h  # + gated MLP, two norms
    dense = layers * layer + h + vocab * h  # + final norm, LM head (the embedding excluded)
    by_hand = 2.0 * dense * TOKENS + 4.0 * heads * d * layers * PAIRS
    assert decoder_flops(_tiny(config), tokens=TOKENS, attended=PAIRS, backward=False) == by_hand


def test_gemma_attention_is_counted_at_its_head_dim() -> None:
    h, heads, d, inner, layers, vocab = 32, 4, 24, 64, 2, 100  # 4 x 24 = 96, not 32
    config = GemmaConfig(
        vocab_size=vocab,
        hidden_size=h,
        intermediate_size=inner,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=1,
        head_dim=d,
    )
    shape = DecoderShape.of(_tiny(config))
    assert shape.attention_width == heads * d
    # q, k, v, o (one KV head), gated MLP, two norms; final norm; the LM head, tied
    layer = h * heads * d + 2 * h * d + heads * d * h + 3 * h * inner + 2 * h
    assert shape.dense_params == layers * layer + h + vocab * h


def test_embeddings_are_excluded_whatever_their_names() -> None:
    # GPT-2's token and position tables are ``wte`` and ``wpe``; its LM head is tied to wte.
    h, heads, layers, vocab, positions = 32, 4, 2, 100, 16
    config = GPT2Config(
        vocab_size=vocab, n_embd=h, n_layer=layers, n_head=heads, n_positions=positions
    )
    attention = (h * 3 * h + 3 * h) + (h * h + h)  # c_attn (q, k, v), c_proj, with biases
    mlp = (h * 4 * h + 4 * h) + (4 * h * h + h)
    layer = attention + mlp + 2 * 2 * h  # two layer norms (weight and bias)
    dense = layers * layer + 2 * h + vocab * h  # + final norm, the LM head counted once
    shape = DecoderShape.of(_tiny(config))
    assert (shape.dense_params, shape.attention_width) == (dense, h)
    assert shape.head_params == vocab * h
    # OPT names its token table embed_tokens, but its learned positions embed_positions.
    opt = OPTConfig(
        vocab_size=vocab,
        hidden_size=h,
        ffn_dim=64,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        max_position_embeddings=positions,
        word_embed_proj_dim=h,
    )
    layer = 4 * (h * h + h) + (h * 64 + 64) + (64 * h + h) + 2 * 2 * h
    assert DecoderShape.of(_tiny(opt)).dense_params == layers * layer + 2 * h + vocab * h


def test_qwen2_and_llama_attention_width_is_the_hidden_size() -> None:
    # hidden / heads is their head dim: the count is what it was before head_dim was read.
    qwen2 = DecoderShape.of(tiny_qwen2(tied=False))
    llama = LlamaConfig(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    for shape in (qwen2, DecoderShape.of(_tiny(llama))):
        assert shape.attention_width == 32
        forward = 2.0 * shape.dense_params * TOKENS + 4.0 * 32 * 2 * PAIRS
        assert shape.flops(tokens=TOKENS, attended=PAIRS, backward=False) == forward


def test_causal_pairs_count_each_rows_real_tokens() -> None:
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]])
    assert causal_pairs(mask) == 6 + 3
    # A window of 2: the i-th token attends min(i, 2) keys.
    assert causal_pairs(mask, window=2) == (1 + 2 + 2) + (1 + 2)


# Rows of 10 and 3 real tokens: 55 + 6 pairs of full causal attention; with a window of 4,
# (1 + 2 + 3 + 4 + 4 x 6) + (1 + 2 + 3).
ROWS = torch.tensor([[1] * 10, [0] * 7 + [1] * 3])
FULL, WINDOWED = 55 + 6, 34 + 6


def _attention_flops(shape: DecoderShape) -> float:
    """A forward pass's FLOPs over ROWS less its weights' (2 x dense parameters x tokens)."""
    attended, windowed = shape.pairs(ROWS)
    flops = shape.flops(tokens=13, attended=attended, windowed=windowed, backward=False)
    return flops - 2.0 * shape.dense_params * 13


def test_a_sliding_window_layer_counts_the_keys_its_window_holds() -> None:
    """Mistral slides every layer over ``sliding_window``; Qwen2 with ``use_sliding_window``
    the layers from ``max_window_layers`` on: each such layer attends min(i, window) keys at
    the i-th token. They were counted as full causal attention (55 + 6 pairs per layer here
    instead of 34 + 6)."""
    common = dict(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    mistral = DecoderShape.of(_tiny(MistralConfig(num_hidden_layers=2, sliding_window=4, **common)))
    assert (mistral.sliding_layers, mistral.sliding_window) == (2, 4)
    assert _attention_flops(mistral) == 4.0 * 32 * (2 * WINDOWED)
    qwen2 = Qwen2Config(
        num_hidden_layers=3,
        use_sliding_window=True,
        sliding_window=4,
        max_window_layers=1,
        **common,
    )
    shape = DecoderShape.of(_tiny(qwen2))
    assert _attention_flops(shape) == 4.0 * 32 * (1 * FULL + 2 * WINDOWED)
    # Without use_sliding_window Qwen2 attends in full (its sliding_window is then None).
    plain = DecoderShape.of(_tiny(Qwen2Config(num_hidden_layers=3, **common)))
    assert _attention_flops(plain) == 4.0 * 32 * 3 * FULL
    # Rows no longer than the window: the windowed count is the full one.
    short = ROWS[:, -4:]
    assert causal_pairs(short, window=4) == causal_pairs(short)


def test_a_moe_layer_counts_the_experts_a_token_is_sent_to() -> None:
    """A routed expert's weights count for the tokens sent to it: per token the
    ``num_experts_per_tok`` experts of each MoE layer, the shared expert, its gate and the
    router whole. Every expert was counted (4x the routed MLP here)."""
    h, layers, experts, inner = 32, 2, 4, 16  # tiny_moe: 4 experts of moe_intermediate 16
    expert = 3 * h * inner  # gate, up and down projections, no bias
    for kind, top_k, shared in [("qwen2_moe", 1, expert + h), ("qwen3_moe", 2, 0)]:
        model = tiny_moe(kind, num_experts_per_tok=top_k)
        block = model.model.layers[0].mlp
        by_hand = experts * h + top_k * expert + shared  # router, routed experts, shared
        assert sum(p.numel() for p in block.parameters()) == by_hand + (experts - top_k) * expert
        everything = sum(p.numel() for p in model.parameters()) - 64 * h  # but the embedding
        unused = layers * (experts - top_k) * expert
        assert DecoderShape.of(model).dense_params == everything - unused
    # Mixtral: experts of intermediate_size (32), no shared expert, top-2 of 4.
    mixtral = tiny_moe("mixtral", num_experts_per_tok=2)
    everything = sum(p.numel() for p in mixtral.parameters()) - 64 * h
    assert DecoderShape.of(mixtral).dense_params == everything - layers * 2 * (3 * h * 32)


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H200", 989.4e12),
        ("NVIDIA H100 80GB HBM3", 989.4e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835.5e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100-PCIE-40GB", 312e12),
        ("NVIDIA L40S", 362.05e12),
        ("NVIDIA L4", 121e12),
        ("NVIDIA A10", 125e12),
        ("NVIDIA A10G", None),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_bf16_peak_by_device_name(name: str, peak: float | None) -> None:
    assert bf16_peak_flops(name) == peak


@pytest.mark.parametrize(
    ("name", "bandwidth"),
    [
        ("NVIDIA H200", 4.8e12),
        ("NVIDIA H100 80GB HBM3", 3.35e12),
        ("NVIDIA H100 PCIe", 2.0e12),
        ("NVIDIA H100 NVL", 3.9e12),
        ("NVIDIA A100-SXM4-80GB", 2.039e12),
        ("NVIDIA A100 80GB PCIe", 1.935e12),
        ("NVIDIA A100-PCIE-40GB", 1.555e12),
        ("NVIDIA L40S", 864e9),
        ("NVIDIA L4", 300e9),
        ("NVIDIA A10", 600e9),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_hbm_bandwidth_by_device_name(name: str, bandwidth: float | None) -> None:
    assert hbm_bandwidth(name) == bandwidth


def test_model_vocab_size_sets_the_built_in_models_rows() -> None:
    cfg = TINY.model_copy(update={"vocab_size": 300})
    model = build_policy(cfg, vocab_size=20, max_positions=16, seed=0)
    assert model.get_input_embeddings().weight.shape[0] == 300
    assert model.get_output_embeddings().weight.shape[0] == 300
    assert builtin_vocab_size(TINY, 20) == 20


def test_model_vocab_size_below_the_tokenizer_is_one_line() -> None:
    cfg = TINY.model_copy(update={"vocab_size": 10})
    with pytest.raises(ConfigError, match=r"^model.vocab_size=10 is below the tokenizer's 20 "):
        builtin_vocab_size(cfg, 20)


def test_model_vocab_size_with_a_model_path_is_refused() -> None:
    with pytest.raises(ValueError, match=r"model.vocab_size=300 sets the built-in model's"):
        ModelConfig(path="/some/model", vocab_size=300)
