"""Built-in rule-based rewards and their edge cases."""

import time

import pytest
from scorer_support import byte_tokenizer, step_batch

from verlite.config import Config
from verlite.driver.scorer import Scorer
from verlite.rewards import REWARDS, digit_match, exact_match, gsm8k, resolve_reward
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
    scorer = Scorer(cfg, tokenizer, reward_fn=resolve_reward(cfg), remote=None, reward_model=None)
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


def test_gsm8k_answer_without_a_number() -> None:
    with pytest.raises(ValueError, match="the answer 'forty' holds no number"):
        gsm8k("#### 40", "forty", "")


def test_gsm8k_reads_a_response_of_whitespace_in_linear_time() -> None:
    # A degenerate response: its final-answer mark, then lines of whitespace. The number
    # pattern failed in quadratic time (24 s for these 32,000 characters).
    response = "#### " + "\t\n" * 16_000 + "x"
    started = time.perf_counter()
    assert gsm8k(response, "42", "question") == 0.0
    assert gsm8k("#### $ \t1,042", "1042", "question") == 1.0  # whitespace after the $ still
    assert time.perf_counter() - started < 2.0
