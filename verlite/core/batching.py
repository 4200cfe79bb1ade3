"""Index math for splitting a batch: fixed micro-batches, token-balanced partitions, and
the inverse permutation that puts concatenated results back in the original order.

Everything here works on plain Python ints (sequence lengths may also be a 1-D integer
tensor) and returns lists of row indices; callers index their TensorDicts with them.

Token cost. A partition's cost is the sum of its rows' lengths: what a packed (padding
free) forward pays. A caller that pads each micro-batch to its longest row pays
``padded_cost`` instead, which can be up to ``len(part)`` times larger. The token budget
below bounds one of the two, as the caller asks: ``cost="packed"`` (the default) balances
token sums with Karmarkar-Karp, which mixes long and short rows in every part;
``cost="padded"`` groups rows of similar length so that ``padded_cost`` fits the budget.

Splitting never changes a loss (DESIGN §2): the normalizers are counted over the whole
mini-batch before any of these functions run, so only the grouping of rows varies.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import Literal

import torch

__all__ = [
    "MAX_PADDING",
    "TokenCost",
    "count_token_budget_partitions",
    "flatten",
    "inverse_permutation",
    "padded_cost",
    "partition_balanced",
    "partition_by_token_budget",
    "split_fixed",
]


TokenCost = Literal["packed", "padded"]
# Padding a ``cost="padded"`` partition may keep, as a share of the tokens it runs on.
MAX_PADDING = 0.05


def _as_lengths(seq_lens: Sequence[int] | torch.Tensor) -> list[int]:
    """Lengths as non-negative Python ints, from a sequence or a 1-D integer tensor."""
    if isinstance(seq_lens, torch.Tensor):
        if seq_lens.dim() != 1 or seq_lens.is_floating_point() or seq_lens.is_complex():
            raise ValueError(
                f"seq_lens must be a 1-D integer tensor, got dtype={seq_lens.dtype} "
                f"shape={tuple(seq_lens.shape)}"
            )
        lens = [int(x) for x in seq_lens.tolist()]
    else:
        lens = [int(x) for x in seq_lens]
    for i, n in enumerate(lens):
        if n < 0:
            raise ValueError(f"seq_lens[{i}] = {n} is negative")
    return lens


def flatten(index_lists: Sequence[Sequence[int]]) -> list[int]:
    """Concatenate index lists in order (the order results are concatenated in)."""
    return [i for part in index_lists for i in part]


def split_fixed(batch_size: int, *, micro_batch_size: int) -> list[list[int]]:
    """Contiguous chunks of ``micro_batch_size`` rows; the last chunk may be smaller."""
    if batch_size <= 0 or micro_batch_size <= 0:
        raise ValueError(
            f"batch_size ({batch_size}) and micro_batch_size ({micro_batch_size}) must be positive"
        )
    return [
        list(range(start, min(start + micro_batch_size, batch_size)))
        for start in range(0, batch_size, micro_batch_size)
    ]


def padded_cost(seq_lens: Sequence[int] | torch.Tensor, part: Sequence[int]) -> int:
    """Tokens a micro-batch costs when padded to its longest row: len(part) * max length."""
    lens = _as_lengths(seq_lens)
    return len(part) * max((lens[i] for i in part), default=0)


class _Part:
    """One partition inside a Karmarkar-Karp state: its token sum and its indices."""

    __slots__ = ("items", "total")

    def __init__(self, total: int, items: list[int]) -> None:
        self.total = total
        self.items = items

    def key(self) -> tuple[int, int]:
        # Ordering by (sum, count) puts an empty partition below a zero-length row, so
        # pairing largest-with-smallest never leaves a partition empty while n >= k.
        return (self.total, len(self.items))


def _spread(parts: list[_Part]) -> int:
    # parts are kept sorted ascending by key(), so the spread is last minus first.
    return parts[-1].total - parts[0].total


def partition_balanced(
    seq_lens: Sequence[int] | torch.Tensor, *, num_partitions: int, equal_size: bool = False
) -> list[list[int]]:
    """Split indices into ``num_partitions`` groups with token sums as even as possible.

    Karmarkar-Karp largest differencing, k-way: every item starts as a state of k
    partitions; the two states with the largest spread (max sum - min sum) are merged by
    pairing the largest partition of one with the smallest of the other, until one state
    is left. With ``equal_size`` the items are sorted and taken k at a time, each k-tuple
    a state with one item per partition, so every merge keeps the counts equal.

    Each returned partition is sorted ascending and partitions are ordered by their
    smallest index. Ties are broken by index, so the result depends only on the input.
    """
    lens = _as_lengths(seq_lens)
    n, k = len(lens), num_partitions
    if k <= 0:
        raise ValueError(f"num_partitions must be positive, got {k}")
    if n < k:
        raise ValueError(f"cannot split {n} sequences into {k} non-empty partitions")
    if equal_size and n % k != 0:
        raise ValueError(f"equal_size needs the {n} sequences to divide into {k} partitions")

    order = sorted(range(n), key=lambda i: (lens[i], i))
    states: list[list[_Part]] = []
    if equal_size:
        for start in range(0, n, k):
            states.append([_Part(lens[i], [i]) for i in order[start : start + k]])
    else:
        for i in order:
            states.append([_Part(0, []) for _ in range(k - 1)] + [_Part(lens[i], [i])])

    # Heap of (-spread, creation counter, state): the counter breaks spread ties by
    # creation order, which is fixed by the (length, index) sort above.
    heap = [(-_spread(s), c, s) for c, s in enumerate(states)]
    heapq.heapify(heap)
    counter = len(heap)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        # a and b are ascending: a's largest meets b's smallest.
        merged = [
            _Part(pa.total + pb.total, pa.items + pb.items)
            for pa, pb in zip(reversed(a), b, strict=True)
        ]
        merged.sort(key=_Part.key)  # stable, so equal keys keep a deterministic order
        heapq.heappush(heap, (-_spread(merged), counter, merged))
        counter += 1

    parts = [sorted(p.items) for p in heap[0][2]]
    parts.sort(key=lambda p: p[0])
    return parts


def partition_by_token_budget(
    seq_lens: Sequence[int] | torch.Tensor,
    *,
    max_tokens: int,
    min_num_partitions: int = 1,
    cost: TokenCost = "packed",
    max_padding: float = MAX_PADDING,
) -> list[list[int]]:
    """Partitions (at least ``min_num_partitions``) whose cost all fits in ``max_tokens``
    (dynamic batching). Partitions are never empty.

    ``cost="packed"``: the token sum of a partition; the fewest balanced partitions that
    fit. Starts from k = max(min_num_partitions, ceil(total / max_tokens)) and raises k
    until ``partition_balanced`` fits; k = len(seq_lens) always fits since every row does.

    ``cost="padded"``: ``padded_cost``, rows x longest row, for callers that pad each
    micro-batch to its longest row. Rows of similar length go together, in as few
    partitions as keep padding within ``max_padding`` of the padded tokens (see
    :func:`_partition_padded`).

    ``count_token_budget_partitions`` with the same arguments is the count of this
    partition with no minimum.
    """
    if cost not in ("packed", "padded"):
        raise ValueError(f"unknown token cost {cost!r}; use packed or padded")
    if not 0.0 <= max_padding < 1.0:
        raise ValueError(f"max_padding must be in [0, 1), got {max_padding}")
    lens = _as_lengths(seq_lens)
    n = len(lens)
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    if min_num_partitions <= 0:
        raise ValueError(f"min_num_partitions must be positive, got {min_num_partitions}")
    if min_num_partitions > n:
        raise ValueError(
            f"min_num_partitions ({min_num_partitions}) exceeds the number of sequences ({n})"
        )
    for i, length in enumerate(lens):
        if length > max_tokens:
            raise ValueError(f"sequence {i} has {length} tokens, more than max_tokens={max_tokens}")
    if cost == "padded":
        return _partition_padded(
            lens, max_tokens=max_tokens, num_partitions=min_num_partitions, max_padding=max_padding
        )

    k = max(min_num_partitions, math.ceil(sum(lens) / max_tokens))
    while True:
        parts = partition_balanced(lens, num_partitions=k)
        if k == n or all(sum(lens[i] for i in p) <= max_tokens for p in parts):
            return parts
        k += 1


def _partition_padded(
    lens: list[int], *, max_tokens: int, num_partitions: int, max_padding: float
) -> list[list[int]]:
    """Runs of rows sorted by length, each run's ``padded_cost`` within ``max_tokens``.

    1. Rows are sorted longest first and cut greedily: a run starts at its longest row and
       takes rows while ``rows x that length`` fits. That is the fewest partitions possible
       (some optimal partition is always made of such runs: give the part holding the
       longest row the longest rows of all, and no other part's longest row grows; greedy
       cutting is optimal for runs).
    2. On a long-tailed batch those few runs pad heavily: a budget of a few longest rows
       puts rows of very different lengths together. Runs are then cut further, each time
       where one cut saves the most padded tokens, until padding is at most
       ``max_padding`` of the padded tokens and there are ``num_partitions`` runs. A cut
       costs one more forward/backward call, so cuts go where they save the most, and rows
       that pad little (dense short rows) keep sharing large micro-batches.

    Cutting a run (longest first) of m rows before its row j turns m x len[0] into
    j x len[0] + (m - j) x len[j], a saving of (m - j) x (len[0] - len[j]); among equal
    savings the most even cut wins, so runs of equal lengths split in halves.

    Each partition is sorted ascending and partitions are ordered by their smallest index;
    ties are broken by index, so the result depends only on the input. The caller has
    checked that every row fits and that 0 < num_partitions <= rows.
    """
    order = sorted(range(len(lens)), key=lambda i: (-lens[i], i))
    ordered = [lens[i] for i in order]
    # Runs are [start, end) ranges of ``order``.
    runs: list[tuple[int, int]] = []
    for pos in range(len(ordered)):
        if runs and (pos - runs[-1][0] + 1) * ordered[runs[-1][0]] <= max_tokens:
            runs[-1] = (runs[-1][0], pos + 1)
        else:
            runs.append((pos, pos + 1))
    real = sum(ordered)
    padded = sum((end - start) * ordered[start] for start, end in runs)
    cuts = {run: _best_cut(run, ordered) for run in runs}
    while len(cuts) < num_partitions or real < (1.0 - max_padding) * padded:
        # The run whose cut saves most; ties: the more even cut, then the longer rows.
        run, (saving, _, at) = max(cuts.items(), key=lambda kv: (*kv[1][:2], -kv[0][0]))
        del cuts[run]
        for piece in ((run[0], at), (at, run[1])):
            cuts[piece] = _best_cut(piece, ordered)
        padded -= saving
    parts = [sorted(order[start:end]) for start, end in cuts]
    parts.sort(key=lambda p: p[0])
    return parts


def _best_cut(run: tuple[int, int], ordered: list[int]) -> tuple[int, int, int]:
    """(padded tokens saved, evenness, cut position) of the best cut of ``run``;
    (-1, -1, -1) for a run of one row, which cannot be cut."""
    start, end = run
    best = (-1, -1, -1)
    top = ordered[start]
    for at in range(start + 1, end):
        key = ((end - at) * (top - ordered[at]), min(at - start, end - at), at)
        best = max(best, key)
    return best


def count_token_budget_partitions(
    seq_lens: Sequence[int] | torch.Tensor,
    *,
    max_tokens: int,
    cost: TokenCost = "packed",
    max_padding: float = MAX_PADDING,
) -> int:
    """Number of partitions ``partition_by_token_budget`` makes with no minimum.

    DP ranks all-reduce the MAX of this and pass it as ``min_num_partitions``, so every
    rank runs the same number of micro-batches (and so the same number of backward calls
    before the gradient sync).
    """
    return len(
        partition_by_token_budget(
            seq_lens, max_tokens=max_tokens, cost=cost, max_padding=max_padding
        )
    )


def inverse_permutation(index_lists: Sequence[Sequence[int]]) -> list[int]:
    """``inv`` such that ``concat(results)[inv]`` is back in original row order.

    ``index_lists`` concatenated must be a permutation of ``range(n)``: position ``p`` of
    the concatenation holds row ``flat[p]``, so row ``i`` sits at ``inv[i] = p``.
    """
    flat = flatten(index_lists)
    n = len(flat)
    inv = [-1] * n
    for pos, i in enumerate(flat):
        if not 0 <= i < n:
            raise ValueError(f"index {i} is out of range for a permutation of {n} rows")
        if inv[i] != -1:
            raise ValueError(f"index {i} appears more than once")
        inv[i] = pos
    return inv
