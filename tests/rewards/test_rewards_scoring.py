"""Scoring a batch with the run's reward function: scores checked and converted, and a
function that raises, exits, hangs or crawls reported in one line naming the response."""

from __future__ import annotations

import io
import math
import sys
import threading
import time
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
import torch

from verlite.rewards import RewardError, digit_match, exact_match, score_responses


def test_score_responses() -> None:
    scores = score_responses(digit_match, ["12", "13", ""], ["12", "12", "12"], ["a", "b", "c"])
    assert scores == [1.0, 0.75, 0.0]
    assert all(type(s) is float for s in score_responses(lambda r, a, p: 1, ["x"], ["y"], ["z"]))


@pytest.mark.parametrize("bad", [1.5, -0.1, math.nan, math.inf, "1.0", None])
def test_score_responses_rejects_bad_scores(bad: object) -> None:
    def bad_reward(response: str, answer: str, prompt: str) -> Any:
        return bad if response == "second" else 0.5

    with pytest.raises(
        RewardError,
        match=rf"reward function {__name__}:.*bad_reward returned .* for response 1 \('second'\)",
    ):
        score_responses(bad_reward, ["first", "second"], ["a", "a"], ["p", "p"])


def test_score_responses_length_mismatch() -> None:
    with pytest.raises(ValueError, match="got 2 responses, 1 answers, 2 prompts"):
        score_responses(exact_match, ["a", "b"], ["a"], ["p", "q"])


@pytest.mark.parametrize(
    ("score", "kind"),
    [
        (True, "bool"),
        (1, "int"),
        (Fraction(1, 2), "Fraction"),
        (np.float32(0.25), "float32"),
        (torch.tensor(0.5), "Tensor"),
    ],
)
def test_real_numbers_of_other_types_are_converted_and_said_once(score: Any, kind: str) -> None:
    out = io.StringIO()
    scores = score_responses(lambda r, a, p: score, ["x", "y"], ["a", "a"], ["p", "p"], stream=out)
    assert scores == [float(score)] * 2 and all(type(s) is float for s in scores)
    assert out.getvalue().count(f"returns {kind} scores; converted to float") <= 1


@pytest.mark.parametrize(
    "bad",
    [
        torch.tensor([0.5, 0.5]),
        np.array([1.0]),
        complex(1, 0),
        torch.linspace(0, 1, 64),  # a score per token: its repr spans lines
        "0." + "5" * 10_000,
    ],
)
def test_arrays_and_complex_numbers_are_refused_in_one_short_line(bad: Any) -> None:
    """The value is quoted on one line and cut short: a tensor of scores per token quoted
    whole took 11 lines, a long string 10,000 characters."""
    with pytest.raises(RewardError, match="scores must be finite numbers in") as info:
        score_responses(lambda r, a, p: bad, ["x"], ["a"], ["p"])
    assert "\n" not in str(info.value) and len(str(info.value)) < 300


def failing_reward(response: str, answer: str, prompt: str) -> float:
    if response == "boom":
        raise ValueError("no such field\n(second line)")
    return 1.0


def exiting_reward(response: str, answer: str, prompt: str) -> float:
    if response == "boom":
        sys.exit(3)
    return 1.0


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (
            failing_reward,
            r"raised on response 2 \('boom'\): ValueError: no such field \(second line\)",
        ),
        (exiting_reward, r"raised on response 2 \('boom'\): it called sys.exit\(3\)"),
    ],
)
def test_a_reward_that_raises_or_exits_is_one_line_naming_the_response(
    fn: Any, message: str
) -> None:
    with pytest.raises(RewardError, match=message) as info:
        score_responses(fn, ["a", "b", "boom", "c"], ["x"] * 4, ["p"] * 4)
    assert "\n" not in str(info.value) and fn.__name__ in str(info.value)


def test_a_call_past_the_timeout_stops_scoring_naming_the_response() -> None:
    release, ended = threading.Event(), threading.Event()

    def slow_on_second(response: str, answer: str, prompt: str) -> float:
        if response == "slow":
            release.wait(60)  # a hang guard only: released once the error is in
            ended.set()
        return 0.5

    try:
        with pytest.raises(
            RewardError,
            match=r"took more than 0.5 s \(reward.timeout_s\) on response 1 \('slow'\)",
        ):
            score_responses(
                slow_on_second, ["ok", "slow", "ok"], ["a"] * 3, ["p"] * 3, timeout_s=0.5
            )
        assert not ended.is_set()  # the error did not wait for the call to end
    finally:
        release.set()


def test_slow_scoring_shows_progress(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("verlite.rewards.scoring.PROGRESS_EVERY_S", 0.05)

    def crawl(response: str, answer: str, prompt: str) -> float:
        time.sleep(0.04)
        return 1.0

    out = io.StringIO()
    assert score_responses(crawl, ["r"] * 6, ["a"] * 6, ["p"] * 6, stream=out) == [1.0] * 6
    lines = out.getvalue().splitlines()
    assert lines and all(
        line.startswith("reward: ") and "responses scored in" in line for line in lines
    )
