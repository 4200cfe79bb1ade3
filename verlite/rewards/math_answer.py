"""The math reward (``reward.fn=math``): a response's final answer checked for equivalence with
the reference answer by math-verify (the optional extra ``math``; docs/math-verifier.md).

The final answer of a text is the content of its last ``\\boxed{...}`` whose braces balance
(escaped ``\\{`` and ``\\}`` do not count), else what follows its last ``####`` on that line;
nothing else (no "the answer is", no last number): the reward teaches the form the prompt
asks for. A reference answer that has neither is taken whole. A final answer longer than
:data:`MAX_ANSWER_CHARS` is no answer.

Score: 1 when math-verify finds the two equivalent (``0.5``, ``1/2`` and ``\\frac{1}{2}``;
``72`` and ``72.0``), else ``format_credit`` (``reward.math_format_credit``) when the
response's answer reads as an expression, else 0. A response without a final answer scores 0
and is counted (``no_answer``; a step's as ``reward/math/no_answer``, as every built-in
reward that reads a final answer does: :mod:`verlite.rewards.answer_reward`): a model that
never writes the asked form is told apart from one that answers wrong.

math-verify runs in a process of its own (:mod:`verlite.rewards.math_worker`), started on the
first call and kept: its timeouts use SIGALRM, which only a main thread can, and a thread
that computes cannot be stopped. Each verification gets half of ``reward.timeout_s``; one
that takes longer is abandoned (the process killed, a new one started on the next call),
scored 0, said on the console and counted (``abandoned``; the driver's scorer logs a
step's as ``reward/math/abandoned``), so a huge or adversarial response costs at
most that and never stops the run on ``reward.timeout_s``.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any, TextIO

from verlite.data.answers import GSM8K_MARK, last_boxed
from verlite.errors import import_extra, shown
from verlite.rewards.answer_reward import AnswerReward

MAX_ANSWER_CHARS = 1000
_WORKER = Path(__file__).with_name("math_worker.py")


def final_answer(text: str) -> str | None:
    """The last ``\\boxed{...}`` to close (``data.answers.last_boxed``: a box a response's
    length limit cut off is passed over), else the rest of the last ``####`` line, stripped;
    None when there is neither, or it is empty or too long."""
    boxed = last_boxed(text, complete=False)
    if boxed is None and GSM8K_MARK in text:
        boxed = text.rsplit(GSM8K_MARK, 1)[1].split("\n", 1)[0].strip()
    return boxed if boxed and len(boxed) <= MAX_ANSWER_CHARS else None


def reference_answer(answer: str) -> str:
    """The reference's final answer: as :func:`final_answer` finds it, else the whole text."""
    found = final_answer(answer)
    if found is not None:
        return found
    whole = answer.strip()
    if not 0 < len(whole) <= MAX_ANSWER_CHARS:
        raise ValueError(
            f"math reward: the reference answer {shown(answer, 80)} is empty or longer than "
            f"{MAX_ANSWER_CHARS} characters, with no \\boxed{{}} or #### answer in it"
        )
    return whole


def check_installed() -> None:
    """Fail at start-up, in one line with the install command, when math-verify is missing."""
    import_extra("math_verify", feature="reward.fn=math", extra="math")


