"""A micro-batch as one packed row (``actor.packing``, ``critic.packing``): the real tokens of
its sequences end to end, and the way back to the response-aligned (b, r) layout that
losses, advantages and metrics use (``verlite.step_batch``).

In the step layout a row is a left-padded prompt then a right-padded response; its real
tokens (``attention_mask``) are contiguous. Packed, row ``i`` takes positions
``[start_i, start_i + length_i)`` of one row of ``T = sum(length)`` tokens, keeping its
``position_ids`` (already counted over real tokens, so they restart per sequence), and
attention stays within it (``verlite.models.varlen``). Response token ``j`` of row ``i`` is
predicted at the position before it, as in the padded layout; only those positions go
through the LM head or value head, and their outputs are scattered back to (b, r), zero
where a row has no response token.

The layout is computed from the micro-batch on the CPU, before it is copied to the device
(``train_engine.micro_batch``), and copied with it (:meth:`PackedRows.apply`): computed on
a GPU, its boolean indexing, ``nonzero`` and ``tolist`` each waited for the device to finish
its queue. On the device, the forward and backward passes only gather and scatter by index.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from tensordict import TensorDict

from verlite.models.varlen import KWARG, PackedAttention
from verlite.step_batch import response_width


@dataclass(frozen=True)
class PackedRows:
    input_ids: torch.Tensor  # (1, T)
    position_ids: torch.Tensor  # (1, T)
    attention: PackedAttention
    predict: torch.Tensor  # (N,) the packed positions that predict a real response token
    slots: torch.Tensor  # (N,) where the tokens they predict are in the flattened (b, r)
    shape: torch.Size  # (b, r)

    def model_inputs(self) -> dict[str, Any]:
        """Keyword arguments of a causal LM (or ``ValueModel``) forward over the packed row,
        with outputs at the ``predict`` positions only. Its 2-D mask is all ones, as every
        token of the row is real: without one, a pass that keeps no KV cache has Hugging Face
        look for packed sequences in the positions, which reads the device."""
        return {
            "input_ids": self.input_ids,
            "attention_mask": torch.ones_like(self.input_ids, dtype=torch.bool),
            "position_ids": self.position_ids,
            "logits_to_keep": self.predict,
            KWARG: self.attention,
        }

    def to_rows(self, values: torch.Tensor) -> torch.Tensor:
        """(N,) outputs at the ``predict`` positions as (b, r), zero elsewhere."""
        rows = values.new_zeros(self.shape.numel())
        return rows.index_copy(0, self.slots, values).view(self.shape)

    def from_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The (N,) entries of (b, r) ``rows`` at the tokens the ``predict`` positions predict."""
        return rows.reshape(-1)[self.slots]

    def apply(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> PackedRows:
        """The same packed row with ``fn`` applied to each of its tensors (a copy to a device)."""
        return replace(
            self,
            input_ids=fn(self.input_ids),
            position_ids=fn(self.position_ids),
            attention=self.attention.apply(fn),
            predict=fn(self.predict),
            slots=fn(self.slots),
        )


def pack_rows(td: TensorDict) -> PackedRows:
    """The packed row of a (trimmed) micro-batch in the step layout, on the device of ``td``
    (the CPU, see the module's doc)."""
    mask = td["attention_mask"].bool()
    b, width = mask.shape
    prompt_width = width - response_width(td)
    # The packed position of every real token, row by row: a running count over the mask.
    packed_index = mask.reshape(-1).cumsum(0).reshape(b, width) - 1
    real = mask[:, prompt_width:]
    predicting = packed_index[:, prompt_width - 1 : width - 1]
    return PackedRows(
        input_ids=td["input_ids"][mask][None],
        position_ids=td["position_ids"][mask][None],
        attention=PackedAttention.from_lengths(mask.sum(1)),
        predict=predicting[real],
        slots=real.reshape(-1).nonzero().flatten(),
        shape=real.shape,
    )
