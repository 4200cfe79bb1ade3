"""FLOPs of a decoder's passes and the bf16 dense peak of the GPU they run on: what a model
FLOPs utilization (MFU) figure is made of; and the GPU's memory bandwidth, what a decode
step's roofline is made of.

A pass costs 2 x the model's dense parameters per token (every weight matrix the token goes
through, the LM head included, the embeddings excluded: lookups, whatever they are named; of a
Mixture-of-Experts layer's routed experts only the ``num_experts_per_tok`` a token is sent to,
its shared experts and router whole) and 4 x heads x head_dim per attended (query, key) pair
of each layer (scores and weighted values: each of the query heads' dot products and sums is
head_dim wide, which is not hidden / heads in every model: Qwen3's and Gemma's heads are
wider; a sliding-window layer's query attends the last ``sliding_window`` keys at most); a
backward pass twice a forward one. The GPU's peak is its datasheet's dense (no sparsity)
bf16 tensor-core figure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from verlite.models.hf import config_of, input_embeddings, output_embeddings

# Dense bf16 tensor-core peak FLOP/s by the words torch.cuda.get_device_name() holds, the most
# specific first. From the vendors' datasheets (the sparsity figures halved):
# - H100 and H200 SXM: 989.4 TFLOPS (NVIDIA H100 datasheet, "BF16 Tensor Core 1,979 teraFLOPS
#   with sparsity"; NVIDIA H200 datasheet, the same figure; an H200 reports "NVIDIA H200").
# - H100 PCIe: 756 TFLOPS (NVIDIA H100 datasheet, 1,513 with sparsity).
# - H100 NVL: 835.5 TFLOPS (NVIDIA H100 datasheet, 1,671 with sparsity).
# - A100 (SXM and PCIe): 312 TFLOPS (NVIDIA A100 datasheet, "BF16 Tensor Core 312 TFLOPS").
# - L40S: 362.05 TFLOPS (NVIDIA L40S datasheet, 733 with sparsity).
# - A10G / A10: 125 TFLOPS (NVIDIA A10 datasheet, 250 with sparsity).
# - L4: 121 TFLOPS (NVIDIA L4 datasheet, 242 with sparsity).
BF16_PEAK_FLOPS: tuple[tuple[tuple[str, ...], float], ...] = (
    (("H100", "NVL"), 835.5e12),
    (("H100", "PCIE"), 756e12),
    (("H100",), 989.4e12),
    (("H200",), 989.4e12),
    (("A100",), 312e12),
    (("L40S",), 362.05e12),
    (("A10",), 125e12),
    (("L4",), 121e12),
)


# HBM bandwidth in bytes/s by the same words, from the same datasheets ("GPU Memory
# Bandwidth"): H200 4.8 TB/s; H100 SXM 3.35, PCIe 2.0, NVL 3.9 TB/s; A100 80GB SXM 2,039,
# 80GB PCIe 1,935, 40GB 1,555 GB/s; L40S 864 GB/s; A10 600 GB/s; L4 300 GB/s. What a
# decode step, which reads every weight and the KV cache once, is bound by.
HBM_BANDWIDTH: tuple[tuple[tuple[str, ...], float], ...] = (
    (("H100", "NVL"), 3.9e12),
    (("H100", "PCIE"), 2.0e12),
    (("H100",), 3.35e12),
    (("H200",), 4.8e12),
    (("A100", "80GB", "PCIE"), 1.935e12),
    (("A100", "80GB"), 2.039e12),
    (("A100",), 1.555e12),
    (("L40S",), 864e9),
    (("A10",), 600e9),
    (("L4",), 300e9),
)


def _by_device_name(
    table: tuple[tuple[tuple[str, ...], float], ...], device_name: str
) -> float | None:
    """The figure of the first row of ``table`` whose words all appear in ``device_name``."""
    words = device_name.upper().replace("-", " ").split()
    for keys, value in table:
        if all(key in words for key in keys):
            return value
    return None


def bf16_peak_flops(device_name: str) -> float | None:
    """The dense bf16 peak of the GPU ``torch.cuda.get_device_name()`` calls ``device_name``;
    None for one the table does not know."""
    return _by_device_name(BF16_PEAK_FLOPS, device_name)


def hbm_bandwidth(device_name: str) -> float | None:
    """The memory bandwidth (bytes/s) of the GPU ``torch.cuda.get_device_name()`` calls
    ``device_name``; None for one the table does not know."""
    return _by_device_name(HBM_BANDWIDTH, device_name)


@dataclass(frozen=True)
class DecoderShape:
    """What a decoder's FLOPs depend on: its dense parameters (the module docstring's: those
    a token goes through), the width of its attention (query heads x head dim), its layer
    count and, of those, the sliding-window layers and their window."""

    dense_params: int
    attention_width: int
    num_layers: int
    # Of the dense parameters, the LM head's (0 for a model without one: a value model).
    head_params: int = 0
    sliding_layers: int = 0
    sliding_window: int | None = None

    @classmethod
    def of(cls, model: nn.Module) -> DecoderShape:
        """The shape of a Hugging Face decoder (or a peft model or value model around one).
        An LM head tied to the input embedding is counted once, as the LM head."""
        config = next(config_of(m) for m in model.modules() if hasattr(m, "config"))
        inner = next(m for m in model.modules() if hasattr(m, "get_output_embeddings"))
        head, embedding = output_embeddings(inner), input_embeddings(inner)
        lookups = {id(p) for p in _embedding_parameters(model, embedding)}
        dense = sum(p.numel() for p in model.parameters() if id(p) not in lookups)
        dense -= _unused_expert_parameters(model, config)
        weight = None if head is None else head.weight
        # an LM head's weight (a peft layer's: its base layer's)
        assert weight is None or isinstance(weight, torch.Tensor)
        if weight is not None and id(weight) in lookups:
            dense += weight.numel()
        head_params = 0 if weight is None else weight.numel()
        layers = int(config.num_hidden_layers)
        sliding, window = sliding_window_layers(config)
        return cls(dense, attention_width(config), layers, head_params, sliding, window)

    def flops(
        self,
        *,
        tokens: float,
        attended: float,
        backward: bool,
        head_tokens: float | None = None,
        windowed: float | None = None,
    ) -> float:
        """One pass over ``tokens`` tokens whose queries attend ``attended`` keys in all in a
        full-attention layer (:func:`causal_pairs`) and ``windowed`` in a sliding-window one
        (``causal_pairs`` with the window; None: ``attended``, no sequence being longer
        than the window), the LM head over ``head_tokens`` of them (all when None: a
        log-prob pass runs it only where a response token is predicted); with
        ``backward``, forward and backward (3x)."""
        through_head = tokens if head_tokens is None else head_tokens
        windowed = attended if windowed is None else windowed
        full_layers = self.num_layers - self.sliding_layers
        pairs = full_layers * attended + self.sliding_layers * windowed
        flops = (
            2.0 * (self.dense_params - self.head_params) * tokens
            + 2.0 * self.head_params * through_head
            + 4.0 * self.attention_width * pairs
        )
        return 3.0 * flops if backward else flops

    def pairs(self, attention_mask: torch.Tensor) -> tuple[float, float]:
        """:meth:`flops`'s ``attended`` and ``windowed`` of a pass over ``attention_mask``."""
        return (
            causal_pairs(attention_mask),
            causal_pairs(attention_mask, window=self.sliding_window),
        )


