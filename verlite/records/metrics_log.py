"""The record of a run's metrics, in the two places it is kept: ``metrics.jsonl`` in the output
folder and the marked lines of a job's driver log. This module is their one reader and writer.

A record is one JSON object per step: ``{"step": N, "<metric>": value, ...}`` with plain
numbers already reduced over micro-batches, ranks and mini-batches. A run starts (fresh,
resumed or restarted) after some step S and logs S+1, S+2, ...: in ``metrics.jsonl`` it first
drops the records after S (:func:`truncate`), in a job's log it writes a start line that tells
readers to do the same (:func:`start_line`). So steps only increase, and a reader refuses a
step that does not (two runs in one file, a line printed by user code): a record never
silently replaces another.

``metrics.jsonl`` is appended to and flushed one line per step, so it can be read while the
run goes: a last line without its newline is a write in progress (or the remains of a
killed run). A writer cuts such a line before appending, and a reader skips it unless it is
complete JSON. A job's log is read the same way; a marker counts only at a line's start.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from verlite.errors import UserError, shown
from verlite.user_files import parse_json, read_text, resolved_path

FILE_NAME = "metrics.jsonl"
# Prefixes of a job's driver log lines the ``logline`` logger writes: a record, and the step
# a run (re)starts after.
LINE_MARKER = "VERLITE_METRICS "
START_MARKER = "VERLITE_METRICS_START_AFTER "

Record = dict[str, Any]
# Metrics of how a run went rather than what it trained: measured by the clock, or counting
# its restarts. They differ between two runs that trained alike.
RUN_HISTORY_PREFIXES = ("timing_s/", "perf/", "trainer/")


def is_run_history(metric: str) -> bool:
    """Whether ``metric`` is of the run's history, validation's own included: the trainer logs
    what validation measured under ``val/`` (a reward model's peak memory while it scored the
    validation batch: ``val/perf/max_memory_allocated_gb/reward_model``)."""
    return metric.removeprefix("val/").startswith(RUN_HISTORY_PREFIXES)


def encode(step: int, metrics: Mapping[str, float]) -> str:
    """One record as a JSON line without its newline (NaN and inf written as such)."""
    return json.dumps({"step": step, **metrics}, allow_nan=True)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _fits_a_float(number: float) -> bool:
    """Whether ``number`` converts to a float (a JSON integer may have any number of digits)."""
    try:
        float(number)
    except OverflowError:
        return False
    return True


def _step_of(value: Any) -> int | None:
    """The step of a record (a whole number >= 0; true is no step), or None."""
    step = value.get("step") if isinstance(value, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None


def _checked(value: Any, where: str) -> Record:
    """``value`` as a record, or one line naming ``where`` it is and what is wrong."""
    if _step_of(value) is None:
        got = shown(value.get("step")) if isinstance(value, dict) and "step" in value else "none"
        raise UserError(
            f"{where} is not a metrics record: its 'step' must be a whole number >= 0 (got {got})"
        )
    for metric, number in value.items():
        if metric == "step":
            continue
        if not _is_number(number):
            raise UserError(
                f"{where}: metric {shown(metric)} is {shown(number)}; expected a number"
            )
        if not _fits_a_float(number):  # every reader computes in floats
            raise UserError(
                f"{where}: metric {shown(metric)} is an integer of {len(str(abs(number)))} digits, "
                "beyond a float's range"
            )
    return dict(value)


def _in_order(records: Iterable[tuple[str, Record]]) -> list[Record]:
    """The records, each with its place (``where``), checked to go up a step at a time or
    more: a repeated or earlier step is an error naming both places."""
    kept: list[Record] = []
    last = ""
    for where, record in records:
        if kept and record["step"] <= kept[-1]["step"]:
            raise UserError(
                f"{where} logs step {record['step']} after step {kept[-1]['step']} ({last}): "
                "steps only increase in one run's record; does it hold more than one run, or "
                "lines written by something else?"
            )
        kept.append(record)
        last = where
    return kept


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
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            step = _step_of(json.loads(line))
        except ValueError:  # not JSON, or an integer past the digits Python reads
            continue
        if step is not None and step <= after_step:
            kept.append(line)
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    os.replace(tmp, path)


def read(path: str | Path) -> list[Record]:
    """The records of ``metrics.jsonl`` (or of the run folder holding it), one per step in
    step order. A last line without its newline is skipped unless it is complete JSON; any
    other line that is not a record, a metric that is not a number and a step that does not
    increase are errors naming the file and line."""
    if not isinstance(path, str | os.PathLike):
        raise UserError(
            f"run={shown(path)}: expected a run folder or its metrics.jsonl (a str or Path), "
            f"got a {type(path).__name__}"
        )
    path = Path(path)
    if path.is_dir():
        path = path / FILE_NAME
    # a link loop on the way is one line that says so, not a missing folder or file
    resolved_path(path, shown(str(path)))
    if not path.exists() and path.suffix != ".jsonl":
        raise UserError(f"no such folder: {shown(str(path))}")
    if not path.exists():
        raise UserError(
            f"no metrics file {shown(str(path))}: has the run logged a step yet, with 'jsonl' in "
            "trainer.loggers?"
        )
    if not path.is_file():  # a pipe would block, a device such as /dev/zero never end
        raise UserError(
            f"{shown(str(path))} is not a regular file; give a run folder or its metrics.jsonl"
        )
    lines = read_text(path, what="metrics file").split("\n")
    records = []
    for number, line in enumerate(lines, 1):
        place = f"{shown(str(path))} line {number}"
        if line and (record := _record_of(line, place, last=number == len(lines))):
            records.append((place, record))
    if not records:
        raise UserError(f"{shown(str(path))} holds no metrics yet")
    return _in_order(records)


def _record_of(text: str, place: str, *, last: bool) -> Record | None:
    """The record in one line's JSON ``text`` (``place`` says where it is). The last line,
    when it is not empty, is still being written: None unless it is complete."""
    try:
        value = parse_json(text, place)
    except UserError:
        if last:
            return None
        raise
    return _checked(value, place)


# -------------------------------------------------------------------- marked log lines


def marked_line(step: int, metrics: Mapping[str, float]) -> str:
    """One record as a line of a job's driver log."""
    return LINE_MARKER + encode(step, metrics)


def start_line(after_step: int) -> str:
    """The line of a job's driver log that says a run starts after ``after_step``: what an
    earlier attempt logged after it is dropped, as :func:`truncate` drops it from a file."""
    return f"{START_MARKER}{after_step}"


def parse_marked_lines(log: str, *, source: str = "the job's log") -> list[Record]:
    """The records among a driver log's lines (``source`` names the log in messages), one per
    step in step order. Only lines that start with a marker count; a marked line that is not
    a record is an error unless it is the last line, which a running job may not have
    finished writing."""
    lines = log.split("\n")
    records: list[tuple[str, Record]] = []
    for number, line in enumerate(lines, 1):
        place = f"{source} line {number}"
        if line.startswith(START_MARKER):
            after = line.removeprefix(START_MARKER)
            if not after.isdigit():
                raise UserError(f"{place} is not a start line: {shown(line)}")
            records = [(where, record) for where, record in records if record["step"] <= int(after)]
        elif line.startswith(LINE_MARKER):
            text = line.removeprefix(LINE_MARKER)
            if record := _record_of(text, place, last=number == len(lines)):
                records.append((place, record))
    return _in_order(records)
