"""Answer rules (``data.answer_rule``): how a prompt file's answer field gives the answer a
reward compares with, as GSM8K and MATH write them."""

from __future__ import annotations

import re
from collections.abc import Callable

GSM8K_MARK = "####"
# A \boxed opening brace, an escaped brace (not structure), a brace.
_BRACES = re.compile(r"\\boxed\s*\{|\\[{}]|[{}]")


def gsm8k_answer(text: str) -> str | None:
    """The text after the last ``####``, commas removed, stripped (GSM8K's ``... #### 1,234``
    gives ``1234``); None when there is no ``####`` or nothing after it."""
    if GSM8K_MARK not in text:
        return None
    return text.rsplit(GSM8K_MARK, 1)[1].replace(",", "").strip() or None


def last_boxed(text: str, *, complete: bool = True) -> str | None:
    """The content of the last ``\\boxed{...}`` to close, its braces balanced (``\\boxed{\\frac{1}{2}}``
    gives ``\\frac{1}{2}``; escaped ``\\{`` and ``\\}`` are no braces; an outer box holds an
    inner one), stripped; None when there is none or it is empty. ``complete``: None too
    when a box is left open (an answer field must be whole); otherwise a box left open, as in
    a response cut at its length limit, is passed over. One pass: a megabyte of braces is
    linear."""
    boxed: str | None = None
    opened: list[tuple[bool, int]] = []  # (a \boxed brace?, where its content starts)
    for match in _BRACES.finditer(text):
        token = match.group()
        if token.startswith("\\boxed"):
            opened.append((True, match.end()))
        elif token == "{":
            opened.append((False, match.end()))
        elif token == "}" and opened:
            is_boxed, start = opened.pop()
            if is_boxed:
                boxed = text[start : match.start()]
    if complete and any(is_boxed for is_boxed, _ in opened):
        return None
    return None if boxed is None else boxed.strip() or None


def _as_is(text: str) -> str:
    return text


# Each rule, and what a message says it looked for when it found nothing.
ANSWER_RULES: dict[str, tuple[Callable[[str], str | None], str]] = {
    "as_is": (_as_is, ""),
    "gsm8k": (gsm8k_answer, "text after a last '####'"),
    "boxed": (last_boxed, "a closed, non-empty \\boxed{...}"),
}
