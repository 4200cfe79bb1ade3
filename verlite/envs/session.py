"""One trajectory's environment, its calls checked and bounded in time.

A call runs in a daemon thread of its own and is waited for at most
``rollout.multi_turn.tool_timeout_s``. A ``step`` that raises or outlives that bound is a
tool error: it ends that trajectory (score 0, counted in ``multiturn/tool_errors``), never
the run; the thread of a call that timed out is left to finish on its own. An environment
that breaks its contract stops the run in one line naming it and the prompt: a ``reset``
that raises or hangs, or a ``step`` whose answer is not a :class:`~verlite.envs.base.Turn`
of a string observation, a reward in [0, 1] and a bool ``done``.
"""

from __future__ import annotations

import copy
import math
import queue
import threading
from collections.abc import Callable
from typing import Any

from verlite.data.files import PromptRecord
from verlite.envs.base import Turn
from verlite.envs.registry import environment_name
from verlite.errors import UserError
from verlite.rewards.scoring import as_real


class EnvironmentBroken(UserError):
    """An environment broke its contract (see the module's docstring)."""


def _bounded(fn: Callable[..., Any], *args: Any, timeout_s: float) -> tuple[str, Any]:
    """``("ok", result)``, ``("raised", exception)`` or ``("timeout", None)``."""
    box: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()

    def run() -> None:
        try:
            box.put(("ok", fn(*args)))
        except BaseException as exc:  # reported by the caller, whatever it is
            box.put(("raised", exc))

    threading.Thread(target=run, daemon=True).start()
    try:
        return box.get(timeout=timeout_s)
    except queue.Empty:
        return "timeout", None


class Session:
    """The environment of prompt ``index``'s trajectory."""

    def __init__(self, cls: type, record: PromptRecord, *, index: int, timeout_s: float) -> None:
        self.name, self.index, self.timeout_s = environment_name(cls), index, timeout_s
        self.error: str | None = None
        # Its own copy: an environment may edit what it is given, and the rollout.n
        # trajectories of a prompt (and the driver's scoring) must not see that.
        record = copy.deepcopy(record)
        outcome, value = _bounded(self._reset, cls, record, timeout_s=timeout_s)
        if outcome == "timeout":
            self._refuse(f"reset did not return within {timeout_s:g} s")
        if outcome == "raised":
            self._refuse(f"reset raised {type(value).__name__}: {_one_line(value)}")
        self.env = value

    @staticmethod
    def _reset(cls: type, record: PromptRecord) -> object:
        env = cls()
        env.reset(record)
        return env

    def step(self, action: str) -> Turn | None:
        """The environment's answer to a policy turn; None after a tool error (recorded in
        ``error``), which ends the trajectory."""
        outcome, value = _bounded(self.env.step, action, timeout_s=self.timeout_s)  # type: ignore[attr-defined]
        if outcome == "timeout":
            self.error = f"step did not return within {self.timeout_s:g} s"
            return None
        if outcome == "raised":
            self.error = f"step raised {type(value).__name__}: {_one_line(value)}"
            return None
        return self._checked(value)

    def _checked(self, turn: object) -> Turn:
        if not isinstance(turn, Turn):
            self._refuse(f"step returned {type(turn).__name__}, not a verlite.envs.Turn")
        assert isinstance(turn, Turn)
        if not isinstance(turn.observation, str):
            self._refuse(
                f"step returned an observation of type {type(turn.observation).__name__}, not str"
            )
        reward = as_real(turn.reward)
        if reward is None or not math.isfinite(reward) or not 0.0 <= reward <= 1.0:
            self._refuse(f"step returned reward {turn.reward!r}; rewards must be in [0, 1]")
        if not isinstance(turn.done, bool):
            self._refuse(f"step returned done={turn.done!r}; it must be a bool")
        return Turn(turn.observation, float(reward), turn.done)  # type: ignore[arg-type]

    def _refuse(self, what: str) -> None:
        raise EnvironmentBroken(f"environment {self.name}, prompt {self.index}: {what}")


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300]
