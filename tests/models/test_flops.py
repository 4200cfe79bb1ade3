"""FLOPs counting, the GPU peak table, and the built-in model's model.vocab_size."""

from __future__ import annotations

import pytest
import torch

from tests.model_support import tiny_qwen2
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
    assert (untied.hidden_size, untied.num_layers) == (32, 2)


def test_flops_of_a_pass() -> None:
    model = build_policy(TINY, vocab_size=50, max_positions=16, seed=0)
    shape = DecoderShape.of(model)
    forward = 2.0 * shape.dense_params * 10 + 4.0 * 32 * 2 * 55
    assert decoder_flops(model, tokens=10, attended=55, backward=False) == forward
    assert shape.flops(tokens=10, attended=55, backward=True) == 3 * forward
    # The value model: its trunk and scalar head, no LM head.
    value = DecoderShape.of(build_value_model(TINY, vocab_size=50, max_positions=16, seed=0))
    assert value.dense_params == shape.dense_params - 50 * 32 + 32 + 1


def test_causal_pairs_count_each_rows_real_tokens() -> None:
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]])
    assert causal_pairs(mask) == 6 + 3


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
