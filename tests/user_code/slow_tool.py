"""An environment for the e2e tests, importable by the workers: the lookup task with a tool
that takes half a second to answer."""

import time

from verlite.envs.lookup import Lookup


class SlowLookup(Lookup):
    def step(self, action: str):
        time.sleep(0.5)
        return super().step(action)
