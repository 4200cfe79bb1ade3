"""Built-in rule-based rewards and their edge cases."""

import re
from collections.abc import Callable
from re import _constants as sre
from re import _parser as sre_parse
from typing import Any

import pytest
import torch
from scorer_support import byte_tokenizer, fn_scorer, step_batch

from verlite.config import Config, load_config
from verlite.rewards import REWARDS, digit_match, exact_match, gsm8k, resolve_reward, rules
from verlite.rewards.rules import Gsm8kReward


@pytest.mark.parametrize(
    ("response", "answer", "score"),
    [
        ("42", "42", 1.0),
        ("  42 \n", "42", 1.0),
        ("42", " 42 ", 1.0),
        ("4 2", "42", 0.0),
        ("", "42", 0.0),
        ("", "", 1.0),
        ("420", "42", 0.0),
    ],
)
def test_exact_match(response: str, answer: str, score: float) -> None:
    assert exact_match(response, answer, "prompt") == score


@pytest.mark.parametrize(
    ("response", "answer", "score"),
    [
        ("1284", "1284", 1.0),
        (" 1284 ", "1284", 1.0),
        ("1294", "1284", 0.5 * 3 / 4 + 0.5),  # right length, one digit wrong
        ("4821", "1284", 0.5),  # right length, no digit in place
        ("128", "1284", 0.5 * 3 / 4),  # too short: no length credit
        ("12845", "1284", 0.5),  # too long: all digits in place, no length credit
        ("", "1284", 0.0),
        ("1284", "", 0.0),
        ("", "", 1.0),
        ("  ", "", 1.0),
    ],
)
def test_digit_match(response: str, answer: str, score: float) -> None:
    assert digit_match(response, answer, "reverse 4821=") == pytest.approx(score)


def test_digit_match_is_one_only_for_an_exact_match() -> None:
    answer = "10293"
    for response in ["1029", "102930", "10283", "10293 0", "0293"]:
        assert 0.0 <= digit_match(response, answer, "") < 1.0


@pytest.mark.parametrize(
    ("response", "answer", "score", "answered"),
    [
        ("so the total is\n#### 42", "42", 1.0, True),
        ("#### 42", "#### 42", 1.0, True),
        ("#### 1,234", "1234", 1.0, True),
        ("#### 1234", "step one... 1,000 + 234\n#### 1,234", 1.0, True),
        ("#### 42.0", "42", 1.0, True),
        ("#### $42", "42", 1.0, True),
        ("####42 apples", "42", 1.0, True),
        ("#### -3", "-3", 1.0, True),
        ("#### 3", "-3", 0.0, True),  # answered, wrong
        ("#### 41 ... #### 42", "42", 1.0, True),  # the last mark counts
        ("#### 42 ... #### 41", "42", 0.0, True),
        ("#### 42 ... #### none", "42", 0.0, False),  # nothing after the last mark
        ("42", "42", 0.0, False),  # no final-answer mark
        ("", "42", 0.0, False),
        ("####", "42", 0.0, False),
        ("#### ", "42", 0.0, False),
        ("#### forty-two", "42", 0.0, False),
        ("#### 0.5", "0.50", 1.0, True),
    ],
)
def test_gsm8k(response: str, answer: str, score: float, answered: bool) -> None:
    """The score, and a response without a number after its last #### counted as no answer
    (reward/gsm8k/no_answer): a silent 0 is never without a count."""
    reward = Gsm8kReward()
    assert reward(response, answer, "question") == score
    assert reward.counts() == {"no_answer": 0 if answered else 1}


def test_a_step_counts_its_responses_without_a_gsm8k_answer() -> None:
    """The driver's scorer logs each step's own count (not the run's) for the run's own
    reward, which the registry's shared one does not see."""
    cfg = Config.model_validate({"data": {"train_file": "p.jsonl"}, "reward": {"fn": "gsm8k"}})
    tokenizer = byte_tokenizer()
    records = [{"prompt": "Clips?", "answer": "48 + 24 = 72\n#### 72"}]
    shared = REWARDS["gsm8k"]
    assert isinstance(shared, Gsm8kReward)
    shared_before = shared.counts()
    scorer = fn_scorer(cfg, tokenizer, resolve_reward(cfg))
    steps = [
        scorer.score(step_batch(tokenizer, texts, [0] * len(texts)), records)
        for texts in (
            ["#### 72", "72", "#### ", "so #### 71", "#### seventy-two"],
            ["#### 72", "#### 1,000"],
            ["the answer is 72"],
        )
    ]
    assert [scores.tolist() for scores, _ in steps] == [[1, 0, 0, 0, 0], [1, 0], [0]]
    assert [metrics for _, metrics in steps] == [
        {"reward/fn/mean": pytest.approx(1 / 5), "reward/gsm8k/no_answer": 3.0},
        {"reward/fn/mean": 0.5, "reward/gsm8k/no_answer": 0.0},
        {"reward/fn/mean": 0.0, "reward/gsm8k/no_answer": 1.0},
    ]
    assert shared.counts() == shared_before


