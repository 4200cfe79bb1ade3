"""Prompt files: JSONL and Parquet readers whose errors name the file and the line (or row).

Each record needs string ``prompt`` and ``answer`` fields, the prompt not blank (an empty
answer is allowed: a task may expect no output); other fields are ignored.
Parquet support imports ``pyarrow`` only when a Parquet file is read.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypedDict

from verlite.errors import UserError
from verlite.user_files import parse_json, read_text


class DataError(UserError):
    """A problem with the prompts a user can fix: the message names the file and line, or the setting."""


class PromptRecord(TypedDict):
    prompt: str
    answer: str


FIELDS = ("prompt", "answer")


def read_prompt_file(path: str | Path) -> tuple[list[PromptRecord], list[str]]:
    """The records of a ``.jsonl`` or ``.parquet`` file and, for each, where it is (``file:line``)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        rows = _jsonl_rows(path)
    elif suffix == ".parquet":
        rows = _parquet_rows(path)
    else:
        raise DataError(
            f"{path}: unknown prompt file format {suffix!r}; expected .jsonl or .parquet"
        )
    records: list[PromptRecord] = []
    where: list[str] = []
    for location, row in rows:
        records.append(_record(location, row))
        where.append(location)
    if not records:
        raise DataError(f"{path}: no prompts (the file is empty)")
    return records, where


def _record(location: str, row: Any) -> PromptRecord:
    if not isinstance(row, dict):
        raise DataError(
            f"{location}: expected an object with 'prompt' and 'answer' fields, got {type(row).__name__}"
        )
    for field in FIELDS:
        if field not in row:
            raise DataError(f"{location}: missing field {field!r}")
        value = row[field]
        if not isinstance(value, str):
            raise DataError(
                f"{location}: field {field!r} must be a string, got {type(value).__name__} {value!r}"
            )
    if not row["prompt"].strip():
        # The policy would answer nothing but the begin-of-sequence token.
        raise DataError(f"{location}: the prompt is empty")
    return PromptRecord(prompt=row["prompt"], answer=row["answer"])


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


def _parquet_rows(path: Path) -> Iterable[tuple[str, Any]]:
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise DataError(
            f"{path}: reading Parquet files needs pyarrow, which is not installed: pip install pyarrow"
        ) from None
    try:
        table = pyarrow.parquet.read_table(path)
    except (OSError, pyarrow.ArrowException) as exc:
        raise DataError(f"{path}: cannot read Parquet file: {exc}") from None
    for number, row in enumerate(table.to_pylist(), start=1):
        yield f"{path} row {number}", row
