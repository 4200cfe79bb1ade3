"""Forward passes over a (trimmed) batch that return response-aligned tensors.

Only the positions that predict response tokens go through the LM head
(``logits_to_keep``): for r response columns that is the last r + 1 positions, of which
the last predicts past the end and is dropped.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict
from torch import nn

from verlite.core.losses import entropy_from_logits, log_probs_from_logits
from verlite.step_batch import response_width


def _model_inputs(td: TensorDict) -> dict[str, torch.Tensor | int]:
    return {
        "input_ids": td["input_ids"],
        "attention_mask": td["attention_mask"],
        "position_ids": td["position_ids"],
        "logits_to_keep": response_width(td) + 1,
    }


def response_logits(model: nn.Module, td: TensorDict, *, temperature: float) -> torch.Tensor:
    """(b, r, vocab) logits that predict each response token, divided by the sampling temperature."""
    logits = model(**_model_inputs(td)).logits[:, :-1]
    # The policy that sampled the responses used logits / T; its log-probs must match.
    return logits / temperature if temperature > 0 else logits


def response_log_probs(
    model: nn.Module, td: TensorDict, *, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    logits = response_logits(model, td, temperature=temperature)
    log_probs = log_probs_from_logits(logits, td["responses"])
    return log_probs, entropy_from_logits(logits) if with_entropy else None


def response_values(model: nn.Module, td: TensorDict) -> torch.Tensor:
    """(b, r) values: the critic's estimate at the state before each response token."""
    values: torch.Tensor = model(**_model_inputs(td))
    return values[:, :-1]