@pytest.mark.parametrize(("precision", "dtype"), [("fp64", torch.float64), ("fp32", torch.float32)])
def test_the_scorer_gives_scores_in_the_runs_dtype(precision: str, dtype: torch.dtype) -> None:
    """An fp64 run's scores are float64 (a reward function's, and an environment's reward
    from its float64 column): a score rounded to float32 could round apart under another
    reward layout. Every other run's are float32, as before. Mutation: float32 scores in
    every run (``Scorer.score``) fail the fp64 case."""
    cfg = load_config(None, ["data.task=copy", f"model.precision={precision}"])
    tokenizer = byte_tokenizer()
    scorer = fn_scorer(cfg, tokenizer, lambda *_: 1 / 3)
    scores, _ = scorer.score(
        step_batch(tokenizer, ["72", "71"], [0, 0]), [{"prompt": "", "answer": ""}]
    )
    batch = step_batch(tokenizer, ["72"], [0])
    batch["env_score"] = torch.tensor([1 / 3], dtype=torch.float64)  # multi-turn's column
    env, _ = scorer.score(batch, [])
    for got in (scores, env):
        assert got.dtype == dtype and torch.equal(
            got, torch.tensor(1 / 3, dtype=dtype).expand_as(got)
        )


def test_gsm8k_answer_without_a_number() -> None:
    with pytest.raises(ValueError, match="the answer 'forty' holds no number"):
        gsm8k("#### 40", "forty", "")


# What \s and \d are for the str patterns of verlite.rewards (Unicode, as re has them).
_CATEGORIES: dict[object, Callable[[str], bool]] = {
    sre.CATEGORY_SPACE: str.isspace,
    sre.CATEGORY_DIGIT: str.isdecimal,
}


def backtracking_steps(pattern: re.Pattern[str], text: str) -> int:
    """The character tests that ``pattern.match(text)`` makes in a backtracking matcher (as
    Python's re is): greedy repeats that give back one character at a time. Work counted,
    not timed; only the items a reward's number pattern is made of are known here, any
    other is an error rather than a wrong count."""
    steps = 0

    def one(item: tuple[object, object], char: str) -> bool:
        op, arg = item
        if op is sre.LITERAL:
            return ord(char) == arg
        if op is sre.IN:
            return any(one(sub, char) for sub in arg)
        if op is sre.CATEGORY:
            return _CATEGORIES[arg](char)
        raise NotImplementedError(f"backtracking_steps does not know {op}")

    def match(items: list[Any], at: int, then: Callable[[int], int | None]) -> int | None:
        nonlocal steps
        if not items:
            return then(at)
        (op, arg), rest = items[0], items[1:]

        def after(end: int) -> int | None:
            return match(rest, end, then)

        if op is sre.SUBPATTERN:
            return match(list(arg[-1]), at, after)
        if op is sre.MAX_REPEAT:
            low, high, body = arg
            if len(body) == 1 and body[0][0] in (sre.LITERAL, sre.IN):
                # One character at a time (re's REPEAT_ONE): as many as match, then the
                # rest tried after each count, from the most down to the fewest.
                end = at
                while end - at < high:
                    steps += 1
                    if not (end < len(text) and one(body[0], text[end])):
                        break
                    end += 1
                for count_end in range(end, at + low - 1, -1):
                    found = after(count_end)
                    if found is not None:
                        return found
                return None

            def repeat(count: int, end: int) -> int | None:
                if count < high:
                    more = match(
                        list(body), end, lambda e: repeat(count + 1, e) if e > end else None
                    )
                    if more is not None:
                        return more
                return after(end) if count >= low else None

            return repeat(0, at)
        steps += 1
        return after(at + 1) if at < len(text) and one((op, arg), text[at]) else None

    found = match(list(sre_parse.parse(pattern.pattern, pattern.flags)), 0, lambda end: end)
    match_ = pattern.match(text)
    assert found == (match_.end() if match_ else None)  # the count is of the match re makes
    return steps


def test_gsm8k_reads_a_response_of_whitespace_in_linear_time() -> None:
    # A degenerate response: its final-answer mark, then lines of whitespace. The number
    # pattern failed in quadratic time (24 s for 32,000 characters): two runs of whitespace
    # side by side share each line in every way. Counted, not timed: four times the
    # whitespace costs the matcher at most four times the work.
    assert gsm8k("#### " + "\t\n" * 16_000 + "x", "42", "question") == 0.0
    assert gsm8k("#### $ \t1,042", "1042", "question") == 1.0  # whitespace after the $ still
    short, long = (
        backtracking_steps(rules._NUMBER, " " + "\t\n" * lines + "x") for lines in (25, 100)
    )
    assert long <= 4 * short
