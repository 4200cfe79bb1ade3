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

from verlite.core.metrics import Metric, Stage, reduce_metrics, to_floats
from verlite.core.partition import inverse_permutation, partition_balanced


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
        [(_take_rows(batch, share), *rest) for share in shares],
        [dict(kwargs)] * world,
        restore=inverse_permutation(shares),
    )


def _is_identity(rows: Sequence[int]) -> bool:
    return all(i == row for i, row in enumerate(rows))


def _take_rows(batch: TensorDict, rows: list[int]) -> TensorDict:
    # A single rank gets every row in order: the batch itself, not a gathered copy of it.
    if len(rows) == batch.batch_size[0] and _is_identity(rows):
        return batch
    index = torch.tensor(rows, dtype=torch.long)
    # index_select copies rows ~2.5x faster than advanced indexing (batch[index]) on CPU.
    return batch.apply(
        lambda value: value.index_select(0, index), batch_size=[len(rows), *batch.batch_size[1:]]
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
        if restore is None or _is_identity(restore):
            joined = _concat(results)
            if restore is not None:
                _check_rows(joined.shape[0], len(restore))
            return joined
        _check_rows(sum(int(r.shape[0]) for r in results), len(restore))
        if not _same_non_tensors(results):
            return _concat(results)[torch.tensor(restore, dtype=torch.long)]
        return _scatter_in_order(results, restore)
    raise ValueError(f"unknown collect {mode!r}; use concat, rank0, list or metrics")


def _concat(results: Sequence[Any]) -> Any:
    # One rank's result is the whole batch already; concatenating would only copy it.
    return results[0] if len(results) == 1 else torch.cat(list(results))


def _check_rows(returned: int, expected: int) -> None:
    if returned != expected:
        raise ValueError(
            f"ranks returned {returned} rows in all for a batch of {expected}; "
            "'concat' needs one result row per input row"
        )


def _same_non_tensors(results: Sequence[Any]) -> bool:
    """Whether the results' non-tensor entries agree (``torch.cat`` would stack them per row
    otherwise); plain tensors have none."""
    if not isinstance(results[0], TensorDict):
        return True
    values = [
        {key: td.get_non_tensor(key) for key, _ in td.non_tensor_items(include_nested=True)}
        for td in results
    ]
    return all(v == values[0] for v in values[1:])


def _scatter_in_order(results: Sequence[Any], restore: Sequence[int]) -> Any:
    """``concat(results)[restore]`` with one copy instead of two: each rank's rows are
    written straight to their places in the original order."""
    n = len(restore)
    # Position p of the concatenation holds row ``flat[p]``; the rows of rank r are the
    # consecutive positions of its result.
    flat = torch.empty(n, dtype=torch.long)
    flat[torch.tensor(restore, dtype=torch.long)] = torch.arange(n)
    rows = flat.split([int(r.shape[0]) for r in results])

    def scatter(*values: torch.Tensor) -> torch.Tensor:
        out = values[0].new_empty((n, *values[0].shape[1:]))
        for index, value in zip(rows, values, strict=True):
            out.index_copy_(0, index, value)
        return out

    first = results[0]
    if isinstance(first, torch.Tensor):
        return scatter(*results)
    # apply keeps the non-tensor entries of the first result, equal on every rank here.
    return first.apply(scatter, *results[1:], batch_size=[n, *first.batch_size[1:]])
