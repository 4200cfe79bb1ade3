"""One trajectory's environment, its calls checked and bounded in time.

A session's calls (making its environment, ``reset`` and every ``step``) run one after
another in one daemon thread of its own, so that state an environment keeps per thread (a
database client's connection) is there in every call; :meth:`Session.close` ends the thread.
Each call is waited for at most ``rollout.multi_turn.tool_timeout_s``. A ``step`` that
raises or outlives that bound is a tool error: it ends that trajectory (score 0, counted in
``multiturn/tool_errors``), never the run. A Python thread cannot be stopped, so the thread
of a call that timed out is left running (``multiturn/abandoned_calls``); each worker counts
its live ones (:class:`AbandonedCalls`), and more than
``rollout.multi_turn.max_abandoned_calls`` of them (a tool stuck in a loop, which would slow
every later step) stop the run in one line. An environment that breaks its contract stops
the run in one line naming it and the prompt: a class that cannot be made or a ``reset``
that raises or hangs, or a ``step`` whose answer is not a :class:`~verlite.envs.base.Turn`
of a string observation the tokenizer can encode, a reward in [0, 1] and a bool ``done``.
"""

from __future__ import annotations

import copy
import math
import queue
import threading
from collections.abc import Callable
from typing import Any

from transformers import PreTrainedTokenizerBase

from verlite.data.files import PromptRecord
from verlite.data.templates import TurnFormat
from verlite.data.tokenizer import encode_written
from verlite.envs.base import Turn
from verlite.envs.registry import environment_name
from verlite.errors import RunFailure, UserError, shown
from verlite.rewards.scoring import as_real


class EnvironmentBroken(UserError):
    """An environment broke its contract (see the module's docstring)."""


class ToolsStuck(RunFailure):
    """More calls that timed out are still running in a worker than the run allows."""


class AbandonedCalls:
    """The environment calls of one worker that outlived their timeout and still run."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._threads: list[threading.Thread] = []

    def add(self, thread: threading.Thread) -> int:
        """Count ``thread`` in; how many abandoned calls are still running, it included."""
        self._threads = [t for t in self._threads if t.is_alive()]
        self._threads.append(thread)
        return len(self._threads)


class _Caller:
    """The one daemon thread that runs a session's calls, one after another: an environment
    is made, reset and stepped in the same thread, as code holding per-thread state expects
    (a connection in a ``threading.local``, a ``sqlite3`` connection that refuses other
    threads), and each call is waited for at most ``timeout_s``."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...], Any] | None]
        self._calls = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            fn, args, box = call
            try:
                box.put(("ok", fn(*args)))
            except BaseException as exc:  # reported by the caller, whatever it is
                box.put(("raised", exc))

    def call(self, fn: Callable[..., Any], *args: Any, timeout_s: float) -> tuple[str, Any]:
        """``("ok", result)``, ``("raised", exception)`` or ``("timeout", the thread still
        running it)``; after a timeout the thread takes no more calls and ends once the call
        returns."""
        box: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._calls.put((fn, args, box))
        try:
            return box.get(timeout=timeout_s)
        except queue.Empty:
            self.close()
            return "timeout", self.thread

    def close(self) -> None:
        """The thread ends after the calls it was given."""
        self._calls.put(None)


class Session:
    """The environment of prompt ``index``'s trajectory; ``abandoned`` is its worker's count
    of calls that timed out and still run; ``turns``, the chat template's turn format its
    observations are written in (``data.chat_template``), if any."""

    def __init__(
        self,
        cls: type,
        record: PromptRecord,
        *,
        index: int,
        timeout_s: float,
        abandoned: AbandonedCalls,
        turns: TurnFormat | None = None,
    ) -> None:
        self.name, self.index, self.timeout_s = environment_name(cls), index, timeout_s
        self.abandoned = abandoned
        self.turns = turns
        self.error: str | None = None
        self.timed_out = False  # a step outlived timeout_s: its thread was left running
        # Its own copy: an environment may edit what it is given, and the rollout.n
        # trajectories of a prompt (and the driver's scoring) must not see that.
        record = copy.deepcopy(record)
        self._caller = _Caller()
        self.env = self._set_up(cls, f"{cls.__name__}()")
        self._set_up(self.env.reset, "reset", record)

    def close(self) -> None:
        """Let the thread that runs this session's calls end (the trajectory is over)."""
        self._caller.close()

    def _set_up(self, fn: Callable[..., Any], what: str, *args: Any) -> Any:
        """A call that makes or resets the environment: one that raises or hangs breaks
        the contract."""
        outcome, value = self._caller.call(fn, *args, timeout_s=self.timeout_s)
        if outcome != "ok":
            self.close()
        if outcome == "timeout":
            self.abandoned.add(value)
            self._refuse(f"{what} did not return within {self.timeout_s:g} s")
        if outcome == "raised":
            self._refuse(f"{what} raised {type(value).__name__}: {_one_line(value)}")
        return value

    def step(self, action: str) -> Turn | None:
        """The environment's answer to a policy turn; None after a tool error (recorded in
        ``error``), which ends the trajectory."""
        outcome, value = self._caller.call(self.env.step, action, timeout_s=self.timeout_s)  # type: ignore[attr-defined]
        if outcome == "timeout":
            self.error = f"step did not return within {self.timeout_s:g} s"
            self.timed_out = True
            self._check_abandoned(self.abandoned.add(value))
            return None
        if outcome == "raised":
            self.error = f"step raised {type(value).__name__}: {_one_line(value)}"
            return None
        return self._checked(value)

    def observation_ids(self, observation: str, tokenizer: PreTrainedTokenizerBase) -> list[int]:
        """The token ids of an observation this session's ``step`` returned (with ``turns``:
        its turn in the chat template and the next generation prompt, the end of the policy's
        turn before it being ``TurnFormat.unwritten_end``'s): one the tokenizer cannot encode
        (text that is not valid Unicode, such as a lone surrogate, or characters its
        vocabulary lacks) breaks the contract."""
        what = f"step returned observation {shown(observation)}"
        try:
            observation.encode("utf-8")
        except UnicodeEncodeError as exc:
            self._refuse(f"{what}, not valid text ({exc.reason} at character {exc.start})")
        text = observation if self.turns is None else self.turns.observation_text(observation)
        try:
            if self.turns is None:
                ids: list[int] = encode_written(tokenizer, text)
            else:
                ids = self.turns.observation_ids(text)
        except Exception as exc:  # whatever a tokenizer raises, the observation is the cause
            self._refuse(
                f"{what}, which the tokenizer cannot encode: {type(exc).__name__}: {_one_line(exc)}"
            )
        # The observation's text is never a special token (its "<unk>" included), so an
        # unknown token stands for characters the vocabulary lacks.
        if tokenizer.unk_token_id is not None and tokenizer.unk_token_id in ids:
            self._refuse(
                f"{what}, which holds characters the tokenizer does not know (they would "
                f"reach the policy as {tokenizer.unk_token})"
            )
        return ids

    def _check_abandoned(self, running: int) -> None:
        if running > self.abandoned.limit:
            raise ToolsStuck(
                f"environment {self.name}, prompt {self.index}: calls that outlived "
                f"rollout.multi_turn.tool_timeout_s={self.timeout_s:g} still running in this "
                f"worker: {running}, more than rollout.multi_turn.max_abandoned_calls="
                f"{self.abandoned.limit}; a thread cannot be stopped and each one left running "
                "slows every later step: make step return in time (run work that may hang in "
                "a process it can kill)"
            )

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
