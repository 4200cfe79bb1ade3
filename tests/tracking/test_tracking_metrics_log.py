"""The metrics record format (:mod:`verlite.metrics_log`): marked log lines, and a resumed
run's ``metrics.jsonl`` cut back to its checkpoint."""

import json
import os
from pathlib import Path

import pytest

from verlite import metrics_log
from verlite.errors import UserError


def test_marked_lines_are_one_record_per_step_the_latest_line_winning() -> None:
    log = "\n".join(
        [
            "placed 2 workers",
            'VERLITE_METRICS {"step": 2, "critic/score/mean": 0.5}',
            '(driver) VERLITE_METRICS {"step": 1, "critic/score/mean": 0.1}',
            'VERLITE_METRICS {"step": 2, "critic/score/mean": 0.7}',
            'VERLITE_METRICS {"step": 3, "critic/sco',  # still being written
            "VERLITE_METRICS [1, 2]",
        ]
    )
    assert metrics_log.parse_marked_lines(log) == [
        {"step": 1, "critic/score/mean": 0.1},
        {"step": 2, "critic/score/mean": 0.7},
    ]


def test_truncate_keeps_the_records_up_to_the_checkpoint_and_drops_torn_lines(
    tmp_path: Path,
) -> None:
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "a": float(s)}) for s in (1, 2, 3, 4)]
    path.write_text("\n".join([*lines[:2], "not json", *lines[2:]]) + '\n{"step": 5, "a"')
    metrics_log.truncate(tmp_path, after_step=3)
    assert path.read_text().splitlines() == lines[:3]
    assert [r["step"] for r in metrics_log.read(tmp_path)] == [1, 2, 3]


def test_writer_and_reader_agree_on_nan_and_repeated_steps(tmp_path: Path) -> None:
    writer = metrics_log.MetricsWriter(tmp_path / metrics_log.FILE_NAME)
    for step, value in ((1, 1.0), (2, float("nan")), (2, 2.0)):
        writer.write(step, {"a": value})
    writer.close()
    assert metrics_log.read(tmp_path) == [{"step": 1, "a": 1.0}, {"step": 2, "a": 2.0}]


def test_a_metrics_path_that_is_a_pipe_or_device_is_refused_before_reading(tmp_path: Path) -> None:
    # Reading a pipe with no writer blocks forever; /dev/zero would fill the memory.
    os.mkfifo(tmp_path / "metrics.jsonl")
    for path in (tmp_path, tmp_path / "metrics.jsonl", Path("/dev/zero")):
        with pytest.raises(UserError, match="is not a regular file"):
            metrics_log.read(path)
