"""Counting the whole-tensor gathers an actor runs, in the spawned rank that runs it."""

from __future__ import annotations

import torch

from verlite.workers import actor as actor_module


def count_gathers() -> list[int]:
    """The gathers ``workers.actor`` runs from now on (each ``full_tensor`` call), counted in
    this process, a spawned rank's (the real gather runs): a one-item list, read after."""
    count = [0]
    gather = actor_module.full_tensor

    def counted(value: torch.Tensor) -> torch.Tensor:
        count[0] += 1
        return gather(value)

    actor_module.full_tensor = counted
    return count
