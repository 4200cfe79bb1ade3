"""The seeds of a run's random streams (``verlite.core.seeds``): their values are part of every
run's numbers, so they are pinned here."""

from verlite.core import seeds


def test_the_model_seeds() -> None:
    assert seeds.policy_init(0) == 0 and seeds.policy_init(7) == 7
    assert seeds.critic_init(0) == 1 and seeds.critic_init(7) == 8


def test_the_sampling_seeds_of_steps_ranks_and_turns() -> None:
    assert seeds.step_sampling(0, 1) == 1
    assert seeds.step_sampling(7, 3) == 7 * 100_003 + 3
    step_seed = seeds.step_sampling(7, 3)
    assert seeds.rank_sampling(step_seed, rank=0) == step_seed
    assert seeds.rank_sampling(step_seed, rank=2) == step_seed + 2
    assert seeds.rank_sampling(step_seed, rank=2, turn=1) == step_seed + 7919 + 2
    assert seeds.rank_sampling(step_seed, rank=1, turn=3) == step_seed + 3 * 7919 + 1
