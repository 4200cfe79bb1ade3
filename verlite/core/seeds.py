"""The seeds of a run's random streams, each derived from ``trainer.seed`` by one function here.

- the policy's initial weights (LoRA's ``A`` included): ``trainer.seed`` itself, on every
  actor rank and rollout worker alike (a rollout worker's LoRA base must be the actor's);
- the critic's initial weights: the next seed, so the value model does not start from the
  policy's draws;
- sampling with ``rollout.randomness=per_rank``: the driver sends each step's seed, and
  each generating rank, in each turn of a multi-turn trajectory, draws from its own stream
  offset from it. ``STEP_STRIDE`` (a prime above any run's step count) keeps the steps of
  two consecutive ``trainer.seed`` values apart.

Not here: ``rollout.randomness=per_sample`` draws from keys hashed from (``trainer.seed``,
step, prompt, sample) (``verlite.generation.noise.sample_keys``), and the data order (shuffles,
splits, synthetic prompts) from string keys of the seed in ``verlite.data``.
"""

from __future__ import annotations

STEP_STRIDE = 100_003
TURN_STRIDE = 7919


def policy_init(seed: int) -> int:
    """The seed of the policy's initial weights."""
    return seed


def critic_init(seed: int) -> int:
    """The seed of the critic's initial weights."""
    return seed + 1


def step_sampling(seed: int, step: int) -> int:
    """The seed the driver sends for ``step``'s sampling (``rollout.randomness=per_rank``)."""
    return seed * STEP_STRIDE + step


def rank_sampling(step_seed: int, *, rank: int, turn: int = 0) -> int:
    """The stream of ``rank`` in turn ``turn`` (0: the first, or a single-turn response) of a
    step whose seed is ``step_seed`` (:func:`step_sampling`)."""
    return step_seed + turn * TURN_STRIDE + rank
