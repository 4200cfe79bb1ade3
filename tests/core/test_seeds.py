"""The seeds of a run's random streams (``verlite.core.seeds``): their values are part of every
run's numbers, so they are pinned here."""

import itertools

import torch

from verlite.core import seeds


def test_the_model_seeds() -> None:
    assert seeds.policy_init(0) == 0 and seeds.policy_init(7) == 7
    assert seeds.critic_init(0) == 1 and seeds.critic_init(7) == 8


def test_the_sampling_seeds_are_pinned() -> None:
    step_seed = seeds.step_sampling(7, 3)
    assert step_seed == 3879072848308665546
    assert seeds.rank_sampling(step_seed, rank=2, turn=1) == 1862679583523094119


def test_no_two_steps_turns_or_ranks_share_a_stream() -> None:
    """Streams offset by step and rank overlapped: step 1's rank 0 drew step 0's rank 1's
    numbers, so per_rank's draws were correlated across steps."""
    streams = [
        seeds.rank_sampling(seeds.step_sampling(seed, step), rank=rank, turn=turn)
        for seed, step, turn, rank in itertools.product(range(3), range(40), range(3), range(8))
    ]
    assert len(set(streams)) == len(streams)
    assert all(0 <= stream < 2**63 for stream in streams)
    torch.Generator().manual_seed(max(streams))  # a seed a torch generator takes
