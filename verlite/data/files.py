"""Prompt files: JSONL and Parquet readers whose errors name the file and the line (or row).

Each row needs a string prompt field and a string or integer answer field (``data.prompt_key``
and ``data.answer_key``, by default ``prompt`` and ``answer``; an integer is read as its
digits), the prompt not blank (an empty answer is allowed: a task may expect no output);
other fields are ignored, and a Parquet file's other columns are not read. The answer is
taken from its field by ``data.answer_rule`` (:mod:`verlite.data.answers`). Parquet support
imports ``pyarrow`` only when a Parquet file is read.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypedDict

from verlite.data.answers import ANSWER_RULES
from verlite.errors import UserError, import_extra, shown
from verlite.user_files import parse_json, read_text


class DataError(UserError):
    """A problem with the prompts a user can fix: the message names the file and line, or the setting."""


class PromptRecord(TypedDict):
    prompt: str
    answer: str


def read_prompt_file(
    path: str | Path,
    *,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    answer_rule: str = "as_is",
) -> tuple[list[PromptRecord], list[str]]:
    """The records of a ``.jsonl`` or ``.parquet`` file and, for each, where it is
    (``file:line``): each row's ``prompt_key`` field, and the answer ``answer_rule`` takes from
    its ``answer_key`` field."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        rows = _jsonl_rows(path)
    elif suffix == ".parquet":
        rows = _parquet_rows(path, {prompt_key: "prompt_key", answer_key: "answer_key"})
    else:
        raise DataError(
            f"{path}: unknown prompt file format {suffix!r}; expected .jsonl or .parquet"
        )
    records: list[PromptRecord] = []
    where: list[str] = []
    for location, row in rows:
        records.append(_record(location, row, prompt_key, answer_key, answer_rule))
        where.append(location)
    if not records:
        raise DataError(f"{path}: no prompts (the file is empty)")
    return records, where


def _record(
    location: str, row: Any, prompt_key: str, answer_key: str, answer_rule: str
) -> PromptRecord:
    if not isinstance(row, dict):
        raise DataError(
            f"{location}: expected an object with {prompt_key!r} and {answer_key!r} fields, "
            f"got {type(row).__name__}"
        )
    texts = []
    for key, setting in ((prompt_key, "prompt_key"), (answer_key, "answer_key")):
        if key not in row:
            raise DataError(
                f"{location}: missing field {key!r} (data.{setting}); the row has "
                f"{shown(sorted(map(str, row)), 80)}"
            )
        value = row[key]
        if setting == "answer_key" and type(value) is int:
            value = str(value)  # an integer answer (AIME's, an int column): its digits
        if not isinstance(value, str):
            raise DataError(
                f"{location}: field {key!r} (data.{setting}) must be a string"
                f"{'' if setting == 'prompt_key' else ' or an integer'}, got "
                f"{_wrong_type(value, prompt=setting == 'prompt_key')}"
            )
        _check_unicode(location, key, value)
        texts.append(value)
    prompt, answer_field = texts
    if not prompt.strip():
        # The policy would answer nothing but the begin-of-sequence token.
        raise DataError(f"{location}: the prompt is empty")
    extract, wanted = ANSWER_RULES[answer_rule]
    answer = extract(answer_field)
    if answer is None:
        raise DataError(
            f"{location}: data.answer_rule={answer_rule} finds no answer in field "
            f"{answer_key!r} (it needs {wanted}): {shown(answer_field, 80)}"
        )
    return PromptRecord(prompt=prompt, answer=answer)


def _wrong_type(value: Any, *, prompt: bool) -> str:
    """What a row field holds instead of a string, as a message says it. A prompt that is a
    list of chat messages (verl's files store ``[{"role": "user", "content": ...}]``) says
    how verlite reads one."""
    if value is None:
        return "null"
    if isinstance(value, float) and not prompt:
        # An int column with a missing value is stored as floats: 72.0, which exact_match
        # would compare as "72.0".
        return f"float {value!r}; store answers as text or integers"
    if (
        prompt
        and isinstance(value, list)
        and value
        and all(isinstance(m, dict) and {"role", "content"} <= m.keys() for m in value)
    ):
        return (
            f"a list of chat messages {shown(value, 80)}; store the user turn's text in it (a "
            "system turn in data.system_prompt) and set data.chat_template=true, which renders "
            "it in the model's chat template"
        )
    return f"{type(value).__name__} {shown(value, 80)}"


def _check_unicode(location: str, key: str, value: str) -> None:
    """A JSON string may escape half of a UTF-16 surrogate pair (``"\\ud800"``), which is
    no character: the tokenizer would raise a TypeError on it at the first batch."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise DataError(
            f"{location}: field {key!r} holds {value[exc.start]!r} at character {exc.start}, "
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


def _parquet_rows(path: Path, columns: dict[str, str]) -> Iterable[tuple[str, Any]]:
    """The rows of ``columns`` (each column's name, and the setting that names it) alone: a
    dataset's file may hold columns the run never reads (images, long solutions), which
    reading the whole table would load into memory. A missing column is named once, for the
    file, with the columns it has. Without pyarrow, the install command names verlite's
    'parquet' extra and its pin, as every optional package's does."""
    import_extra("pyarrow", feature=f"{path}: reading Parquet files", extra="parquet")
    import pyarrow
    import pyarrow.parquet

    try:
        names = pyarrow.parquet.read_schema(path).names
        for name, setting in columns.items():
            if name not in names:
                raise DataError(
                    f"{path}: missing column {name!r} (data.{setting}); the file has "
                    f"{shown(sorted(names), 80)}"
                )
        table = pyarrow.parquet.read_table(path, columns=list(columns))
    except (OSError, pyarrow.ArrowException) as exc:
        # Arrow's message may span lines (a schema that names a column twice lists it).
        reason = " ".join(str(exc).split())
        raise DataError(f"{path}: cannot read Parquet file: {shown(reason, 200, str)}") from None
    for number, row in enumerate(table.to_pylist(), start=1):
        yield f"{path} row {number}", row
