"""Prompt files: JSONL and Parquet readers whose errors name the file and the line (or row).

Each row needs a prompt field and a string or integer answer field (``data.prompt_key`` and
``data.answer_key``, by default ``prompt`` and ``answer``; an integer is read as its digits).
The prompt is text, or a conversation as verl's files store it (a list of ``{"role": ...,
"content": ...}`` messages, the last not the assistant's), which only a chat template renders
(:mod:`verlite.data.templates`); it may not be blank (an empty answer is allowed: a task may
expect no output). A key with dots names a field inside fields when the row has no field of
that name (verl's ``reward_model.ground_truth``). Other fields are ignored, and a Parquet
file's other columns are not read. The answer is taken from its field by
``data.answer_rule`` (:mod:`verlite.data.answers`). Parquet support imports ``pyarrow`` only
when a Parquet file is read.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, NotRequired, TypedDict

from typing_extensions import ReadOnly

from verlite.data.answers import ANSWER_RULES
from verlite.errors import UserError, import_extra, one_line, shown
from verlite.user_files import parse_json, read_text


class DataError(UserError):
    """A problem with the prompts a user can fix: the message names the file and line, or the setting."""


class Message(TypedDict):
    role: str
    content: str


Conversation = tuple[Message, ...]


def conversation_of(prompt: str | Conversation) -> Conversation:
    """A prompt as the messages a chat template renders: a text prompt is the user's turn."""
    return (Message(role="user", content=prompt),) if isinstance(prompt, str) else prompt


class PromptRecord(TypedDict):
    """A prompt as the policy reads it (rendered, when it was a conversation) and its answer;
    with ``data.chat_template``, the ``messages`` the template rendered into the prompt."""

    prompt: str
    answer: str
    messages: NotRequired[Conversation]


def record_conversation(record: PromptRecord) -> Conversation:
    """The conversation a record's prompt holds, as the policy read it: the messages its chat
    template rendered (``data.system_prompt``'s turn, ``data.prompt_suffix`` included), or
    without one its prompt text, suffix included, as the user's turn."""
    return record.get("messages") or conversation_of(record["prompt"])


class SourceRecord(TypedDict):
    """A prompt as its source holds it (a file's row: text or a conversation; a task's: text),
    before the chat template and the suffix; a :class:`PromptRecord` is one too."""

    prompt: ReadOnly[str | Conversation]
    answer: str


def read_prompt_file(
    path: str | Path,
    *,
    setting: str = "data.train_file",
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    answer_rule: str = "as_is",
) -> tuple[list[SourceRecord], list[str]]:
    """The records of a ``.jsonl`` or ``.parquet`` file and, for each, where it is
    (``file:line``): each row's ``prompt_key`` field, and the answer ``answer_rule`` takes from
    its ``answer_key`` field. The file's own errors name it as ``setting`` (the config field
    that gave it); a row's, by its ``file:line``."""
    path = Path(path)
    named = f"{setting}={shown(str(path))}"
    suffix = path.suffix.lower()
    keys = {"prompt_key": prompt_key, "answer_key": answer_key}
    if suffix == ".jsonl":
        rows = _jsonl_rows(path)
    elif suffix == ".parquet":
        rows = _parquet_rows(path, keys)
    else:
        raise DataError(
            f"{named}: unknown prompt file format {shown(suffix)}; give a .jsonl or .parquet file"
        )
    records: list[SourceRecord] = []
    where: list[str] = []
    for location, row in rows:
        if not isinstance(row, dict):
            raise DataError(
                f"{location}: expected an object with {prompt_key!r} and {answer_key!r} "
                f"fields, got {type(row).__name__}"
            )
        prompt = _prompt(location, prompt_key, _field(location, row, prompt_key, "prompt_key"))
        answer = _answer(
            location, answer_key, answer_rule, _field(location, row, answer_key, "answer_key")
        )
        records.append(SourceRecord(prompt=prompt, answer=answer))
        where.append(location)
    if not records:
        raise DataError(f"{named}: no prompts (the file is empty)")
    return records, where


def _field(location: str, row: dict[str, Any], key: str, setting: str) -> Any:
    """The row's field ``key``; without one, a dotted key's field inside fields
    (``reward_model.ground_truth``). Missing: a :class:`DataError` naming the key, its setting
    and what the row (or the field the key's parts stopped at) has."""
    if key in row:
        return row[key]
    value: Any = row
    parts = key.split(".")
    for depth, part in enumerate(parts):
        if not isinstance(value, dict) or part not in value:
            has = (
                f"{shown(sorted(map(str, value)), 80)}"
                if isinstance(value, dict)
                else f"no fields ({_wrong_type(value)})"
            )
            inside = f"its field {'.'.join(parts[:depth])!r}" if depth else "the row"
            raise DataError(
                f"{location}: missing field {key!r} (data.{setting}); {inside} has {has}"
            )
        value = value[part]
    return value


