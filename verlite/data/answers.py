"""Answer rules (``data.answer_rule``): how a prompt file's answer field gives the answer a
reward compares with, as GSM8K and MATH write them."""

from __future__ import annotations

from collections.abc import Callable

GSM8K_MARK = "####"
BOXED = "\\boxed{"


def gsm8k_answer(text: str) -> str | None:
    """The text after the last ``####``, commas removed, stripped (GSM8K's ``... #### 1,234``
    gives ``1234``); None when there is no ``####`` or nothing after it."""
    if GSM8K_MARK not in text:
        return None
    return text.rsplit(GSM8K_MARK, 1)[1].replace(",", "").strip() or None


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}``, its braces balanced (``\\boxed{\\frac{1}{2}}``
    gives ``\\frac{1}{2}``), stripped; None when there is none, it is not closed, or it is
    empty."""
    start = text.rfind(BOXED)
    if start < 0:
        return None
    depth = 1
    begin = start + len(BOXED)
    for end in range(begin, len(text)):
        if text[end] == "{":
            depth += 1
        elif text[end] == "}":
            depth -= 1
            if depth == 0:
                return text[begin:end].strip() or None
    return None


def _as_is(text: str) -> str:
    return text


# Each rule, and what a message says it looked for when it found nothing.
ANSWER_RULES: dict[str, tuple[Callable[[str], str | None], str]] = {
    "as_is": (_as_is, ""),
    "gsm8k": (gsm8k_answer, "text after a last '####'"),
    "boxed": (last_boxed, "a closed, non-empty \\boxed{...}"),
}
