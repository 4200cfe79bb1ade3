"""The built-in rewards that read a final answer in each response (``reward.fn=gsm8k``,
``reward.fn=math``): what they share, and what the driver's scorer reads of them.

A response in which such a reward finds no answer scores 0 and is counted (``no_answer``), so
that a model that never writes the asked form is told apart from one that answers wrong: a
silent 0 is never without a count. A reward may count more beside it (math's ``abandoned``:
:attr:`COUNTS`). The counts are the instance's, over its life; the driver's scorer
(``driver/scorer.py``) logs a step's, the difference across the step's scoring, as
``reward/<name>/<count>`` (``val/reward/<name>/<count>`` for a validation). A run builds its
own instance (``registry.resolve_reward``): the registry's are shared.

Calls may come from any thread; a count is taken under a lock. ``score_responses`` returns
once every call of the step has returned, and a call counts before it returns, so a step's
counts are complete when its scoring ends and none is left to the next step; a call that
outlives ``reward.timeout_s`` stops the run (``RewardError``), and its late count with it.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from typing import ClassVar


class AnswerReward(ABC):
    """``fn(response, answer, prompt) -> score`` that reads a response's final answer;
    :meth:`count` each response without one (``"no_answer"``) in :meth:`__call__`."""

    name: ClassVar[str]  # its reward.fn name, and its metrics' reward/<name>/
    COUNTS: ClassVar[tuple[str, ...]] = ("no_answer",)

    def __init__(self) -> None:
        self._counts = dict.fromkeys(self.COUNTS, 0)
        self._counting = threading.Lock()

    def __repr__(self) -> str:  # how scoring's messages name it
        return f"{self.name} ({type(self).__module__})"

    @abstractmethod
    def __call__(self, response: str, answer: str, prompt: str) -> float: ...

    @abstractmethod
    def check_reference(self, answer: str) -> None:
        """Raise ValueError when ``answer`` holds no reference this reward can score against
        (``registry.check_answers``, before the run starts)."""

    def close(self) -> None:  # noqa: B027 (a no-op where it holds nothing, as gsm8k)
        """Let go of what it holds between calls (math's verifier process); the next call
        takes it up again."""

    def count(self, what: str) -> int:
        """Count one ``what`` (one of :attr:`COUNTS`); the count so far."""
        with self._counting:
            self._counts[what] += 1
            return self._counts[what]

    def counts(self) -> dict[str, int]:
        """Every count so far, by name."""
        with self._counting:
            return dict(self._counts)
