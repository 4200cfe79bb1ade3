"""How a worker-group call spreads its arguments over the ranks and combines their results.

Every call names both explicitly (docs/design.md, "Dispatch"):

dispatch
    ``"broadcast"``  the same arguments to every rank;
    ``"all"``        every argument is already a list with one element per rank;
    ``"dp_split"``   the first positional argument, a ``TensorDict`` whose batch dimension is
                     sequences, is split over the ranks with balanced token counts; the other
                     arguments are broadcast. ``DpSplit(mini_batches=k)`` splits each of k
                     contiguous chunks separately and hands every rank its share cut into
                     them, ``(k, rows)`` (see :func:`verlite.core.partition.dp_shares`).
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
from verlite.core.partition import dp_shares, inverse_permutation
from verlite.step_batch import cut_mini_batches, row_costs, take_rows


@dataclass(frozen=True)
class DpSplit:
    """``dp_split``; with ``mini_batches=k`` the batch is k global mini-batches, each balanced
    over the ranks on its own, and every rank receives its share as a ``(k, rows)``
    TensorDict whose row j is its piece of mini-batch j (``core.partition.dp_shares``).
    ``crossover``: the receiving role runs packed rows, whose cost the shares balance
    (``step_batch.row_costs``)."""

    mini_batches: int | None = None
    crossover: int | None = None


Dispatch = Literal["broadcast", "all", "dp_split"] | DpSplit
Collect = Literal["concat", "rank0", "list", "metrics"]


@dataclass(frozen=True)
class Plan:
    """The arguments of each rank, and the permutation that restores the original row order
    of concatenated results (None when the rows were not split)."""

    args: list[tuple[Any, ...]]
    kwargs: list[dict[str, Any]]
    restore: list[int] | None = None


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
    k = split.mini_batches
    shares = dp_shares(row_costs(batch, split.crossover), world=world, mini_batches=k or 1)
    pieces = [take_rows(batch, share) for share in shares]
    if k is not None:
        pieces = [cut_mini_batches(piece, k) for piece in pieces]
    return Plan(
        [(piece, *rest) for piece in pieces],
        [dict(kwargs)] * world,
        restore=inverse_permutation(shares),
    )


def _is_identity(rows: Sequence[int]) -> bool:
    return all(i == row for i, row in enumerate(rows))


def check_pairing(mode: Dispatch, collect_mode: Collect) -> None:
    """``concat`` puts result rows back in batch order; shares cut into mini-batches have no
    single row order to return, so that pairing is refused."""
    if isinstance(mode, DpSplit) and mode.mini_batches is not None and collect_mode == "concat":
        raise ValueError(
            "collect 'concat' cannot follow DpSplit(mini_batches=k): ranks receive (k, rows) "
            "shares; use dp_split to get rows back in order"
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
