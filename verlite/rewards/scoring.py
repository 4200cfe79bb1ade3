"""Scoring a step's responses with the run's reward function, checked and bounded.

Every score must be a real number in [0, 1]: ``bool``, ``int``, ``float``, ``Fraction`` and
numpy or 0-d torch reals are accepted and converted to ``float`` (the first such conversion
is said once on the console); anything else stops the run naming the function, the response
index and the value.

The function runs in a thread of its own, one response after another, so that a call that
outlives ``reward.timeout_s`` stops the run with an error naming the response instead of
hanging it; an exception it raises, or ``sys.exit`` inside it, is reported the same way, in
one line. A scoring stage that takes long prints its progress.
"""

from __future__ import annotations

import math
import numbers
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from verlite.errors import UserError, one_line, shown
from verlite.rewards.registry import RewardFn, reward_name

# How often a slow scoring stage says how far it is.
PROGRESS_EVERY_S = 10.0


class RewardError(UserError):
    """The reward function failed on a response: it raised, exited, timed out, or returned
    something that is not a score in [0, 1]."""


def score_responses(
    fn: RewardFn,
    responses: Sequence[str],
    answers: Sequence[str],
    prompts: Sequence[str],
    *,
    timeout_s: float | None = None,
    stream: TextIO | None = None,
) -> list[float]:
    """Score each response; every score a finite number in [0, 1], each call within
    ``timeout_s`` seconds (None: no bound)."""
    if not len(responses) == len(answers) == len(prompts):
        raise ValueError(
            f"score_responses needs one answer and prompt per response; got {len(responses)} "
            f"responses, {len(answers)} answers, {len(prompts)} prompts"
        )
    results: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
    calls = list(zip(responses, answers, prompts, strict=True))
    # A daemon thread: one stuck in a call that timed out cannot keep the process alive.
    threading.Thread(target=_score_all, args=(fn, calls, results), daemon=True).start()
    out = stream or sys.stdout
    started = time.monotonic()
    next_report = started + PROGRESS_EVERY_S
    scores: list[float] = []
    for i, (response, _, _) in enumerate(calls):
        deadline = math.inf if timeout_s is None else time.monotonic() + timeout_s
        while True:
            now = time.monotonic()
            if now >= deadline:
                raise RewardError(
                    f"reward function {reward_name(fn)} took more than {timeout_s:g} s "
                    f"(reward.timeout_s) on response {i} ({_short(response)})"
                )
            if now >= next_report:
                print(
                    f"reward: {i}/{len(calls)} responses scored in {now - started:.0f} s",
                    file=out,
                    flush=True,
                )
                next_report = now + PROGRESS_EVERY_S
            try:
                kind, value = results.get(timeout=min(deadline, next_report) - now)
                break
            except queue.Empty:
                continue
        if kind == "raised":
            raise RewardError(
                f"reward function {reward_name(fn)} raised on response {i} ({_short(response)}): "
                f"{value}"
            )
        scores.append(_checked(fn, value, i, response, out))
    return scores


def _score_all(
    fn: RewardFn, calls: list[tuple[str, str, str]], results: queue.SimpleQueue[Any]
) -> None:
    for response, answer, prompt in calls:
        try:
            results.put(("scored", fn(response, answer, prompt)))
        except SystemExit as exc:
            results.put(("raised", f"it called sys.exit({exc.code!r})"))
            return
        except BaseException as exc:
            results.put(("raised", f"{type(exc).__name__}: {one_line(exc, 300)}"))
            return


# Score types already said to be converted (said once per process).
_CONVERTED: set[type] = set()


def _checked(
    fn: Callable[..., object], score: Any, index: int, response: str, out: TextIO
) -> float:
    value = as_real(score)
    if value is None or not (math.isfinite(value) and 0.0 <= value <= 1.0):
        # A tensor's or array's repr spans lines.
        said = shown(score, 80, lambda v: one_line(repr(v)))
        raise RewardError(
            f"reward function {reward_name(fn)} returned {said} "
            f"for response {index} ({_short(response)}); scores must be finite numbers in [0, 1]"
        )
    if type(score) is not float and type(score) not in _CONVERTED:
        _CONVERTED.add(type(score))
        print(
            f"reward: {reward_name(fn)} returns {type(score).__name__} scores; converted to float",
            file=out,
            flush=True,
        )
    return value


def as_real(score: Any) -> float | None:
    """``score`` as a float when it is a real number (a 0-d tensor or array included)."""
    if isinstance(score, numbers.Real):
        return float(score)
    item = getattr(score, "item", None)
    shape = getattr(score, "shape", None)
    if callable(item) and shape is not None and len(shape) == 0:
        value = item()
        return float(value) if isinstance(value, numbers.Real) else None
    return None


def _short(text: str, limit: int = 80) -> str:
    shown = repr(text)
    return shown if len(shown) <= limit else shown[: limit - 4] + "...'"
