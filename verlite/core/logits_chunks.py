"""Log-probs and entropy from an LM's final hidden states, a chunk of tokens at a time.

The LM head's logits of a micro-batch are a (tokens, vocab) tensor: with Qwen2.5's 152k
vocabulary, 32 rows of 1k tokens make 19 GB in fp32, and autograd keeps more of that size.
:func:`chunked_log_probs` computes them ``chunk_tokens`` tokens at a time: per chunk, the
head's logits cast to at least fp32, divided by the temperature, then the label's log-prob
and the entropy, with autocast off; with more than one chunk, each chunk is recomputed in
backward (activation checkpointing) instead of keeping its logits, so no more than one
chunk's (chunk_tokens, vocab) tensors exist at a time, forward or backward. A micro-batch
that fits one chunk is computed directly, op for op as an unchunked pass.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Literal

import torch
from torch.utils.checkpoint import checkpoint

from verlite.core.losses import entropy_from_logits, log_probs_from_logits

Head = Callable[[torch.Tensor], torch.Tensor]
# Whether a log-prob pass returns the entropy too, and how: "none"; "metric", a value no
# gradient flows back through (nor is its backward run: vocabulary-wide at every token);
# "loss", a term the loss weighs (differentiable).
Entropy = Literal["none", "metric", "loss"]


def chunked_log_probs(
    hidden: torch.Tensor,
    head: Head,
    labels: torch.Tensor,
    *,
    temperature: float,
    chunk_tokens: int,
    entropy: Entropy,
) -> torch.Tensor:
    """Per token of ``labels`` (tokens,), whose final hidden states ``hidden`` are (tokens,
    hidden_size): the log-prob of the label under ``head(hidden) / temperature`` (no
    division for a temperature of 0, greedy), and unless ``entropy`` is ``"none"`` the
    entropy of that distribution, as a fresh (1 or 2, tokens) tensor of at least fp32,
    whatever the head's dtype and autocast (:data:`Entropy`)."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if hidden.dim() != 2 or hidden.shape[0] != labels.numel() or labels.dim() != 1:
        raise ValueError(
            f"hidden states {tuple(hidden.shape)} and labels {tuple(labels.shape)}: "
            "expected (tokens, hidden_size) and (tokens,)"
        )
    stats = partial(_chunk_stats, head, temperature, entropy)
    if labels.numel() <= chunk_tokens:
        return stats(hidden, labels)
    chunks = [
        checkpoint(
            stats,
            hidden[start : start + chunk_tokens],
            labels[start : start + chunk_tokens],
            use_reentrant=False,
        )
        for start in range(0, labels.numel(), chunk_tokens)
    ]
    return torch.cat(chunks, dim=1)


def _chunk_stats(
    head: Head,
    temperature: float,
    entropy: Entropy,
    hidden: torch.Tensor,
    labels: torch.Tensor,
) -> torch.Tensor:
    logits = head(hidden)
    with torch.autocast(logits.device.type, enabled=False):
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        if temperature > 0:
            logits = logits / temperature
        stats = [log_probs_from_logits(logits, labels)]
        if entropy != "none":
            stats.append(entropy_from_logits(logits if entropy == "loss" else logits.detach()))
        return torch.stack(stats)
