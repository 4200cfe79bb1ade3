"""The record of a run's metrics, in the two places it is kept: ``metrics.jsonl`` in the output
folder and the marked lines of a job's driver log. This module is their one reader and writer.

A record is one JSON object per step: ``{"step": N, "<metric>": value, ...}`` with plain
floats already reduced over micro-batches, ranks and mini-batches. A step may be written
twice (a run resumed from a checkpoint logs the steps after it again); readers keep the
last record of each step, in step order.

``metrics.jsonl`` is appended to and flushed one line per step, so it can be read while the
run goes: a last line without its newline is a write in progress (or the remains of a
killed run). A writer cuts such a line before appending, a resumed run drops the records
after its checkpoint (:func:`truncate`), and a reader skips it unless it is complete JSON.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from verlite.errors import UserError

FILE_NAME = "metrics.jsonl"
# Prefix of a record in a job's driver log (the ``logline`` logger writes these).
LINE_MARKER = "VERLITE_METRICS "

Record = dict[str, Any]
# Metrics of how a run went rather than what it trained: measured by the clock, or counting
# its restarts. They differ between two runs that trained alike.
RUN_HISTORY_PREFIXES = ("timing_s/", "perf/", "trainer/")


def is_run_history(metric: str) -> bool:
    return metric.startswith(RUN_HISTORY_PREFIXES)


def encode(step: int, metrics: Mapping[str, float]) -> str:
    """One record as a JSON line without its newline (NaN and inf written as such)."""
    return json.dumps({"step": step, **metrics}, allow_nan=True)


def normalize_records(records: Sequence[Mapping[str, Any]]) -> list[Record]:
    """One record per step, in step order; a repeated step keeps its last record."""
    by_step = {int(record["step"]): dict(record) for record in records}
    return [by_step[step] for step in sorted(by_step)]


def _is_record(value: Any) -> bool:
    return isinstance(value, dict) and isinstance(value.get("step"), int)


# ----------------------------------------------------------------------- metrics.jsonl


class MetricsWriter:
    """Appends records to ``metrics.jsonl``, each line flushed so readers see it at once."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        _drop_torn_line(path)
        self.file = path.open("a", encoding="utf-8")

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        self.file.write(encode(step, metrics) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def _drop_torn_line(path: Path) -> None:
    """Cut a last line left without its newline by a killed run: appended to, it would fuse
    with the next record into one unreadable line."""
    if not path.exists() or path.stat().st_size == 0:
        return
    with path.open("rb+") as file:
        file.seek(-1, os.SEEK_END)
        if file.read(1) == b"\n":
            return
        file.seek(0)
        file.truncate(file.read().rfind(b"\n") + 1)


def truncate(output_dir: Path, *, after_step: int) -> None:
    """Drop the records a crashed run logged after its last checkpoint (and any torn or
    unreadable line), so that a resumed run's ``metrics.jsonl`` reads as if it had never
    stopped. The file is replaced atomically."""
    path = output_dir / FILE_NAME
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if _is_record(record) and record["step"] <= after_step:
            kept.append(line)
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


def read(path: str | Path) -> list[Record]:
    """The records of ``metrics.jsonl`` (or of the run folder holding it), one per step in step
    order. A last line without its newline is skipped unless it is complete JSON; any other
    line that is not a record is an error naming the file and line."""
    path = Path(path)
    if path.is_dir():
        path = path / FILE_NAME
    elif not path.exists() and path.suffix != ".jsonl":
        raise UserError(f"no such folder: {str(path)!r}")
    if not path.exists():
        raise UserError(
            f"no metrics file {str(path)!r}: has the run logged a step yet, with 'jsonl' in "
            "trainer.loggers?"
        )
    if not path.is_file():  # a pipe would block, a device such as /dev/zero never end
        raise UserError(
            f"{str(path)!r} is not a regular file; give a run folder or its metrics.jsonl"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise UserError(f"cannot read {str(path)!r}: {exc.strerror}") from None
    lines = text.split("\n")
    torn = lines.pop()  # "" when the file ends with a newline
    records = [_parse_line(line, path, number) for number, line in enumerate(lines, 1) if line]
    if torn:
        with contextlib.suppress(json.JSONDecodeError, UserError):  # still being written
            records.append(_checked(json.loads(torn), path, len(lines) + 1))
    if not records:
        raise UserError(f"{str(path)!r} holds no metrics yet")
    return normalize_records(records)


def _parse_line(line: str, path: Path, number: int) -> Record:
    try:
        value = json.loads(line)
    except json.JSONDecodeError as exc:
        raise UserError(f"{str(path)!r} line {number} is not valid JSON: {exc.msg}") from None
    return _checked(value, path, number)


def _checked(value: Any, path: Path, number: int) -> Record:
    if not _is_record(value):
        raise UserError(f"{str(path)!r} line {number} is not a metrics record with a 'step'")
    return dict(value)


# -------------------------------------------------------------------- marked log lines


def marked_line(step: int, metrics: Mapping[str, float]) -> str:
    """One record as a line of a job's driver log."""
    return LINE_MARKER + encode(step, metrics)


def parse_marked_lines(log: str) -> list[Record]:
    """The records among a driver log's lines, one per step in step order. A marked line that
    is not a whole record is skipped: a running job's log may end mid-line."""
    records = []
    for line in log.splitlines():
        _, marker, payload = line.partition(LINE_MARKER)
        if not marker:
            continue
        try:
            record = json.loads(payload)
        except json.JSONDecodeError:
            continue
        if _is_record(record):
            records.append(record)
    return normalize_records(records)
