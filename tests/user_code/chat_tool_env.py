"""An environment for the chat-template e2e test: the lookup task whose tool answers every turn
with the same observation and never ends the trajectory, so that each trajectory holds
observation turns (it runs until the policy ends it or it runs out of turns)."""

from verlite.envs.base import Turn
from verlite.envs.lookup import Lookup

OBSERVATION = "=?"


class Talkative(Lookup):
    def step(self, action: str) -> Turn:
        return Turn(OBSERVATION, self._reward(action), done=False)
