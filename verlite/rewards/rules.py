"""Built-in rule-based rewards: ``fn(response, answer, prompt) -> float`` in [0, 1].

Responses arrive decoded up to EOS, other special tokens shown as text
(``data.tokenizer.response_text``); leading and trailing whitespace never counts against
them.
"""

from __future__ import annotations

import re
from decimal import Decimal

from verlite.data.answers import GSM8K_MARK
from verlite.errors import shown
from verlite.rewards.answer_reward import AnswerReward

# A number as GSM8K writes final answers: optional $, sign, thousands commas, decimals.
# The whitespace after a $ belongs to the $: with two optional runs of whitespace side by
# side, a response of whitespace after its "####" took quadratic time to fail (25 s for
# 32,000 characters, a few thousand tokens a degenerate policy may write).
_NUMBER = re.compile(r"\s*(?:\$\s*)?(-?[\d,]*\.?\d+)")


def exact_match(response: str, answer: str, prompt: str) -> float:
    """1 when the response is the answer (whitespace-stripped), else 0."""
    return float(response.strip() == answer.strip())


class Gsm8kReward(AnswerReward):
    """1 when the number after the response's last ``####`` equals the answer's number.

    The answer is ``"42"`` or ends in ``"#### 42"``; commas are dropped and values compare
    as decimals, so ``1,234`` matches ``1234`` and ``42.0`` matches ``42``. A response
    without ``####``, or without a number after its last, has no answer: it scores 0 and is
    counted (``reward/gsm8k/no_answer``, :mod:`verlite.rewards.answer_reward`).
    """

    name = "gsm8k"

    def __call__(self, response: str, answer: str, prompt: str) -> float:
        expected = gsm8k_reference(answer)
        found = None
        if GSM8K_MARK in response:
            found = _leading_number(response.rsplit(GSM8K_MARK, 1)[1])
        if found is None:
            self.count("no_answer")
            return 0.0
        return float(found == expected)

    def check_reference(self, answer: str) -> None:
        gsm8k_reference(answer)


# The registry's (REWARDS["gsm8k"]); a run builds its own, which counts its responses alone.
gsm8k = Gsm8kReward()


def gsm8k_reference(answer: str) -> Decimal:
    """The number :func:`gsm8k` compares with: the answer's, or what follows its last
    ``####``; a ValueError when it holds none."""
    expected = _leading_number(answer.rsplit(GSM8K_MARK, 1)[-1])
    if expected is None:
        raise ValueError(f"gsm8k reward: the answer {shown(answer, 80)} holds no number")
    return expected


def _leading_number(text: str) -> Decimal | None:
    match = _NUMBER.match(text)
    return Decimal(match.group(1).replace(",", "")) if match else None


def digit_match(response: str, answer: str, prompt: str) -> float:
    """Partial credit: half for the right length, half for the answer's characters in place.

    Only an exact match scores 1. The length half is what teaches a model trained from
    scratch to end its response: a response of the right length is rewarded even while its
    digits are still wrong, so stopping at the right place is found and kept early, instead
    of being drowned by the per-digit signal.
    """
    response, answer = response.strip(), answer.strip()
    if response == answer:
        return 1.0
    agree = sum(r == a for r, a in zip(response, answer, strict=False))
    return 0.5 * agree / max(len(answer), 1) + 0.5 * (len(response) == len(answer))
