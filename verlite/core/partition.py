"""How a batch is cut, planned in one place: the data-parallel shares of a step's global
mini-batches (:func:`dp_shares`), micro-batches of a fixed size (:func:`split_fixed`) or
by a token budget (:class:`TokenBudgetPartition`), the micro-batches a rank runs
(:class:`MicroBatchPlan`), and the inverse permutation that puts concatenated results back
in the original order.

Everything here works on plain Python ints (sequence lengths may also be a 1-D integer
tensor) and returns lists of row indices; ``verlite.step_batch`` applies them to
TensorDicts (``take_rows``, ``cut_mini_batches``).

Token budget (dynamic batching). A micro-batch runs padded to its own width, so what
a budget must bound is ``padded_cost``, rows x width, not the rows' token sum: balancing
token sums (as ``partition_balanced`` does across DP ranks) mixes a long
row into every micro-batch and pads the short ones to it. ``partition_by_token_budget``
groups rows of similar length instead, and keeps padding within ``MAX_PADDING``.

Splitting never changes a loss (docs/design.md, "The normalization contract"): the
normalizers are counted over the whole mini-batch before any of these functions run, so
only the grouping of rows varies.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "MAX_PADDING",
    "MicroBatchPlan",
    "PackedTokenPartition",
    "TokenBudgetPartition",
    "dp_shares",
    "flatten",
    "inverse_permutation",
    "padded_cost",
    "partition_balanced",
    "partition_by_token_budget",
    "split_fixed",
]


# Padding a token-budget partition may keep, as a share of the tokens it runs on.
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


def padded_cost(
    seq_lens: Sequence[int] | torch.Tensor,
    part: Sequence[int],
    prompt_lens: Sequence[int] | torch.Tensor | None = None,
) -> int:
    """Tokens a micro-batch runs on when padded: rows x width.

    Without ``prompt_lens`` the width is the longest row. With it, each row is a
    left-padded prompt of ``prompt_lens[i]`` tokens then a right-padded response of the
    rest, so the width is the longest prompt plus the longest response — more than the
    longest row when a short prompt's row has the longest response.
    """
    lens = _as_lengths(seq_lens)
    prompts = _prompt_lengths(lens, prompt_lens)
    if not part:
        return 0
    width = max(prompts[i] for i in part) + max(lens[i] - prompts[i] for i in part)
    return len(part) * width


def _prompt_lengths(lens: list[int], prompt_lens: Sequence[int] | torch.Tensor | None) -> list[int]:
    """Prompt lengths checked against the row lengths (all zero when not given)."""
    if prompt_lens is None:
        return [0] * len(lens)
    prompts = _as_lengths(prompt_lens)
    if len(prompts) != len(lens):
        raise ValueError(f"prompt_lens has {len(prompts)} rows, seq_lens {len(lens)}")
    for i, (prompt, total) in enumerate(zip(prompts, lens, strict=True)):
        if prompt > total:
            raise ValueError(f"prompt_lens[{i}] = {prompt} exceeds seq_lens[{i}] = {total}")
    return prompts


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
    is left. With ``equal_size`` every group gets the same number of items instead (see
    ``_partition_equal_counts``).

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

    if equal_size:
        return _sorted_parts(_partition_equal_counts(lens, k))

    order = sorted(range(n), key=lambda i: (lens[i], i))
    states = [[_Part(0, []) for _ in range(k - 1)] + [_Part(lens[i], [i])] for i in order]

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

    return _sorted_parts([p.items for p in heap[0][2]])


def _sorted_parts(parts: list[list[int]]) -> list[list[int]]:
    """Each partition ascending, partitions ordered by their smallest index."""
    return sorted((sorted(p) for p in parts), key=lambda p: p[0])


def _partition_equal_counts(lens: list[int], k: int) -> list[list[int]]:
    """``k`` groups of ``len(lens) // k`` items each with token sums as even as possible.

    Longest first, each item joins the lightest group that still has room; then the
    heaviest group trades an item for a shorter one of a lighter group while that lowers
    it. On long-tailed lengths this lands within 0.1% of the best possible for k <= 8 (the
    classic balanced Karmarkar-Karp, merging sorted k-tuples, was 14% above on average
    and 26% in the worst case at k = 8: a rank's whole step waits on the heaviest share).
    """
    size = len(lens) // k
    groups: list[list[int]] = [[] for _ in range(k)]
    sums = [0] * k
    open_groups = [(0, g) for g in range(k)]  # (sum, group) of groups with room; a heap
    for i in sorted(range(len(lens)), key=lambda i: (-lens[i], i)):
        _, g = heapq.heappop(open_groups)
        groups[g].append(i)
        sums[g] += lens[i]
        if len(groups[g]) < size:
            heapq.heappush(open_groups, (sums[g], g))
    while _trade_from_heaviest(lens, groups, sums):
        pass
    return groups


def _trade_from_heaviest(lens: list[int], groups: list[list[int]], sums: list[int]) -> bool:
    """Swap one item of the heaviest group for a shorter one of a lighter group, the pair
    whose difference comes closest to half the gap between the two; False when no swap
    lowers the heaviest group. Both new sums stay below the old maximum, so the sorted
    sums decrease at every swap and repeating this ends."""
    heavy = max(range(len(groups)), key=lambda g: (sums[g], -g))
    for light in sorted(range(len(groups)), key=lambda g: (sums[g], g)):
        gap = sums[heavy] - sums[light]
        if light == heavy or gap < 2:
            break
        # light's items by length: for each item a of heavy, the light item b nearest to
        # lens[a] - gap / 2 gives the swap difference nearest to gap / 2.
        shorter = sorted(groups[light], key=lambda i: (lens[i], i))
        shorter_lens = [lens[i] for i in shorter]
        best: tuple[int, int, int] | None = None
        for a in groups[heavy]:
            at = bisect.bisect_left(shorter_lens, lens[a] - gap / 2)
            for b in shorter[max(at - 1, 0) : at + 1]:
                diff = lens[a] - lens[b]
                if 0 < diff < gap and (best is None or abs(gap - 2 * diff) < best[0]):
                    best = (abs(gap - 2 * diff), a, b)
        if best is not None:
            _, a, b = best
            groups[heavy][groups[heavy].index(a)] = b
            groups[light][groups[light].index(b)] = a
            diff = lens[a] - lens[b]
            sums[heavy] -= diff
            sums[light] += diff
            return True
    return False


class TokenBudgetPartition:
    """Partitions (never empty) whose ``padded_cost`` all fits in ``max_tokens`` (dynamic
    batching): rows of similar length go together, in as few partitions as keep padding
    within ``max_padding`` of the padded tokens.

    ``count`` is the number of partitions that takes; :meth:`parts` makes the partition,
    with at least ``min_num_partitions``. DP ranks all-reduce the MAX of their ``count``
    and ask each for that many, so every rank runs the same number of micro-batches; the
    cuts made for ``count`` are kept, so nothing is partitioned twice.

    ``prompt_lens`` describes rows laid out as a left-padded prompt then a right-padded
    response (see :func:`padded_cost`); without it a row is one right-padded sequence.
    """

    def __init__(
        self,
        seq_lens: Sequence[int] | torch.Tensor,
        *,
        max_tokens: int,
        prompt_lens: Sequence[int] | torch.Tensor | None = None,
        max_padding: float = MAX_PADDING,
    ) -> None:
        if not 0.0 <= max_padding < 1.0:
            raise ValueError(f"max_padding must be in [0, 1), got {max_padding}")
        lens = _as_lengths(seq_lens)
        prompts = _prompt_lengths(lens, prompt_lens)
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        for i, length in enumerate(lens):
            if length > max_tokens:
                raise ValueError(
                    f"sequence {i} has {length} tokens, more than max_tokens={max_tokens}"
                )
        self._order = sorted(range(len(lens)), key=lambda i: (-lens[i], i))
        self._runs = _Runs(
            [prompts[i] for i in self._order], [lens[i] - prompts[i] for i in self._order]
        )
        bounds, padded = self._runs.cut_greedily(max_tokens)
        self._real = sum(lens)
        self._max_padding = max_padding
        self._cuts = {run: self._runs.best_cut(*run) for run in bounds}
        self._padded = self._cut(self._cuts, padded, min_parts=1)
        self.count = len(self._cuts)

    def parts(self, min_num_partitions: int = 1) -> list[list[int]]:
        """Row indices of each partition, at least ``min_num_partitions`` of them: each sorted, the
        partitions ordered by their first row."""
        n = len(self._order)
        if min_num_partitions <= 0:
            raise ValueError(f"min_num_partitions must be positive, got {min_num_partitions}")
        if min_num_partitions > n:
            raise ValueError(
                f"min_num_partitions ({min_num_partitions}) exceeds the number of sequences ({n})"
            )
        cuts = dict(self._cuts)
        self._cut(cuts, self._padded, min_parts=min_num_partitions)
        parts = [sorted(self._order[start:end]) for start, end in cuts]
        parts.sort(key=lambda p: p[0])
        return parts

    def _cut(
        self, cuts: dict[tuple[int, int], tuple[int, int, int]], padded: int, *, min_parts: int
    ) -> int:
        """Cut runs in place until there are ``min_parts`` and padding is within bounds;
        returns the padded tokens left."""
        while len(cuts) < min_parts or self._real < (1.0 - self._max_padding) * padded:
            # The run whose cut saves most; ties: the more even cut, then the longer rows.
            run, (saving, _, at) = max(cuts.items(), key=lambda kv: (*kv[1][:2], -kv[0][0]))
            del cuts[run]
            for piece in ((run[0], at), (at, run[1])):
                cuts[piece] = self._runs.best_cut(*piece)
            padded -= saving
        return padded


def partition_by_token_budget(
    seq_lens: Sequence[int] | torch.Tensor,
    *,
    max_tokens: int,
    prompt_lens: Sequence[int] | torch.Tensor | None = None,
    min_num_partitions: int = 1,
    max_padding: float = MAX_PADDING,
) -> list[list[int]]:
    """The parts of a :class:`TokenBudgetPartition`, at least ``min_num_partitions``."""
    return TokenBudgetPartition(
        seq_lens, max_tokens=max_tokens, prompt_lens=prompt_lens, max_padding=max_padding
    ).parts(min_num_partitions)


class PackedTokenPartition:
    """Micro-batches of packed rows (``packing``): the budget bounds a micro-batch's real
    tokens, as a packed row has no padding. Rows go longest first into the first
    micro-batch with room (first-fit decreasing); ``count`` is how many that takes, and
    :meth:`parts` splits the fullest micro-batches in two until there are as many as asked
    (the count DP ranks agreed on)."""

    def __init__(self, seq_lens: Sequence[int] | torch.Tensor, *, max_tokens: int) -> None:
        lens = _as_lengths(seq_lens)
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        bins: list[list[int]] = []
        room: list[int] = []
        for i in sorted(range(len(lens)), key=lambda i: (-lens[i], i)):
            if lens[i] > max_tokens:
                raise ValueError(
                    f"sequence {i} has {lens[i]} tokens, more than max_tokens={max_tokens}"
                )
            fit = next((b for b, left in enumerate(room) if left >= lens[i]), None)
            if fit is None:
                bins.append([])
                room.append(max_tokens)
                fit = len(bins) - 1
            bins[fit].append(i)
            room[fit] -= lens[i]
        self._lens = lens
        self._bins = bins
        self.count = len(bins)

    def parts(self, min_num_partitions: int = 1) -> list[list[int]]:
        """Row indices of each micro-batch, at least ``min_num_partitions``: each sorted,
        ordered by their first row."""
        if not 0 < min_num_partitions <= len(self._lens):
            raise ValueError(
                f"min_num_partitions ({min_num_partitions}) must be in 1..{len(self._lens)}"
            )
        parts = [list(b) for b in self._bins]
        while len(parts) < min_num_partitions:
            fullest = max(
                (p for p in parts if len(p) > 1), key=lambda p: sum(self._lens[i] for i in p)
            )
            parts.remove(fullest)
            parts += [fullest[0::2], fullest[1::2]]  # longest first: alternate halves balance
        parts = [sorted(p) for p in parts]
        parts.sort(key=lambda p: p[0])
        return parts


class _Runs:
    """Rows sorted longest first, as (prompt, response) lengths; runs of them are
    ``[start, end)`` ranges of positions.

    How the partition is built:

    1. Rows are sorted longest first and cut greedily: a run starts at its longest row and
       takes rows while its padded cost fits. With one prompt length (or none) that is the
       fewest partitions possible (some optimal partition is made of such runs: give the
       part holding the longest row the longest rows of all, and no other part's longest
       row grows; greedy cutting is optimal for runs); with ragged prompts it is close.
    2. On a long-tailed batch those few runs pad heavily: a budget of a few longest rows
       puts rows of very different lengths together. Runs are then cut further, each time
       where one cut saves the most padded tokens, until padding is at most
       ``max_padding`` of the padded tokens and there are ``min_num_partitions`` runs. A
       cut costs one more forward/backward call, so cuts go where they save the most, and
       rows that pad little (dense short rows) keep sharing large micro-batches. A run of
       one row has no padding, so this always ends.

    Among equal savings the most even cut wins, so runs of equal lengths split in halves.
    Ties are broken by position in the (length, index) order, so the result depends only
    on the input.
    """

    def __init__(self, prompts: list[int], responses: list[int]) -> None:
        self.prompts = prompts
        self.responses = responses

    def cut_greedily(self, max_tokens: int) -> tuple[list[tuple[int, int]], int]:
        """Step 1: runs, longest rows first, each as long as its padded cost fits (every
        row fits alone), and their padded tokens."""
        bounds = []
        padded = start = top_prompt = top_response = 0
        for pos, (prompt, response) in enumerate(zip(self.prompts, self.responses, strict=True)):
            width = max(top_prompt, prompt) + max(top_response, response)
            if (pos + 1 - start) * width > max_tokens:
                bounds.append((start, pos))
                padded += (pos - start) * (top_prompt + top_response)
                start, top_prompt, top_response = pos, prompt, response
            else:
                top_prompt, top_response = max(top_prompt, prompt), max(top_response, response)
        bounds.append((start, len(self.prompts)))
        return bounds, padded + (len(self.prompts) - start) * (top_prompt + top_response)

    def best_cut(self, start: int, end: int) -> tuple[int, int, int]:
        """(padded tokens saved, evenness, cut position) of the best cut of [start, end);
        (-1, -1, -1) for a run of one row, which cannot be cut."""
        best = (-1, -1, -1)
        if end - start < 2:
            return best
        # Widths of every head [start, at) and tail [at, end), by running maxima.
        head, tail = [0] * (end - start + 1), [0] * (end - start + 1)
        top_p = top_r = 0
        for at in range(start, end):
            top_p, top_r = max(top_p, self.prompts[at]), max(top_r, self.responses[at])
            head[at - start + 1] = top_p + top_r
        top_p = top_r = 0
        for at in range(end - 1, start - 1, -1):
            top_p, top_r = max(top_p, self.prompts[at]), max(top_r, self.responses[at])
            tail[at - start] = top_p + top_r
        whole = (end - start) * head[-1]
        for at in range(start + 1, end):
            j = at - start
            saving = whole - j * head[j] - (end - at) * tail[j]
            best = max(best, (saving, min(j, end - at), at))
        return best


def dp_shares(lengths: Sequence[int], *, world: int, mini_batches: int = 1) -> list[list[int]]:
    """Row indices of each of ``world`` data-parallel ranks: token-balanced, with equal row
    counts whenever they divide.

    The batch is first cut into ``mini_batches`` contiguous chunks (the global mini-batches
    of one training step); each chunk is balanced over the ranks on its own, and rank r gets
    its pieces concatenated in chunk order. Every piece of a rank has the same size, so the
    rank's share reshaped to ``(mini_batches, rows)`` holds in row j exactly its piece of
    global mini-batch j. The optimizer steps therefore see the same global mini-batches
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


@dataclass(frozen=True)
class MicroBatchPlan:
    """The micro-batches one rank runs over its rows: row index lists, in run order.

    Every rank of a group runs the same number of micro-batches (FSDP pairs its collectives
    across ranks, and a rank may only sync gradients on its last backward). For inference a
    rank that needs fewer repeats its last micro-batch ``repeats`` times and drops their
    outputs; a training step cannot (it would count rows twice), so there ``repeats`` is 0.
    """

    # Lists, not tuples: a tuple indexes a tensor along several dimensions.
    parts: list[list[int]]
    repeats: int = 0

    @classmethod
    def agreed(
        cls, parts: Sequence[Sequence[int]], count: int, *, training: bool
    ) -> MicroBatchPlan:
        """``parts`` brought to the ``count`` every rank agreed on (the maximum over ranks)."""
        if count < len(parts):
            raise ValueError(f"the agreed count {count} is below this rank's {len(parts)} parts")
        missing = count - len(parts)
        if missing and training:
            raise ValueError(
                f"this rank has {len(parts)} micro-batches but another has {count}: give every "
                "rank the same number of rows"
            )
        planned = [list(part) for part in parts]
        return cls(planned + [planned[-1]] * missing, missing)

    @property
    def real_parts(self) -> list[list[int]]:
        """The micro-batches whose outputs count (all but the repeats)."""
        return self.parts[: len(self.parts) - self.repeats]


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