def attention_width(config: Any) -> int:
    """Query heads x head dim of a Hugging Face config: its ``head_dim`` where it sets one
    (Qwen3, Gemma: wider than hidden / heads), else hidden / heads."""
    heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // heads
    return heads * int(head_dim)


def sliding_window_layers(config: Any) -> tuple[int, int | None]:
    """How many layers of a Hugging Face config attend a sliding window, and the window, as
    its model builds them: the layers its ``layer_types`` names ``sliding_attention`` (Qwen2
    and Qwen3 with ``use_sliding_window``, from ``max_window_layers`` on; Gemma 2 and 3),
    every layer when it has no ``layer_types`` but a ``sliding_window`` (Mistral, Mixtral,
    Qwen3-MoE with ``use_sliding_window``); (0, None) otherwise."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return 0, None
    types = getattr(config, "layer_types", None)
    if types is None:
        return int(config.num_hidden_layers), int(window)
    sliding = sum(kind == "sliding_attention" for kind in types)
    return sliding, (int(window) if sliding else None)


def _unused_expert_parameters(model: nn.Module, config: Any) -> int:
    """The parameters of the routed experts a token is not sent to: of each experts module
    (Hugging Face keeps a layer's experts as 3-D parameters, one slice per expert, in a
    module with ``num_experts``: Qwen2-MoE, Qwen3-MoE, Mixtral, ...) all but the config's
    ``num_experts_per_tok`` of its ``num_experts``. Shared experts and routers are dense."""
    top_k = getattr(config, "num_experts_per_tok", None)
    unused = 0
    for module in model.modules():
        experts = getattr(module, "num_experts", None)
        if top_k is None or not isinstance(experts, int) or experts <= top_k:
            continue
        for param in module.parameters(recurse=False):
            if param.dim() == 3 and param.shape[0] == experts:
                unused += param.numel() // experts * (experts - int(top_k))
    return unused


def _embedding_parameters(model: nn.Module, embedding: nn.Module) -> list[nn.Parameter]:
    """The parameters of ``model``'s lookups: every ``nn.Embedding`` (token and learned
    position tables, whatever their names: GPT-2's ``wte``/``wpe``, OPT's
    ``embed_positions``) and the input embedding the model names, whatever its type."""
    tables = [m for m in model.modules() if isinstance(m, nn.Embedding)] + [embedding]
    return [p for table in tables for p in table.parameters()]


def decoder_flops(
    model: nn.Module,
    *,
    tokens: float,
    attended: float,
    backward: bool,
    head_tokens: float | None = None,
    windowed: float | None = None,
) -> float:
    """:meth:`DecoderShape.flops` of ``model``."""
    return DecoderShape.of(model).flops(
        tokens=tokens,
        attended=attended,
        backward=backward,
        head_tokens=head_tokens,
        windowed=windowed,
    )


def causal_pairs(attention_mask: torch.Tensor, *, window: int | None = None) -> float:
    """The (query, key) pairs causal attention computes over the real tokens of each row of
    ``attention_mask`` (1 for a real token): L (L + 1) / 2 for a row of L. With a sliding
    ``window`` (Hugging Face's: a query attends itself and the ``window - 1`` keys before
    it) the i-th token (from 1) attends min(i, window) keys: W (W + 1) / 2 + (L - W) W for
    a row longer than W."""
    lengths = attention_mask.sum(-1).double()
    pairs = lengths * (lengths + 1) / 2
    if window is not None:
        beyond = (lengths - window).clamp(min=0)
        pairs = torch.where(beyond > 0, window * (window + 1) / 2 + beyond * window, pairs)
    return float(pairs.sum())