def _prompt(location: str, key: str, value: Any) -> str | Conversation:
    """A prompt field: text, or a conversation of role and content messages that does not
    end with the assistant's turn (the policy writes that one); not blank either way."""
    field = f"field {key!r} (data.prompt_key)"
    if isinstance(value, str):
        _check_unicode(f"{location}: field {key!r}", value)
        if not value.strip():
            # The policy would answer nothing but the begin-of-sequence token.
            raise DataError(f"{location}: the prompt is empty")
        return value
    if not isinstance(value, list) or not value:
        raise DataError(
            f"{location}: {field} must be a string or a list of chat messages "
            f'([{{"role": "user", "content": ...}}]), got {_wrong_type(value)}'
        )
    messages = []
    for number, message in enumerate(value, start=1):
        where = f"{location}: message {number} of {field}"
        if not isinstance(message, dict):
            raise DataError(f"{where} must be an object, got {_wrong_type(message)}")
        for name in ("role", "content"):  # both are written into the template's text
            if not isinstance(message.get(name), str) or (name == "role" and not message[name]):
                raise DataError(
                    f"{where} needs a {'non-empty ' if name == 'role' else ''}string {name!r}, "
                    f"got {_wrong_type(message.get(name))}"
                )
            _check_unicode(f"{location}: the {name} of message {number} of {field}", message[name])
        # A Parquet column of messages has every field any message has: None where unset.
        if other := sorted(
            k for k, v in message.items() if k not in Message.__required_keys__ and v is not None
        ):
            raise DataError(
                f"{where} has {shown(other, 60)}, which verlite does not render; a message "
                "holds a role and its content"
            )
        messages.append(Message(role=message["role"], content=message["content"]))
    if messages[-1]["role"] == "assistant":
        raise DataError(
            f"{location}: {field} ends with an assistant turn; the policy's response is that "
            "turn: end the conversation with the turn it answers"
        )
    if not any(m["content"].strip() for m in messages):
        raise DataError(f"{location}: the prompt is empty (every message's content is blank)")
    return tuple(messages)


def _answer(location: str, key: str, rule: str, value: Any) -> str:
    if type(value) is int:
        value = str(value)  # an integer answer (AIME's, an int column): its digits
    if not isinstance(value, str):
        # An int column with a missing value is stored as floats: 72.0, which exact_match
        # would compare as "72.0".
        hint = "; store answers as text or integers" if isinstance(value, float) else ""
        raise DataError(
            f"{location}: field {key!r} (data.answer_key) must be a string or an integer, got "
            f"{_wrong_type(value)}{hint}"
        )
    _check_unicode(f"{location}: field {key!r}", value)
    extract, wanted = ANSWER_RULES[rule]
    answer = extract(value)
    if answer is None:
        raise DataError(
            f"{location}: data.answer_rule={rule} finds no answer in field "
            f"{key!r} (it needs {wanted}): {shown(value, 80)}"
        )
    return answer


def _wrong_type(value: Any) -> str:
    """What a row field holds instead of what it must, as a message says it."""
    return "null" if value is None else f"{type(value).__name__} {shown(value, 80)}"


def _check_unicode(what: str, value: str) -> None:
    """A JSON string may escape half of a UTF-16 surrogate pair (``"\\ud800"``), which is
    no character: the tokenizer would raise a TypeError on it at the first batch. ``what``
    says where the string is, its file and row first (``file:3: field 'prompt'``)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise DataError(
            f"{what} holds {value[exc.start]!r} at character {exc.start}, "
            "half of a UTF-16 surrogate pair, which is no text; escape whole characters only"
        ) from None


def _jsonl_rows(path: Path) -> Iterable[tuple[str, Any]]:
    # split("\n"), not splitlines(): JSON strings may hold U+2028 and friends, which
    # splitlines() would treat as line breaks and so misnumber every following line.
    for number, line in enumerate(
        read_text(path, what="prompt file", error=DataError).split("\n"), start=1
    ):
        if not line.strip():
            continue
        location = f"{path}:{number}"
        yield location, parse_json(line, location, error=DataError)


def _parquet_rows(path: Path, keys: dict[str, str]) -> Iterable[tuple[str, Any]]:
    """The rows of the columns ``keys`` (each setting's key) name alone: a dataset's file may
    hold columns the run never reads (images, long solutions), which reading the whole table
    would load into memory. A dotted key that is no column's name reads the column of its
    first part (``reward_model`` for ``reward_model.ground_truth``). A missing column is named
    once, for the file, with the columns it has. Without pyarrow, the install command names
    verlite's 'parquet' extra and its pin, as every optional package's does."""
    import_extra("pyarrow", feature=f"{path}: reading Parquet files", extra="parquet")
    import pyarrow
    import pyarrow.parquet

    try:
        names = pyarrow.parquet.read_schema(path).names
        columns = []
        for setting, key in keys.items():
            column = key if key in names else key.split(".")[0]
            if column not in names:
                raise DataError(
                    f"{path}: missing column {key!r} (data.{setting}); the file has "
                    f"{shown(sorted(names), 80)}"
                )
            columns.append(column)
        table = pyarrow.parquet.read_table(path, columns=list(dict.fromkeys(columns)))
    except (OSError, pyarrow.ArrowException) as exc:
        # Arrow's message may span lines (a schema that names a column twice lists it).
        reason = shown(one_line(exc), 200, str)
        raise DataError(f"{path}: cannot read Parquet file: {reason}") from None
    for number, row in enumerate(table.to_pylist(), start=1):
        yield f"{path} row {number}", row
