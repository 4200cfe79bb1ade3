"""How a worker-group call spreads its arguments over the ranks and combines their results.

Every call names both explicitly (DESIGN §4.5):

dispatch
    ``"broadcast"``  the same arguments to every rank;
    ``"all"``        every argument is already a list with one element per rank;
    ``"dp_split"``   the first positional argument, a ``TensorDict`` whose batch dimension is
                     sequences, is split over the ranks with balanced token counts; the other
                     arguments are broadcast. ``DpSplit(mini_batches=k)`` splits each of k
                     contiguous chunks separately (see :func:`split_rows`).
collect
    ``"concat"``     ranks return TensorDicts (or tensors) row-aligned with what they got;
                     they are concatenated and, after a ``dp_split``, put back in the order
                     of the original batch;
    ``"rank0"``      rank 0's result;
    ``"list"``       every rank's result, by rank;
    ``"metrics"``    ranks return ``dict[str, Metric]``; reduced over ranks
                     (``Stage.RANKS``) to plain floats.

Everything here is pure: no Ray, no processes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from tensordict import TensorDict

from verlite.core.batching import inverse_permutation, partition_balanced
from verlite.core.metrics import Metric, Stage, reduce_metrics, to_floats


@dataclass(frozen=True)
class DpSplit:
    """``dp_split`` with the batch cut into ``mini_batches`` global mini-batches first."""

    mini_batches: int = 1


Dispatch = Literal["broadcast", "all", "dp_split"] | DpSplit
Collect = Literal["concat", "rank0", "list", "metrics"]


@dataclass(frozen=True)
class Plan:
    """The arguments of each rank, and the permutation that restores the original row order
    of concatenated results (None when the rows were not split)."""

    args: list[tuple[Any, ...]]
    kwargs: list[dict[str, Any]]
    restore: list[int] | None = None


def row_lengths(td: TensorDict) -> list[int]:
    """The cost of each row: its real tokens, or 1 per row when there is no attention mask."""
    if "attention_mask" in td:
        return [int(n) for n in td["attention_mask"].sum(-1).tolist()]
    return [1] * int(td.batch_size[0])


def split_rows(lengths: Sequence[int], *, world: int, mini_batches: int = 1) -> list[list[int]]:
    """Row indices of each rank: token-balanced, with equal row counts whenever they divide.

    The batch is first cut into ``mini_batches`` contiguous chunks (the global mini-batches
    of one update); each chunk is balanced over the ranks on its own, and rank r gets its
    pieces concatenated in chunk order. Every piece of a rank has the same size, so a worker
    that cuts its share into ``mini_batches`` equal parts gets in part j exactly its piece
    of global mini-batch j. The optimizer steps therefore see the same global mini-batches
    whatever the number of ranks; balancing the whole batch at once would mix rows of
    different mini-batches in a way that depends on the DP size.
    """
    n = len(lengths)
    if mini_batches < 1:
        raise ValueError(f"mini_batches must be >= 1, got {mini_batches}")
    if n % mini_batches:
        raise ValueError(f"cannot cut {n} rows into {mini_batches} equal mini-batches")
    chunk = n // mini_batches
    if mini_batches > 1 and chunk % world:
        raise ValueError(
            f"each mini-batch of {chunk} rows must divide over the {world} ranks, so that "
            "every rank's share cuts into equal parts"
        )
    shares: list[list[int]] = [[] for _ in range(world)]
    for start in range(0, n, chunk):
        parts = partition_balanced(
            lengths[start : start + chunk], num_partitions=world, equal_size=chunk % world == 0
        )
        for share, part in zip(shares, parts, strict=True):
            share.extend(start + i for i in part)
    return shares


def dispatch(mode: Dispatch, world: int, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Plan:
    """The per-rank arguments of one call over ``world`` ranks."""
    if mode == "broadcast":
        return Plan([tuple(args)] * world, [dict(kwargs)] * world)
    if mode == "all":
        for name, value in [*((f"argument {i}", a) for i, a in enumerate(args)), *kwargs.items()]:
            if not isinstance(value, Sequence) or len(value) != world:
                raise ValueError(
                    f"dispatch 'all' needs one element per rank: {name} must be a list of "
                    f"length {world}"
                )
        return Plan(
            [tuple(a[rank] for a in args) for rank in range(world)],
            [{k: v[rank] for k, v in kwargs.items()} for rank in range(world)],
        )
    if isinstance(mode, DpSplit):
        split = mode
    elif mode == "dp_split":
        split = DpSplit()
    else:
        raise ValueError(f"unknown dispatch {mode!r}; use broadcast, all, dp_split or DpSplit")
    if not args or not isinstance(args[0], TensorDict):
        raise TypeError("dp_split splits the first positional argument, which must be a TensorDict")
    batch, rest = args[0], tuple(args[1:])
    shares = split_rows(row_lengths(batch), world=world, mini_batches=split.mini_batches)
    return Plan(
        [(batch[torch.tensor(share, dtype=torch.long)], *rest) for share in shares],
        [dict(kwargs)] * world,
        restore=inverse_permutation(shares),
    )


def collect(mode: Collect, results: Sequence[Any], restore: Sequence[int] | None = None) -> Any:
    """Combine the results of every rank (in rank order) as ``mode`` says."""
    if mode == "list":
        return list(results)
    if mode == "rank0":
        return results[0]
    if mode == "metrics":
        parts: list[Mapping[str, Metric]] = list(results)
        return to_floats(reduce_metrics(parts, Stage.RANKS))
    if mode == "concat":
        joined = torch.cat(list(results))
        if restore is None:
            return joined
        if len(restore) != joined.shape[0]:
            raise ValueError(
                f"ranks returned {joined.shape[0]} rows in all for a batch of {len(restore)}; "
                "'concat' needs one result row per input row"
            )
        return joined[torch.tensor(restore, dtype=torch.long)]
    raise ValueError(f"unknown collect {mode!r}; use concat, rank0, list or metrics")
