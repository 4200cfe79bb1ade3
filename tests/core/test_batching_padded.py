"""Token budgets on padded cost (``cost="padded"``): rows of similar length together, every
micro-batch's rows x longest row within the budget, padding within ``max_padding``, the
fewest partitions when padding allows, and the same count on every DP rank."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch

from verlite.core.batching import (
    MAX_PADDING,
    count_token_budget_partitions,
    flatten,
    inverse_permutation,
    padded_cost,
    partition_by_token_budget,
)


def long_tailed(rng: random.Random, n: int, lo: int = 16, hi: int = 1024) -> list[int]:
    return [min(hi, lo + int(rng.paretovariate(1.2) * lo)) for _ in range(n)]


def padding(lens: list[int], parts: list[list[int]]) -> float:
    return 1 - sum(lens) / sum(padded_cost(lens, p) for p in parts)


def padded(lens: list[int], **kwargs: object) -> list[list[int]]:
    return partition_by_token_budget(lens, cost="padded", **kwargs)  # type: ignore[arg-type]


def cases() -> Iterator[tuple[list[int], int]]:
    for seed in range(60):
        rng = random.Random(seed)
        lens = long_tailed(rng, rng.randint(1, 96))
        yield lens, rng.randint(max(lens), 6 * max(lens))


def test_covers_every_row_once_and_fits_the_budget_padded() -> None:
    for lens, budget in cases():
        parts = padded(lens, max_tokens=budget)
        assert sorted(flatten(parts)) == list(range(len(lens)))
        assert all(p and p == sorted(p) for p in parts)
        assert [p[0] for p in parts] == sorted(p[0] for p in parts)
        assert max(padded_cost(lens, p) for p in parts) <= budget
        assert len(parts) == count_token_budget_partitions(lens, max_tokens=budget, cost="padded")


def test_padding_stays_within_max_padding_where_packed_pads_most() -> None:
    for seed in range(20):
        lens = long_tailed(random.Random(seed), 256)
        parts = padded(lens, max_tokens=4 * 1024)
        assert padding(lens, parts) <= MAX_PADDING
        packed = partition_by_token_budget(lens, max_tokens=4 * 1024)
        # Balanced token sums put a long row in every part: most of its padded tokens are padding.
        assert padding(lens, packed) > 0.5
        for limit in (0.0, 0.2):
            assert padding(lens, padded(lens, max_tokens=4 * 1024, max_padding=limit)) <= limit


def test_tolerant_padding_gives_the_fewest_partitions() -> None:
    """With padding allowed, the count is the optimum of rows x longest <= budget, found by
    trying every way of grouping a few rows."""

    def set_partitions(items: list[int]) -> Iterator[list[list[int]]]:
        if not items:
            yield []
            return
        first, rest = items[0], items[1:]
        for smaller in set_partitions(rest):
            yield [[first], *smaller]
            for i in range(len(smaller)):
                yield [*smaller[:i], [first, *smaller[i]], *smaller[i + 1 :]]

    for seed in range(40):
        rng = random.Random(seed)
        lens = [rng.randint(1, 12) for _ in range(rng.randint(1, 7))]
        budget = rng.randint(max(lens), 3 * max(lens))
        best = min(
            len(groups)
            for groups in set_partitions(list(range(len(lens))))
            if all(padded_cost(lens, g) <= budget for g in groups)
        )
        assert len(padded(lens, max_tokens=budget, max_padding=0.99)) == best


def test_every_rank_runs_the_agreed_count() -> None:
    # What DP ranks do: all-reduce the MAX of their counts, then partition with it as the
    # minimum; every rank must then run exactly that many micro-batches within budget.
    for seed in range(60):
        rng = random.Random(seed)
        ranks = [long_tailed(rng, rng.randint(8, 48)) for _ in range(4)]
        budget = 4 * 1024
        common = max(
            count_token_budget_partitions(r, max_tokens=budget, cost="padded") for r in ranks
        )
        for lens in ranks:
            if common > len(lens):
                continue
            parts = padded(lens, max_tokens=budget, min_num_partitions=common)
            assert len(parts) == common
            assert max(padded_cost(lens, p) for p in parts) <= budget


def test_equal_lengths_make_one_part_unless_more_are_asked() -> None:
    lens = [10] * 12
    assert padded(lens, max_tokens=1000) == [list(range(12))]
    for m in range(1, 13):
        parts = padded(lens, max_tokens=1000, min_num_partitions=m)
        assert len(parts) == m and sorted(flatten(parts)) == list(range(12))
    # Halves first: cutting the largest run evenly.
    assert sorted(len(p) for p in padded(lens, max_tokens=1000, min_num_partitions=2)) == [6, 6]


def test_round_trip_tensor_input_and_determinism() -> None:
    rng = random.Random(7)
    lens = [rng.choice([16, 32, 64, 1024]) for _ in range(48)]
    parts = padded(lens, max_tokens=2048)
    assert padded(torch.tensor(lens), max_tokens=2048) == parts
    assert all(padded(list(lens), max_tokens=2048) == parts for _ in range(3))
    original = torch.randn(len(lens), 3)
    results = torch.cat([original[torch.tensor(p)] for p in parts])
    torch.testing.assert_close(results[inverse_permutation(parts)], original, rtol=0, atol=0)


def test_errors() -> None:
    with pytest.raises(ValueError, match="unknown token cost 'tokens'"):
        partition_by_token_budget([1, 2], max_tokens=10, cost="tokens")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"max_padding must be in \[0, 1\), got 1.0"):
        padded([1, 2], max_tokens=10, max_padding=1.0)
    with pytest.raises(ValueError, match="sequence 1 has 300 tokens, more than max_tokens=256"):
        padded([10, 300], max_tokens=256)
    with pytest.raises(ValueError, match=r"min_num_partitions \(3\) exceeds"):
        padded([1, 2], max_tokens=10, min_num_partitions=3)
