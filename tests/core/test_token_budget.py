"""Token budgets (dynamic batching): every micro-batch's padded cost within the budget,
rows of similar length together, padding within ``max_padding``, the fewest partitions
when padding allows, the same count on every DP rank, and ragged prompts counted."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator

import pytest
import torch

from verlite.core.partition import (
    MAX_PADDING,
    TokenBudgetPartition,
    flatten,
    inverse_permutation,
    padded_cost,
    partition_balanced,
    partition_by_token_budget,
)


def long_tailed(rng: random.Random, n: int, lo: int = 16, hi: int = 1024) -> list[int]:
    return [min(hi, lo + int(rng.paretovariate(1.2) * lo)) for _ in range(n)]


def with_prompts(rng: random.Random, lens: list[int]) -> list[int]:
    """Prompt lengths from 0 to the whole row: a short prompt may carry the longest response."""
    return [rng.randint(0, n) for n in lens]


def padding(lens: list[int], parts: list[list[int]], prompts: list[int] | None = None) -> float:
    return 1 - sum(lens) / sum(padded_cost(lens, p, prompts) for p in parts)


def cases() -> Iterator[tuple[list[int], list[int] | None, int]]:
    for seed in range(80):
        rng = random.Random(seed)
        lens = long_tailed(rng, rng.randint(1, 96))
        prompts = with_prompts(rng, lens) if seed % 2 else None
        yield lens, prompts, rng.randint(max(lens), 6 * max(lens))


def test_covers_every_row_once_and_fits_the_budget() -> None:
    for lens, prompts, budget in cases():
        parts = partition_by_token_budget(lens, max_tokens=budget, prompt_lens=prompts)
        assert sorted(flatten(parts)) == list(range(len(lens)))
        assert all(p and p == sorted(p) for p in parts)
        assert [p[0] for p in parts] == sorted(p[0] for p in parts)
        assert max(padded_cost(lens, p, prompts) for p in parts) <= budget
        assert len(parts) >= math.ceil(sum(lens) / budget)
        assert padding(lens, parts, prompts) <= MAX_PADDING
        count = TokenBudgetPartition(lens, max_tokens=budget, prompt_lens=prompts).count
        assert len(parts) == count


def test_padded_cost() -> None:
    lens = [3, 10, 1, 7]
    assert padded_cost(lens, [0, 2]) == 2 * 3
    assert padded_cost(lens, [0, 1, 2]) == 3 * 10
    assert padded_cost(lens, []) == 0
    # Prompt then response: the longest prompt (3) plus the longest response (9).
    assert padded_cost(lens, [0, 1], prompt_lens=[3, 1, 0, 0]) == 2 * (3 + 9)


def test_ragged_prompts_widen_a_micro_batch() -> None:
    """Two rows of 11 tokens: a long prompt with a short response and the reverse run 2 x 20
    wide together, so a budget of 30 must separate them although 2 x 11 fits."""
    lens, prompts = [11, 11], [10, 1]
    assert partition_by_token_budget(lens, max_tokens=30) == [[0, 1]]
    for tolerance in (MAX_PADDING, 0.99):  # the budget holds whatever padding is allowed
        split = partition_by_token_budget(
            lens, max_tokens=30, prompt_lens=prompts, max_padding=tolerance
        )
        assert split == [[0], [1]]
    assert partition_by_token_budget(lens, max_tokens=40, prompt_lens=prompts, max_padding=0.5) == [
        [0, 1]
    ]


def test_padding_stays_within_max_padding_where_balanced_sums_pad_most() -> None:
    for seed in range(20):
        rng = random.Random(seed)
        lens = long_tailed(rng, 256)
        for prompts in (None, with_prompts(rng, lens)):
            parts = partition_by_token_budget(lens, max_tokens=4 * 1024, prompt_lens=prompts)
            assert padding(lens, parts, prompts) <= MAX_PADDING
            for limit in (0.0, 0.2):
                tighter = partition_by_token_budget(
                    lens, max_tokens=4 * 1024, prompt_lens=prompts, max_padding=limit
                )
                assert padding(lens, tighter, prompts) <= limit
        # The fewest parts whose token sums fit, balanced: a long row lands in every part
        # and most of the padded tokens are padding. Grouping by length is what a budget needs.
        balanced = partition_balanced(lens, num_partitions=math.ceil(sum(lens) / (4 * 1024)))
        assert padding(lens, balanced) > 0.5


def test_tolerant_padding_gives_the_fewest_partitions() -> None:
    """With padding allowed and one prompt length, the count is the optimum of
    rows x longest <= budget, found by trying every way of grouping a few rows."""

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
        assert len(partition_by_token_budget(lens, max_tokens=budget, max_padding=0.99)) == best


def test_every_rank_runs_the_agreed_count() -> None:
    # What DP ranks do: all-reduce the MAX of their counts, then partition with it as the
    # minimum; every rank must then run exactly that many micro-batches within budget.
    for seed in range(60):
        rng = random.Random(seed)
        ranks = [long_tailed(rng, rng.randint(8, 48)) for _ in range(4)]
        prompts = [with_prompts(rng, lens) for lens in ranks]
        budget = 4 * 1024
        common = max(
            TokenBudgetPartition(r, max_tokens=budget, prompt_lens=p).count
            for r, p in zip(ranks, prompts, strict=True)
        )
        for lens, prompt_lens in zip(ranks, prompts, strict=True):
            if common > len(lens):
                continue
            parts = partition_by_token_budget(
                lens, max_tokens=budget, prompt_lens=prompt_lens, min_num_partitions=common
            )
            assert len(parts) == common
            assert max(padded_cost(lens, p, prompt_lens) for p in parts) <= budget


def test_equal_lengths_make_one_part_unless_more_are_asked() -> None:
    lens = [10] * 12
    assert partition_by_token_budget(lens, max_tokens=1000) == [list(range(12))]
    for m in range(1, 13):
        parts = partition_by_token_budget(lens, max_tokens=1000, min_num_partitions=m)
        assert len(parts) == m and sorted(flatten(parts)) == list(range(12))
    # Halves first: cutting the largest run evenly.
    halves = partition_by_token_budget(lens, max_tokens=1000, min_num_partitions=2)
    assert sorted(map(len, halves)) == [6, 6]
    # A budget of one row each.
    assert partition_by_token_budget([5] * 4, max_tokens=5) == [[0], [1], [2], [3]]


def test_round_trip_tensor_input_and_determinism() -> None:
    rng = random.Random(7)
    lens = [rng.choice([16, 32, 64, 1024]) for _ in range(48)]
    prompts = [rng.randint(0, 16) for _ in lens]
    parts = partition_by_token_budget(lens, max_tokens=2048, prompt_lens=prompts)
    again = partition_by_token_budget(
        torch.tensor(lens), max_tokens=2048, prompt_lens=torch.tensor(prompts)
    )
    assert again == parts
    assert all(
        partition_by_token_budget(tuple(lens), max_tokens=2048, prompt_lens=prompts) == parts
        for _ in range(3)
    )
    original = torch.randn(len(lens), 3)
    results = torch.cat([original[torch.tensor(p)] for p in parts])
    torch.testing.assert_close(results[inverse_permutation(parts)], original, rtol=0, atol=0)


def test_errors() -> None:
    with pytest.raises(ValueError, match=r"max_padding must be in \[0, 1\), got 1.0"):
        partition_by_token_budget([1, 2], max_tokens=10, max_padding=1.0)
    with pytest.raises(ValueError, match="sequence 2 has 300 tokens, more than max_tokens=256"):
        partition_by_token_budget([10, 20, 300, 5], max_tokens=256)
    with pytest.raises(ValueError, match=r"min_num_partitions \(5\) exceeds .* \(4\)"):
        partition_by_token_budget([1, 2, 3, 4], max_tokens=100, min_num_partitions=5)
    with pytest.raises(ValueError, match="max_tokens must be positive, got 0"):
        partition_by_token_budget([1, 2], max_tokens=0)
    with pytest.raises(ValueError, match="min_num_partitions must be positive, got 0"):
        partition_by_token_budget([1, 2], max_tokens=10, min_num_partitions=0)
    with pytest.raises(ValueError, match="prompt_lens has 1 rows, seq_lens 2"):
        partition_by_token_budget([1, 2], max_tokens=10, prompt_lens=[1])
    with pytest.raises(ValueError, match=r"prompt_lens\[1\] = 3 exceeds seq_lens\[1\] = 2"):
        partition_by_token_budget([1, 2], max_tokens=10, prompt_lens=[1, 3])
