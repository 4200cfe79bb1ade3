"""Synthetic task generators: deterministic from the seed, correct answers, digit ranges."""

import random
import re
import typing

import pytest

from verlite.config import DataConfig
from verlite.data import TASKS
from verlite.rewards import REWARDS


def _pairs(task: str, seed: int, n: int = 200, lo: int = 1, hi: int = 6) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    return [TASKS[task].generate(rng, lo, hi) for _ in range(n)]


def test_registry_matches_the_config_and_the_rewards() -> None:
    assert set(TASKS) == set(
        typing.get_args(typing.get_args(DataConfig.model_fields["task"].annotation)[0])
    )
    for task in TASKS.values():
        assert task.reward in REWARDS


@pytest.mark.parametrize("task", sorted(TASKS))
def test_deterministic_from_the_seed(task: str) -> None:
    assert _pairs(task, 3) == _pairs(task, 3)
    assert _pairs(task, 3) != _pairs(task, 4)


def test_copy() -> None:
    for prompt, answer in _pairs("copy", 0):
        assert prompt == f"{answer}="
        assert answer.isdigit()
    assert TASKS["copy"].generate(random.Random(0), 4, 4) == ("6048=", "6048")


def test_reverse_of_reverse_is_identity() -> None:
    for prompt, answer in _pairs("reverse", 0):
        digits = re.fullmatch(r"(\d+)>", prompt)
        assert digits is not None
        assert answer == digits[1][::-1]
        assert answer[::-1] == digits[1]


def test_add_is_integer_addition() -> None:
    for prompt, answer in _pairs("add", 0, n=500):
        operands = re.fullmatch(r"(\d+)\+(\d+)=", prompt)
        assert operands is not None
        a, b = operands[1], operands[2]
        assert int(answer) == int(a) + int(b)
        for operand in (a, b):
            assert 1 <= len(operand) <= 6
            assert len(operand) == 1 or operand[0] != "0"  # no leading zeros


@pytest.mark.parametrize("task", sorted(TASKS))
@pytest.mark.parametrize(("lo", "hi"), [(1, 1), (3, 3), (2, 5)])
def test_digit_lengths_stay_in_range(task: str, lo: int, hi: int) -> None:
    lengths = set()
    for prompt, _ in _pairs(task, 1, lo=lo, hi=hi):
        for number in re.findall(r"\d+", prompt):
            assert lo <= len(number) <= hi
            lengths.add(len(number))
    assert lengths == set(range(lo, hi + 1))  # every length is drawn


def test_every_task_prompt_and_answer_uses_the_task_alphabet() -> None:
    from verlite.data.tasks import TASK_ALPHABET

    for task in TASKS:
        for prompt, answer in _pairs(task, 0, n=200):
            assert set(prompt + answer) <= set(TASK_ALPHABET), (task, prompt, answer)
