"""An environment for the e2e tests that breaks its contract: its rewards exceed 1."""

from verlite.envs import Turn


class TooGenerous:
    def reset(self, record):
        pass

    def step(self, action: str) -> Turn:
        return Turn("", 1.5, True)
