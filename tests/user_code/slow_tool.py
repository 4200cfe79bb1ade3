"""Environments for the e2e tests, importable by the workers: the lookup task with a tool
that takes half a second to answer, and one whose tool is stuck in a loop for good."""

import time

from verlite.envs.lookup import Lookup


class SlowLookup(Lookup):
    def step(self, action: str):
        time.sleep(0.5)
        return super().step(action)


class StuckLookup(Lookup):
    def step(self, action: str):
        while True:  # burns its thread's share of the CPU until the worker process ends
            pass
