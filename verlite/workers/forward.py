"""Forward passes over a (trimmed) micro-batch that return response-aligned (b, r) tensors.

Only the positions that predict response tokens go through the LM head (``logits_to_keep``):
padded, the r positions before the last, for r response columns (the value head: the last
r + 1, of which the last predicts past the end and is dropped); packed
(``verlite.workers.packing``, when the engine marks the micro-batch with :func:`mark_packed`),
exactly the positions that predict a real response token, whose outputs come back as (b, r)
with zeros elsewhere.

A log-prob pass never returns logits: for the one call, the LM head returns the response
tokens' log-probs (and entropies) computed from its hidden states by
``core.logits_chunks.chunked_log_probs``, ``model.logits_chunk_tokens`` tokens at a time
(:func:`_head_log_probs`). It runs inside the model's own forward, where FSDP2 has
the head's weight unsharded.

No pass here keeps a KV cache (:func:`_forward`): a Hugging Face model's config asks for one
by default, and the forward then builds a cache and copies every layer's keys and values
into it, for nothing to read them again. A pass over a micro-batch the engine marked with
its padding (:func:`mark_padding`, read on the CPU) builds its attention mask from that
(``models.varlen.known_padding``) instead of Hugging Face's checks of the device's mask.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict
from torch import nn

from verlite.config import ConfigError
from verlite.core.logits_chunks import Entropy, chunked_log_probs
from verlite.distributed import unwrap
from verlite.models.hf import output_embeddings
from verlite.models.logits_chunk import logits_chunk_tokens
from verlite.models.varlen import Padding, known_padding
from verlite.step_batch import response_width
from verlite.workers.packing import PackedRows, pack_rows

PACKED_KEY = "packed"
PADDED_KEY = "padded"


def mark_packed(td: TensorDict, rows: PackedRows | None = None) -> None:
    """Have the forward passes over ``td`` run it packed, as ``rows``: its packed row
    (``pack_rows``), built from ``td`` itself when not given. The engine gives the row it
    built on the CPU before copying ``td`` to the device (``train_engine.micro_batch``)."""
    td.set_non_tensor(PACKED_KEY, pack_rows(td) if rows is None else rows)


def _packed(td: TensorDict) -> PackedRows | None:
    if PACKED_KEY not in set(td.keys()):
        return None
    rows: PackedRows = td.get_non_tensor(PACKED_KEY)
    return rows


def mark_padding(td: TensorDict, padded: bool) -> None:
    """Have the forward passes over ``td`` (in the padded layout) build their attention mask
    knowing whether a row of it is ``padded``: the engine reads it from its CPU copy
    (``train_engine.micro_batch``)."""
    td.set_non_tensor(PADDED_KEY, padded)


def _padding(td: TensorDict) -> Padding | None:
    """The padding of ``td`` as marked (packed or :func:`mark_padding`); None when unmarked."""
    keys = set(td.keys())
    if PACKED_KEY in keys:
        return Padding.PACKED
    if PADDED_KEY in keys:
        return Padding.SOME if td.get_non_tensor(PADDED_KEY) else Padding.NONE
    return None


def _padded_inputs(td: TensorDict) -> dict[str, torch.Tensor]:
    return {
        "input_ids": td["input_ids"],
        "attention_mask": td["attention_mask"],
        "position_ids": td["position_ids"],
    }


def _forward(model: nn.Module, inputs: dict[str, Any], padding: Padding | None) -> Any:
    """``model(**inputs)`` without a KV cache (``use_cache=False``): the same outputs, bit
    for bit, without building a cache and copying each layer's keys and values into it; its
    mask built knowing ``padding`` (:func:`_padding`)."""
    with known_padding(padding):
        return model(**inputs, use_cache=False)


def response_log_probs(
    model: nn.Module,
    td: TensorDict,
    *,
    temperature: float,
    entropy: Entropy,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(b, r) log-probs of the response tokens under logits / the sampling temperature (the
    policy that sampled them used those), and the entropy of that distribution unless
    ``entropy`` is ``"none"`` (:data:`~verlite.core.logits_chunks.Entropy`)."""
    packed = _packed(td)
    if packed is None:
        width = td["input_ids"].shape[1]
        device = td["input_ids"].device
        predict = torch.arange(width - response_width(td) - 1, width - 1, device=device)
        inputs = {**_padded_inputs(td), "logits_to_keep": predict}
        labels = td["responses"]
    else:
        inputs = packed.model_inputs()
        labels = packed.from_rows(td["responses"])
    stats = _head_log_probs(
        model,
        inputs,
        labels,
        padding=_padding(td),
        temperature=temperature,
        entropy=entropy,
    )
    # One (b, r) tensor per statistic: the log-probs, then the entropy when asked.
    if packed is None:
        rows = [stat.reshape(labels.shape) for stat in stats]
    else:
        rows = [packed.to_rows(stat) for stat in stats]
    return rows[0], None if entropy == "none" else rows[1]


def _head_log_probs(
    model: nn.Module,
    inputs: dict[str, Any],
    labels: torch.Tensor,
    *,
    padding: Padding | None,
    temperature: float,
    entropy: Entropy,
) -> torch.Tensor:
    """``model(**inputs)`` (:func:`_forward`) with its LM head returning, for this one call, the
    ``chunked_log_probs`` of ``labels`` (the positions its input holds, in order) instead
    of logits: a fresh (1 or 2, tokens) tensor (FSDP2 warns of a view returned by its root
    module). The chunks call the head module itself, with its own forward restored: a peft
    layer adds its adapters, hooks run; the sampler's calls see the head as it always is."""
    head = output_embeddings(unwrap(model))
    assert head is not None  # a causal LM's (or a peft model's over one)
    chunk_tokens = logits_chunk_tokens(head)
    returned: list[torch.Tensor] = []

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        del head.forward
        returned.append(
            chunked_log_probs(
                hidden.reshape(-1, hidden.shape[-1]),
                head,
                labels.reshape(-1),
                temperature=temperature,
                chunk_tokens=chunk_tokens,
                entropy=entropy,
            )
        )
        return returned[0]

    head.forward = forward
    try:
        stats: torch.Tensor = _forward(model, inputs, padding).logits
    finally:
        head.__dict__.pop("forward", None)
    # A model that changes the head's output (Gemma's logit soft-capping, Cohere's and
    # Granite's logit scales) would change the log-probs instead: refused, not trained on.
    if not returned or not _same(stats, returned[0]):
        name = type(unwrap(model)).__name__
        raise ConfigError(
            f"model.path: {name} does not return its LM head's output as its logits (e.g. logit "
            "soft-capping or scaling), which verlite's log-probs, computed inside the head "
            "(model.logits_chunk_tokens), cannot follow; use a model whose logits are its "
            "LM head's output (Llama, Qwen2, Mistral)"
        )
    return stats


def _same(out: torch.Tensor, returned: torch.Tensor) -> bool:
    """Whether the model returned what its head did (a wrapper may return a copy)."""
    if out is returned:
        return True
    return out.shape == returned.shape and torch.allclose(
        out, returned, rtol=0, atol=0, equal_nan=True
    )


def response_values(model: nn.Module, td: TensorDict) -> torch.Tensor:
    """(b, r) values: the critic's estimate at the state before each response token."""
    packed = _packed(td)
    if packed is None:
        inputs = {**_padded_inputs(td), "logits_to_keep": response_width(td) + 1}
        values: torch.Tensor = _forward(model, inputs, _padding(td))
        return values[:, :-1]
    return packed.to_rows(_forward(model, packed.model_inputs(), _padding(td))[0])
