"""Types of the commands' flag values: a bad value is one line, which argparse prefixes with
the flag (``argument --steps: expected a positive integer, got '0'``)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import TypeVar

from verlite.errors import shown

T = TypeVar("T", int, float)


def _number(text: str, parse: Callable[[str], T], ok: Callable[[T], bool], expected: str) -> T:
    """``text`` as ``parse`` reads it, if ``ok``; else one line: ``expected ..., got 'text'``."""
    try:
        value = parse(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {shown(text)}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {shown(text)}")
    return value


def positive_int(text: str) -> int:
    return _number(text, int, lambda v: v >= 1, "a positive integer")


def int_from_to(minimum: int, maximum: int) -> Callable[[str], int]:
    """An integer from ``minimum`` to ``maximum`` (a flag whose larger values would run or
    allocate without bound): a flag's whole range in its type, so that every value outside
    it is refused in the same words."""

    def parse(text: str) -> int:
        return _number(
            text, int, lambda v: minimum <= v <= maximum, f"an integer from {minimum} to {maximum}"
        )

    return parse


def non_negative_int(text: str) -> int:
    return _number(text, int, lambda v: v >= 0, "an integer of 0 or more")


def non_negative_float(text: str) -> float:
    return _number(text, float, lambda v: 0 <= v < math.inf, "a finite number of 0 or more")


def positive_float(text: str) -> float:
    return _number(text, float, lambda v: 0 < v < math.inf, "a positive finite number")


def int_list(text: str) -> list[int]:
    """Comma-separated positive integers."""
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {shown(text)}"
        ) from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {shown(text)}")
    return values


def str_list(text: str) -> list[str]:
    """Comma-separated names (checked by the command that knows the allowed ones)."""
    return [v for v in text.split(",") if v]


def path(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("expected a path, got an empty string")
    return text
