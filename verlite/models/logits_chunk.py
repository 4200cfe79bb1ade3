"""The LM head's logits chunk size (``model.logits_chunk_tokens``): set on a causal LM's head
when it is built (``models.build_policy``), read by every log-prob pass over it
(``workers.forward``)."""

from __future__ import annotations

from torch import nn

from verlite.models.hf import output_embeddings

# Kept on the LM head module itself (the peft layer when adapters wrap it): a plain attribute,
# so a deep copy (the reference) keeps it and state dicts do not see it.
_CHUNK_ATTR = "verlite_logits_chunk_tokens"


def set_logits_chunk_tokens(model: nn.Module, tokens: int) -> None:
    """Have every log-prob pass over the causal LM ``model`` (``workers.forward``) compute
    its LM head's logits ``tokens`` tokens at a time (``model.logits_chunk_tokens``)."""
    setattr(output_embeddings(model), _CHUNK_ATTR, tokens)


def logits_chunk_tokens(head: nn.Module) -> int:
    """The chunk size :func:`set_logits_chunk_tokens` set on the LM head ``head``."""
    tokens = getattr(head, _CHUNK_ATTR, None)
    if not isinstance(tokens, int):
        raise ValueError(
            "this causal LM has no logits chunk size: build it with verlite.models.build_policy "
            "or call verlite.models.logits_chunk.set_logits_chunk_tokens on it"
        )
    return tokens
