"""Synthetic tasks: seeded generators of (prompt, answer) pairs, each with its default reward.

A generator takes ``(rng, min_digits, max_digits)`` and draws the length of each number
uniformly from ``[min_digits, max_digits]``; the same ``random.Random`` state gives the
same pairs on every machine.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

Generator = Callable[[random.Random, int, int], tuple[str, str]]


# Every task prompt and answer is written with these characters only. A tokenizer of just
# them (17 tokens with the specials) lets a model trained from scratch find the answer's
# digits by chance often enough to learn from the reward; with a 60-character alphabet an
# untrained policy almost never does.
TASK_ALPHABET = "0123456789+=>"


@dataclass(frozen=True)
class Task:
    """A prompt generator and the name of the reward (in ``verlite.rewards.REWARDS``) that scores it."""

    generate: Generator
    reward: str


def _digit_string(rng: random.Random, min_digits: int, max_digits: int) -> str:
    # Leading zeros allowed: copy and reverse work on strings, and "0" must be learnt too.
    return "".join(rng.choice("0123456789") for _ in range(rng.randint(min_digits, max_digits)))


def _number(rng: random.Random, min_digits: int, max_digits: int) -> int:
    digits = rng.randint(min_digits, max_digits)
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(low, 10**digits - 1)


def copy(rng: random.Random, min_digits: int, max_digits: int) -> tuple[str, str]:
    """``4821=`` -> ``4821``."""
    digits = _digit_string(rng, min_digits, max_digits)
    return f"{digits}=", digits


def reverse(rng: random.Random, min_digits: int, max_digits: int) -> tuple[str, str]:
    """``4821>`` -> ``1284``."""
    digits = _digit_string(rng, min_digits, max_digits)
    return f"{digits}>", digits[::-1]


def add(rng: random.Random, min_digits: int, max_digits: int) -> tuple[str, str]:
    """``37+485=`` -> ``522`` (operands without leading zeros)."""
    a, b = _number(rng, min_digits, max_digits), _number(rng, min_digits, max_digits)
    return f"{a}+{b}=", str(a + b)


# One digit: a policy trained from scratch finds the copy from the tool's output by chance
# often enough (at 3 digits, seven runs of up to 600 steps never did).
LOOKUP_VALUE_DIGITS = 1


def lookup(rng: random.Random, min_digits: int, max_digits: int) -> tuple[str, str]:
    """``375>`` -> ``4``: a key, and a value nothing in the prompt determines (the tool
    task of ``verlite.envs.lookup``: only the lookup tool's output holds it)."""
    key = _digit_string(rng, min_digits, max_digits)
    return f"{key}>", _digit_string(rng, LOOKUP_VALUE_DIGITS, LOOKUP_VALUE_DIGITS)


# digit_match gives partial credit per position: a dense signal a tiny model can climb.
TASKS: dict[str, Task] = {
    "copy": Task(copy, reward="digit_match"),
    "reverse": Task(reverse, reward="digit_match"),
    "add": Task(add, reward="digit_match"),
    "lookup": Task(lookup, reward="digit_match"),
}
