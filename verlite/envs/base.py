"""What a multi-turn environment is (``rollout.multi_turn.env``).

A run makes one environment object per trajectory, by calling the configured class with no
arguments, in the worker that generates it. ``reset(record)`` gets the prompt record the
trajectory answers (its ``prompt`` and ``answer``); the prompt itself is what the data
pipeline tokenized, so the environment does not return it again. ``step(action)`` gets each
policy turn as text (the tokens the policy sampled, decoded once up to an end-of-sequence
token, other special tokens shown, the turn's stop text included) and returns a :class:`Turn`: the observation the policy reads next (a tool's
output), the trajectory's reward so far and whether it is over. The reward of the last turn
is the trajectory's score. The steps of different trajectories may run at the same time, in
the threads of ``rollout.multi_turn.env_threads`` (:mod:`verlite.envs.session`): what
environments share between them must be safe to use from several threads at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from verlite.data.files import PromptRecord


@dataclass(frozen=True)
class Turn:
    """What an environment answers to one policy turn."""

    # Appended to the trajectory as tokens the policy did not sample, tokenized as text: a
    # special token's text in it ("<|im_end|>") is its characters, never the special token.
    observation: str
    reward: float  # in [0, 1]: the trajectory's score if this turn is its last
    done: bool  # the trajectory is over (the observation is then not appended)


class Environment(Protocol):
    def reset(self, record: PromptRecord) -> None: ...

    def step(self, action: str) -> Turn: ...
