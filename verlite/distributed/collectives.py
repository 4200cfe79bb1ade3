"""Collectives over the default group that degrade to no-ops on a single process."""

from __future__ import annotations

from typing import TypeVar

import torch
import torch.distributed as dist

from verlite.distributed.process_group import get_world_size

T = TypeVar("T")


def _active() -> bool:
    # Skipping at world size 1 keeps single-process runs free of any process group.
    return get_world_size() > 1


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` over ranks, in place; returns ``t``."""
    if _active():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    """Elementwise maximum of ``t`` over ranks, in place; returns ``t``."""
    if _active():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


def all_reduce_mean(t: torch.Tensor) -> torch.Tensor:
    """Mean of ``t`` over ranks, in place; returns ``t`` (floating point only)."""
    if not t.is_floating_point():
        raise TypeError(f"all_reduce_mean needs a floating-point tensor, got {t.dtype}")
    if _active():
        # Sum then divide rather than ReduceOp.AVG: gloo has no AVG.
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t.div_(get_world_size())
    return t


def all_gather_object(obj: T) -> list[T]:
    """Every rank's ``obj`` (picklable), ordered by rank."""
    if not _active():
        return [obj]
    out: list[T | None] = [None] * get_world_size()
    dist.all_gather_object(out, obj)
    return out  # type: ignore[return-value]  # every slot now holds a rank's obj


def broadcast_object(obj: T, src: int = 0) -> T:
    """Rank ``src``'s ``obj`` (picklable) on every rank."""
    if not _active():
        return obj
    box: list[T | None] = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]  # type: ignore[return-value]  # rank src's obj now
