"""One trajectory's environment, its calls checked and bounded in time.

A session's calls (making its environment, ``reset`` and every ``step``) run one after
another in one daemon thread, so that state an environment keeps per thread (a database
client's connection) is there in every call. A worker's sessions share
``rollout.multi_turn.env_threads`` threads (:class:`SessionThreads`; a thread per trajectory
would be thousands of idle threads), each bound to one when it is made: per-thread state is
shared by the sessions of a thread, as in any thread pool, and what is a trajectory's own
belongs on its environment object. A step's environments are all started being made, then
all being reset once every one is made (:func:`open_sessions`), and a turn's steps all
started (:meth:`Session.start_step`), each round before any of it is waited for, so the calls
of different threads run side by side (state an environment
shares between threads must be safe to use from several at once) and a thread's run one
after another, in the order they were started. Each call is bounded by
``rollout.multi_turn.tool_timeout_s`` of the time it would have taken alone, counted from its
start (:meth:`SessionThreads.apply`: calls that compute in Python side by side take turns on
the interpreter's lock, and none is charged the time it waited for it), and
:meth:`SessionThreads.wait` checks every running call of the worker, whichever it waits for. A
``step`` that raises or outlives that bound (returning late included) is a tool error: it
ends that trajectory (score 0, counted in ``multiturn/tool_errors``), never the run. A
Python thread cannot be stopped, so a call that timed out is left running
(``multiturn/abandoned_calls``) and its thread retired: a fresh one takes its new sessions,
and the other sessions bound to it move to a fresh thread at their next call (never waiting
for that call; what their environments keep per thread stays behind). Each worker counts its
live abandoned calls (:class:`AbandonedCalls`), and more than
``rollout.multi_turn.max_abandoned_calls`` of them (a tool stuck in a loop, which would slow
every later step) stop the run in one line. An environment that breaks its contract stops
the run in one line naming it and the prompt: a class that cannot be made or a ``reset``
that raises or hangs, or a ``step`` whose answer is not a :class:`~verlite.envs.base.Turn`
of a string observation the tokenizer can encode, a reward in [0, 1] and a bool ``done``.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from verlite.data.files import PromptRecord
from verlite.data.templates import TurnFormat
from verlite.data.tokenizer import tokens_after_text
from verlite.envs.base import Turn
from verlite.envs.registry import environment_name
from verlite.errors import RunFailure, UserError, one_line, shown
from verlite.rewards.scoring import as_real


class EnvironmentBroken(UserError):
    """An environment broke its contract (see the module's docstring)."""


class ToolsStuck(RunFailure):
    """More calls that timed out are still running in a worker than the run allows."""


class AbandonedCalls:
    """The environment calls of one worker that outlived their timeout and still run."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._calls: list[_Call] = []

    def add(self, call: _Call) -> int:
        """Count ``call`` in; how many abandoned calls are still running, it included while it
        runs: a call left running at its timeout may have returned by the time its answer
        is taken (a turn's steps run side by side)."""
        self._calls = [c for c in (*self._calls, call) if not c.done.is_set()]
        return len(self._calls)


class _Call:
    """One environment call, queued on ``thread``; ``outcome`` is ``("ok", result)`` or
    ``("raised", exception)`` once it returned."""

    def __init__(
        self, thread: _Thread, fn: Callable[..., Any], args: tuple[Any, ...], timeout_s: float
    ) -> None:
        self.thread, self.fn, self.args, self.timeout_s = thread, fn, args, timeout_s
        self.started = False
        self.charged = 0.0  # seconds of its timeout used (:meth:`SessionThreads.apply`)
        self.alone = 0.0  # of them, the time it would have taken alone
        self.share = 0.0  # of them, its share of the wall time beside the others
        self.cancelled = False  # gave up before it started: never run
        self.overdue = False  # ran past its timeout
        self.left_running = False  # still ran at its timeout: it holds its thread
        # When ``fn`` returned, recorded by its thread before it takes the pool's lock: a
        # charge taken before the outcome is recorded ends there (:meth:`SessionThreads.apply`).
        self.returned_at: float | None = None
        self.outcome: tuple[str, Any] | None = None
        self.done = threading.Event()

    def check(self) -> None:
        """Mark the call overdue if it was charged its timeout: one that had not returned is
        left running, holding its thread, which is retired. A call that returned is judged by
        its charge up to its return alone, whichever of its thread and another charge takes
        the pool's lock first."""
        if not self.started or self.overdue or self.charged < self.timeout_s:
            return
        self.overdue = True
        if self.returned_at is None:
            self.left_running = True
            self.thread.held, self.thread.retired = self, True


class _Thread:
    """A daemon thread that runs the calls of the sessions bound to it, one after another
    in the order given; ``held`` is a call of one of them that outlived its timeout and
    still runs, which no later call waits for. The threads of a pool share ``pool``'s lock."""

    def __init__(self, name: str, pool: SessionThreads) -> None:
        self.sessions = 0  # bound to it and not closed
        self.retired = False  # takes no more sessions; ends once its sessions are closed
        self.held: _Call | None = None
        self.pool = pool
        self._lock = pool.lock
        self._calls: collections.deque[_Call] = collections.deque()
        self._cpu = 0.0
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.thread.start()
        self._clock = _cpu_clock(self.thread)

    def cpu_seconds(self) -> float:
        """The CPU seconds this thread ran (0 where the platform cannot tell: its calls are
        then charged their wall time); once it ended, what it ran until then."""
        if self._clock is not None and self.thread.is_alive():
            with contextlib.suppress(OSError):
                self._cpu = time.clock_gettime(self._clock)
        return self._cpu

    def _serve(self) -> None:
        while (call := self._next()) is not None:
            try:
                outcome: tuple[str, Any] = ("ok", call.fn(*call.args))
            except BaseException as exc:  # reported by the caller, whatever it is
                outcome = ("raised", exc)
            call.returned_at = time.monotonic()
            with self._lock:
                call.outcome = outcome
                self.pool.charge()  # a call that returns past its timeout is late
                self.pool.running.discard(call)
                if self.held is call:
                    self.held = None
                call.done.set()
                self._lock.notify_all()

    def _next(self) -> _Call | None:
        """The next call to run; None once the thread is retired and its sessions closed."""
        with self._lock:
            while True:
                while self._calls:
                    call = self._calls.popleft()
                    if not call.cancelled:
                        self.pool.charge()  # the running calls, up to its start
                        call.started = True
                        self.pool.running.add(call)
                        self._lock.notify_all()
                        return call
                if self.retired and self.sessions == 0:
                    return None
                self._lock.wait()

    def submit(self, fn: Callable[..., Any], args: tuple[Any, ...], timeout_s: float) -> _Call:
        """``fn(*args)`` queued after this thread's calls, bounded by ``timeout_s`` from its
        start (:meth:`SessionThreads.wait`)."""
        call = _Call(self, fn, args, timeout_s)
        with self._lock:
            self._calls.append(call)
            self._lock.notify_all()
        return call

    def bind(self) -> None:
        """A session is bound to this thread."""
        with self._lock:
            self.sessions += 1

    def release(self) -> None:
        """A session bound to this thread is over."""
        with self._lock:
            self.sessions -= 1
            self._lock.notify_all()


class SessionThreads:
    """The threads that run one worker's environment calls: at most ``size`` take sessions
    (``rollout.multi_turn.env_threads``), each session bound to the one with the fewest
    when it is made. Calls of different threads run side by side, a thread's one after
    another. A thread whose call outlived its timeout is retired (a fresh one takes its
    place) and ends once its sessions are closed and that call returned; ``abandoned``
    counts such calls still running."""

    def __init__(self, size: int, abandoned: AbandonedCalls) -> None:
        self.size, self.abandoned = size, abandoned
        self.lock = threading.Condition()  # guards every thread's calls and state
        self.running: set[_Call] = set()  # the calls started and not yet returned
        self._threads: list[_Thread] = []
        self._made = 0
        self._every: list[_Thread] = []  # the pool's threads that have not ended
        self._charged_at = time.monotonic()  # when the running calls were last charged
        self._cpu: dict[_Thread, float] = {}  # the threads' CPU seconds then

    def charge(self) -> None:
        """Charge every running call the time since the last charge, and check it against its
        timeout (under the lock): what that time would have been to it alone, as far as the
        clocks tell (:meth:`apply`)."""
        self._every = [t for t in self._every if t.thread.is_alive()]
        self.apply(time.monotonic(), {t: t.cpu_seconds() for t in self._every})

    def apply(self, now: float, cpu: dict[_Thread, float]) -> None:
        """Charge each running call that is not overdue the time since the last charge
        (``cpu``: each thread's CPU seconds ``now``), then check it against its timeout. Its
        charge is the larger of two sums. What the time would have been to it alone: the wall
        time less the CPU time the pool's other threads ran meanwhile (Python code holds one
        interpreter lock, so calls that compute side by side take turns on it, each as long
        as all of them together; a call that waits, for a sandbox, a request or for ever,
        while the others wait too is charged the wall time), or its own thread's CPU time
        where that is more (code that releases the lock runs on several cores at once). And
        its share of the wall time, 1/k beside k running calls it included: whatever the
        others run, a stuck call is found within k times its timeout, and at its timeout once
        it runs alone. Each interval adds at most the wall time, so waiting ``timeout_s -
        charged`` never finds a call late; both sums only add up, so how often it is charged
        changes nothing. A call that returned (``returned_at``) is charged the time up to its
        return alone, even when its outcome is recorded after this charge."""
        start, last = self._charged_at, self._cpu
        wall = now - start
        spent = {t: max(0.0, v - last.get(t, 0.0)) for t, v in cpu.items()}
        self._charged_at, self._cpu = now, cpu
        live = [c for c in self.running if not c.overdue]
        total = sum(spent.values())
        for call in live:
            own = spent.get(call.thread, 0.0)
            ran = (
                wall if call.returned_at is None else min(max(call.returned_at - start, 0.0), wall)
            )
            call.alone += max(ran - (total - own), own, 0.0)
            call.share += ran / len(live)
            call.charged = max(call.alone, call.share)
        for call in list(self.running):
            call.check()

    def bind(self) -> _Thread:
        """The thread a new session's calls run in."""
        self._threads = [t for t in self._threads if not t.retired]
        if len(self._threads) < self.size:
            self._made += 1
            thread = _Thread(f"verlite-env-{self._made}", self)
            self._threads.append(thread)
            with self.lock:
                self._every.append(thread)
        thread = min(self._threads, key=lambda t: t.sessions)
        thread.bind()
        return thread

    def wait(self, call: _Call) -> tuple[str, Any]:
        """``("ok", result)``, ``("raised", exception)``, ``("timeout", the call)``: it ran
        past its timeout (``left_running`` if it still ran then), or ``("held", the call
        holding its thread)``: its thread was held by another session's call that outlived
        its timeout, and this call was not run. The timeout counts from the call's start
        (:meth:`charge`): waiting for another session's call that is within its own timeout
        does not count. Every running call of the pool is charged and checked while this
        waits (at least once a second), so a call whose caller waits for another one is
        judged by its own time."""
        with self.lock:
            while True:
                self.charge()
                if call.overdue:
                    return "timeout", call
                if call.outcome is not None:
                    return call.outcome
                if not call.started and call.thread.held is not None:
                    call.cancelled = True
                    return "held", call.thread.held
                # Woken no later than the first running call could use its timeout.
                left = [c.timeout_s - c.charged for c in self.running if not c.overdue]
                self.lock.wait(min(max(min(left), 1e-3), 1.0) if left else None)


class Session:
    """The environment of prompt ``index``'s trajectory, its calls run in a thread of
    ``threads`` (its worker's); ``turns``, the chat template's turn format its observations
    are written in (``data.chat_template``), if any. Made and reset by :func:`open_sessions`.
    One caller at a time opens, steps and closes a worker's sessions (their calls then run
    in the threads)."""

    def __init__(
        self,
        cls: type,
        *,
        index: int,
        timeout_s: float,
        threads: SessionThreads,
        turns: TurnFormat | None = None,
    ) -> None:
        self.name, self.index, self.timeout_s = environment_name(cls), index, timeout_s
        self.abandoned = threads.abandoned
        self.turns = turns
        self.error: str | None = None
        self.timed_out = False  # a step outlived timeout_s: its call was left running
        self.env: Any = None  # made by open_sessions
        self._threads = threads
        self._thread: _Thread | None = threads.bind()
        self._last: _Call | None = None  # its latest call

    def close(self) -> None:
        """The trajectory is over: its thread no longer runs calls for it, its call still
        queued included (a run stopped by another row's broken reset starts no more sandboxes
        for it)."""
        if self._thread is not None:
            with self._threads.lock:
                if self._last is not None and not self._last.started:
                    self._last.cancelled = True
            self._thread.release()
            self._thread = None

    def _submit(self, fn: Callable[..., Any], *args: Any) -> _Call:
        """``fn(*args)`` queued on this session's thread, or on a fresh one when another
        session's call that outlived its timeout holds it (a retired thread)."""
        assert self._thread is not None, "a closed session makes no calls"
        if self._thread.held is not None:
            self._thread.release()
            self._thread = self._threads.bind()
        self._last = self._thread.submit(fn, args, self.timeout_s)
        return self._last

    def _outcome(self, call: _Call) -> tuple[str, Any]:
        """The outcome of ``call`` (:meth:`SessionThreads.wait`), queued again (on a fresh
        thread) if a call that outlived its timeout held its thread before it started."""
        while (outcome := self._threads.wait(call))[0] == "held":
            call = self._submit(call.fn, *call.args)
        return outcome

    def _abandoned(self, call: _Call) -> int | None:
        """How many abandoned calls this worker has, ``call`` counted in, if it was left
        running at its timeout; None if it returned, late."""
        return self.abandoned.add(call) if call.left_running else None

    def _start_set_up(self, what: str, fn: Callable[..., Any], *args: Any) -> Callable[[], Any]:
        """Start a call that makes or resets the environment; the function returned waits
        for its result: one that raises or hangs breaks the contract."""
        call = self._submit(fn, *args)
        return lambda: self._set_up(call, what)

    def _set_up(self, call: _Call, what: str) -> Any:
        outcome, value = self._outcome(call)
        if outcome == "timeout":
            self._abandoned(value)
            self._refuse(f"{what} did not return within {self.timeout_s:g} s")
        if outcome == "raised":
            self._refuse(f"{what} raised {type(value).__name__}: {one_line(value, 300)}")
        return value

    def start_step(self, action: str) -> Callable[[], Turn | None]:
        """Start the environment's answer to a policy turn: its call is queued on this
        session's thread, and runs while the calls of sessions on other threads run. The
        function returned waits for it: the answer, or None after a tool error (recorded in
        ``error``), which ends the trajectory: the step raised or outlived ``timeout_s``
        (``timed_out``: its call was left running)."""
        call = self._submit(self.env.step, action)
        return lambda: self._answer(call)

    def _answer(self, call: _Call) -> Turn | None:
        outcome, value = self._outcome(call)
        if outcome == "timeout":
            self.error = f"step did not return within {self.timeout_s:g} s"
            running = self._abandoned(value)
            if running is not None:
                self.timed_out = True
                self._check_abandoned(running)
            return None
        if outcome == "raised":
            self.error = f"step raised {type(value).__name__}: {one_line(value, 300)}"
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
            if self.turns is None:  # appended to the turn's text as it follows it
                ids: list[int] = tokens_after_text(tokenizer, text, written=True)
            else:
                ids = self.turns.observation_ids(text)
        except Exception as exc:  # whatever a tokenizer raises, the observation is the cause
            self._refuse(
                f"{what}, which the tokenizer cannot encode: {type(exc).__name__}: "
                f"{one_line(exc, 300)}"
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


def open_sessions(
    cls: type,
    records: Sequence[PromptRecord],
    *,
    indices: Sequence[int],
    timeout_s: float,
    threads: SessionThreads,
    turns: TurnFormat | None = None,
) -> list[Session]:
    """The sessions of the trajectories of ``records`` (the prompt of ``indices[i]`` for
    ``records[i]``), each environment made with ``cls()`` and reset with its own copy of its
    record (an environment may edit what it is given, and the ``rollout.n`` trajectories of
    a prompt, and the driver's scoring, must not see that). Every environment is made, then
    every one reset, each call started on its session's thread before any is waited for, so
    that the calls of different threads run side by side; the results are taken in row
    order, so that the row whose call broke the contract first in row order stops the run,
    whichever finished first (every session is then closed)."""
    sessions: list[Session] = []
    try:
        for index in indices:
            sessions.append(
                Session(cls, index=index, timeout_s=timeout_s, threads=threads, turns=turns)
            )
        made = [s._start_set_up(f"{cls.__name__}()", cls) for s in sessions]
        for session, result in zip(sessions, made, strict=True):
            session.env = result()
        reset = [
            s._start_set_up("reset", s.env.reset, copy.deepcopy(record))
            for s, record in zip(sessions, records, strict=True)
        ]
        for result in reset:
            result()
    except BaseException:
        for session in sessions:
            session.close()
        raise
    return sessions


def _cpu_clock(thread: threading.Thread) -> int | None:
    """The id of ``thread``'s CPU-time clock; None where the platform has none."""
    try:
        return time.pthread_getcpuclockid(thread.ident)  # type: ignore[arg-type]
    except (AttributeError, OSError):
        return None
