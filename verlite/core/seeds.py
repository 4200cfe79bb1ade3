"""The seeds of a run's random streams, each derived from ``trainer.seed`` by one function here.

- the policy's initial weights (LoRA's ``A`` included): ``trainer.seed`` itself, on every
  actor rank and rollout worker alike (a rollout worker's LoRA base must be the actor's);
- the critic's initial weights: the next seed, so the value model does not start from the
  policy's draws;
- sampling with ``rollout.randomness=per_rank``: the driver sends each step's seed, and
  each generating rank, in each turn of a multi-turn trajectory, draws from its own stream,
  seeded by a 63-bit mix of (``trainer.seed``, step, turn, rank): no two of them share a
  stream, where seeds offset by step and rank would (step 1's rank 0 was step 0's rank 1).

Not here: ``rollout.randomness=per_sample`` draws from keys hashed from (``trainer.seed``,
step, prompt, sample) (``verlite.generation.noise.sample_keys``), and the data order (shuffles,
splits, synthetic prompts) from string keys of the seed in ``verlite.data``.
"""

from __future__ import annotations

MASK64 = (1 << 64) - 1


def policy_init(seed: int) -> int:
    """The seed of the policy's initial weights."""
    return seed


def critic_init(seed: int) -> int:
    """The seed of the critic's initial weights."""
    return seed + 1


def step_sampling(seed: int, step: int) -> int:
    """The seed the driver sends for ``step``'s sampling (``rollout.randomness=per_rank``)."""
    return _mix(seed, step)


def rank_sampling(step_seed: int, *, rank: int, turn: int = 0) -> int:
    """The stream of ``rank`` in turn ``turn`` (0: the first, or a single-turn response) of a
    step whose seed is ``step_seed`` (:func:`step_sampling`)."""
    return _mix(step_seed, turn, rank)


def _mix(*values: int) -> int:
    """A non-negative 63-bit seed of ``values``, in order: SplitMix64's finalizer folded over
    them, so that seeds of nearby tuples share no structure (a torch generator's seed)."""
    state = 0
    for value in values:
        state = ((state ^ (value & MASK64)) + 0x9E3779B97F4A7C15) & MASK64
        state = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        state = ((state ^ (state >> 27)) * 0x94D049BB133111EB) & MASK64
        state ^= state >> 31
    return state >> 1
