"""The built-in tool task: a key-value lookup whose answer only a tool's output holds.

The prompt (``data.task=lookup``) is a key, ``375>``; the answer is a random digit that
nothing in the prompt determines. The policy may call the lookup tool by writing the
key (or nothing: the prompt's key) and the turn's stop text, ``375+`` or ``+``: the tool
answers ``=4`` (the value of that key, or ``=`` alone for a key it does not hold). A
turn that does not end with the stop text is the policy's answer, and ends the
trajectory. The tool reads the key off the prompt as the task wrote it (the conversation's
last turn, up to its ``>``), not off the record's prompt as the policy reads it, which the
chat template renders (``data.chat_template``) or ``data.prompt_suffix`` ends. The score:
``LOOKUP_CREDIT`` for having found the value with the tool, plus the rest times
:func:`digits_in_place` of the answer against the value (partial credit per position, none
for the length alone); 1 only for looking the value up and answering it.
Without the tool (``lookup_without_tool``, whose tool knows no key) the policy can only
guess: a tenth of the digits, 0.08 of the score, on average.
"""

from __future__ import annotations

from verlite.data.files import PromptRecord, record_conversation
from verlite.envs.base import Turn

CALL = "+"  # the text that ends a tool call: rollout.multi_turn.turn_stop
REPLY = "="  # what the tool's output starts with
LOOKUP_CREDIT = 0.2  # of the score, for a call that found the value


def digits_in_place(answer: str, value: str) -> float:
    """The characters of ``answer`` that match ``value`` in place, over the longer of the
    two: 1 only for the value itself."""
    answer = answer.strip()
    agree = sum(a == v for a, v in zip(answer, value, strict=False))
    return agree / max(len(answer), len(value), 1)


class Lookup:
    """One trajectory of the lookup task: a tool that holds the prompt's key."""

    knows_keys = True

    def reset(self, record: PromptRecord) -> None:
        # The task's prompt is the conversation's last turn, ahead of any suffix.
        self.key = record_conversation(record)[-1]["content"].partition(">")[0]
        self.value = record["answer"]
        self.looked_up = False

    def step(self, action: str) -> Turn:
        if action.endswith(CALL):
            found = self.knows_keys and action[: -len(CALL)] in ("", self.key)
            self.looked_up |= found
            return Turn(REPLY + (self.value if found else ""), self._reward(""), done=False)
        return Turn("", self._reward(action), done=True)

    def _reward(self, answer: str) -> float:
        """Most of the credit for the answer's digits, a little for having looked the
        value up (what a policy trained from scratch finds first)."""
        return LOOKUP_CREDIT * self.looked_up + (1 - LOOKUP_CREDIT) * digits_in_place(
            answer, self.value
        )


class LookupWithoutTool(Lookup):
    """The same task with a tool that knows no key: the control that shows the tool is needed."""

    knows_keys = False
