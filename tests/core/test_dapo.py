"""DAPO's filters as pure math (``verlite.core.dapo``): which groups tie, which a step
keeps, and the soft overlong penalty."""

import pytest
import torch

from verlite.core.dapo import chosen_groups, overlong_penalty, tied_groups


def test_a_group_ties_when_all_its_scores_are_equal() -> None:
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.0, 0.0])
    assert tied_groups(scores, 2).tolist() == [True, False, True, True]
    assert tied_groups(scores, 4).tolist() == [False, False]
    assert tied_groups(scores, 1).all()  # one response: nothing to compare
    with pytest.raises(ValueError, match=r"expected \(G \* 3,\) scores"):
        tied_groups(scores, 3)


def test_a_step_keeps_the_first_varied_groups_in_draw_order() -> None:
    tied = torch.tensor([False, True, False, True, False, False])
    assert chosen_groups(tied, 2) == ([0, 2], 0)
    assert chosen_groups(tied, 4) == ([0, 2, 4, 5], 0)  # the surplus is dropped
    # too few varied groups: the earliest tied ones fill the step, in draw order
    assert chosen_groups(tied, 5) == ([0, 1, 2, 4, 5], 1)
    assert chosen_groups(torch.ones(3, dtype=torch.bool), 2) == ([0, 1], 2)


def test_the_overlong_penalty_falls_linearly_over_the_buffer() -> None:
    lengths = torch.tensor([0, 10, 12, 13, 15, 16])
    penalty = overlong_penalty(lengths, limit=16, buffer=4, factor=2.0, dtype=torch.float32)
    # none up to limit - buffer = 12 tokens, then -factor * (length - 12) / 4
    assert penalty.tolist() == [0.0, 0.0, 0.0, -0.5, -1.5, -2.0]
    assert (
        overlong_penalty(lengths, limit=16, buffer=16, factor=1.0, dtype=torch.float32)[-1] == -1.0
    )
    for buffer in (0, 17):
        with pytest.raises(ValueError, match=r"overlong buffer must be in \[1, 16\]"):
            overlong_penalty(lengths, limit=16, buffer=buffer, factor=1.0, dtype=torch.float32)