class MathReward(AnswerReward):
    """``fn(response, answer, prompt) -> score`` for ``reward.fn=math``; see the module
    docstring. Calls may come from any thread; they verify one at a time."""

    name = "math"
    # abandoned: verifications that outlived the budget; no_answer: responses without a
    # final answer (no \boxed{}, no ####)
    COUNTS = ("abandoned", "no_answer")

    def __init__(
        self, *, format_credit: float = 0.0, timeout_s: float = 30.0, stream: TextIO | None = None
    ) -> None:
        super().__init__()
        self.format_credit = format_credit
        self.budget_s = timeout_s / 2
        self._stream = stream
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self._buffer = b""

    @property
    def abandoned(self) -> int:
        """The verifications abandoned so far."""
        return self.counts()["abandoned"]

    def __call__(self, response: str, answer: str, prompt: str) -> float:
        gold = reference_answer(answer)
        pred = final_answer(response)
        if pred is None:
            self.count("no_answer")
            return 0.0
        with self._lock:
            reply = self._verify(gold, pred)
        if reply is None:
            return 0.0
        if "error" in reply:
            raise ValueError(f"math reward: {reply['error']}")
        if reply["equal"]:
            return 1.0
        return self.format_credit if reply["parsed"] else 0.0

    def check_reference(self, answer: str) -> None:
        """Raise ValueError when math-verify cannot read ``answer``'s final answer
        (:func:`reference_answer`), or not within the budget: every response to its prompt
        would stop the run (or be abandoned) when scored, so it is found before the run
        starts. math-verify reads it in its process, as it does when scoring."""
        gold = reference_answer(answer)
        try:
            with self._lock:
                reply = self._ask({"gold": gold})
        except RuntimeError as exc:  # the process ended on it (out of its memory or CPU time)
            raise ValueError(f"{exc} reading the reference answer {shown(gold, 80)}") from None
        if reply == "did not start":  # not the answer's doing: every verification's would fail
            raise ValueError(
                f"math reward: math-verify's process did not start within {self.budget_s:g} s "
                "(half of reward.timeout_s, which a verification's start counts in); raise "
                "reward.timeout_s"
            )
        if isinstance(reply, str):
            raise ValueError(
                f"math reward: math-verify {reply} within {self.budget_s:g} s (half of "
                f"reward.timeout_s) reading the reference answer {shown(gold, 80)}"
            )
        if "error" in reply:
            raise ValueError(
                f"math reward: math-verify cannot read the reference answer {shown(gold, 80)}; "
                "write it as a number or a LaTeX expression"
            )

    def close(self) -> None:
        """Stop the verifier process (it is stopped at exit too); the next call starts one."""
        with self._lock:
            self._stop()

    def _verify(self, gold: str, pred: str) -> dict[str, Any] | None:
        """math-verify's reply, or None when it did not come within the budget."""
        reply = self._ask({"gold": gold, "pred": pred})
        if isinstance(reply, str):
            self._abandon(pred, reply)
            return None
        return reply

    def _ask(self, request: dict[str, str]) -> dict[str, Any] | str:
        """math-verify's reply to ``request``; when it does not come within the budget, what
        went wrong ("did not start", "did not answer"), the process stopped."""
        deadline = time.monotonic() + self.budget_s
        process = self._process or self._start(deadline)
        if process is None:
            self._stop()
            return "did not start"
        assert process.stdin is not None
        # Small (the answers are at most MAX_ANSWER_CHARS): it fits the pipe, never blocks.
        process.stdin.write(json.dumps(request).encode() + b"\n")
        process.stdin.flush()
        reply = self._read(process, deadline)
        if reply is None:
            self._stop()
            return "did not answer"
        return reply

    def _start(self, deadline: float) -> subprocess.Popen[bytes] | None:
        process = subprocess.Popen(
            [sys.executable, "-P", str(_WORKER), repr(self.budget_s)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        weakref.finalize(self, _kill, process)
        self._process, self._buffer = process, b""
        ready = self._read(process, deadline)
        if ready is None:
            return None
        if not ready.get("ready"):
            self._stop()
            raise RuntimeError(f"math reward: the math-verify process said {ready!r} at start")
        return process

    def _read(self, process: subprocess.Popen[bytes], deadline: float) -> dict[str, Any] | None:
        """The process's next line, parsed; None when it does not come before ``deadline``.
        The process never ends by itself: when it does (it crashed), that is the error."""
        assert process.stdout is not None
        fd = process.stdout.fileno()
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._buffer:
                left = deadline - time.monotonic()
                if left <= 0 or not selector.select(left):
                    return None
                chunk = os.read(fd, 65536)
                if not chunk:
                    self._process = None
                    raise RuntimeError(
                        f"math reward: the math-verify process exited (code {process.wait()})"
                    )
                self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        reply: dict[str, Any] = json.loads(line)
        return reply

    def _abandon(self, pred: str, what: str) -> None:
        abandoned = self.count("abandoned")
        print(
            f"reward: math: math-verify {what} within {self.budget_s:g} s (half of "
            f"reward.timeout_s) on the answer {shown(pred, 60)}; scored 0 and its process "
            f"restarted ({abandoned} so far)",
            file=self._stream or sys.stdout,
            flush=True,
        )

    def _stop(self) -> None:
        if self._process is not None:
            _kill(self._process)
            self._process = None


def _kill(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.kill()
        process.wait()
