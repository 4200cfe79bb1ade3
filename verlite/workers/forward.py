"""Forward passes over a (trimmed) micro-batch that return response-aligned (b, r) tensors.

Only the positions that predict response tokens go through the LM head (``logits_to_keep``):
padded, for r response columns that is the last r + 1 positions, of which the last
predicts past the end and is dropped; packed (``verlite.workers.packing``, when the engine
marks the micro-batch with :func:`mark_packed`), exactly the positions that predict a real
response token, whose outputs come back as (b, r) with zeros elsewhere.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict
from torch import nn

from verlite.core.losses import entropy_from_logits, log_probs_from_logits
from verlite.step_batch import response_width
from verlite.workers.packing import PackedRows, pack_rows

PACKED_KEY = "packed"


def mark_packed(td: TensorDict) -> None:
    """Have the forward passes over ``td`` run it packed."""
    td.set_non_tensor(PACKED_KEY, True)


def _packed(td: TensorDict) -> PackedRows | None:
    return pack_rows(td) if PACKED_KEY in set(td.keys()) else None


def _padded_inputs(td: TensorDict) -> dict[str, torch.Tensor | int]:
    return {
        "input_ids": td["input_ids"],
        "attention_mask": td["attention_mask"],
        "position_ids": td["position_ids"],
        "logits_to_keep": response_width(td) + 1,
    }


def response_log_probs(
    model: nn.Module, td: TensorDict, *, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(b, r) log-probs of the response tokens under logits / the sampling temperature (the
    policy that sampled them used those), and the entropy of that distribution if asked."""
    packed = _packed(td)
    if packed is None:
        logits = model(**_padded_inputs(td)).logits[:, :-1]
        tokens = td["responses"]
    else:
        logits = model(**packed.model_inputs()).logits[0]
        tokens = td["responses"][packed.real]
    # At least fp32 from here on: bf16 logits (under autocast) would round the log-probs.
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if temperature > 0:
        logits = logits / temperature
    log_probs = log_probs_from_logits(logits, tokens)
    entropy = entropy_from_logits(logits) if with_entropy else None
    if packed is None:
        return log_probs, entropy
    return packed.to_rows(log_probs), None if entropy is None else packed.to_rows(entropy)


def response_values(model: nn.Module, td: TensorDict) -> torch.Tensor:
    """(b, r) values: the critic's estimate at the state before each response token."""
    packed = _packed(td)
    if packed is None:
        values: torch.Tensor = model(**_padded_inputs(td))
        return values[:, :-1]
    return packed.to_rows(model(**packed.model_inputs())[0])
