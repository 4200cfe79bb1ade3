"""The metrics record format (:mod:`verlite.records.metrics_log`): marked log lines, and a resumed
run's ``metrics.jsonl`` cut back to its checkpoint."""

import json
import os
from pathlib import Path

import pytest

from verlite.errors import UserError
from verlite.records import metrics_log


def test_marked_lines_count_at_a_lines_start_and_a_restart_drops_what_followed_its_step() -> None:
    log = "\n".join(
        [
            "placed 2 workers",
            metrics_log.start_line(0),
            'VERLITE_METRICS {"step": 1, "critic/score/mean": 0.1}',
            'debug: VERLITE_METRICS {"step": 1, "critic/score/mean": 9.9}',  # a user's print
            'VERLITE_METRICS {"step": 2, "critic/score/mean": 0.5}',
            'VERLITE_METRICS {"step": 3, "critic/score/mean": 0.6}',
            metrics_log.start_line(1),  # restarted from the step-1 checkpoint
            'VERLITE_METRICS {"step": 2, "critic/score/mean": 0.7}',
            'VERLITE_METRICS {"step": 3, "critic/sco',  # still being written
        ]
    )
    assert metrics_log.parse_marked_lines(log) == [
        {"step": 1, "critic/score/mean": 0.1},
        {"step": 2, "critic/score/mean": 0.7},
    ]


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (  # a user's print of a record at a line's start, before verlite logs that step
            ['VERLITE_METRICS {"step": 1, "a": 9.9}', 'VERLITE_METRICS {"step": 1, "a": 0.1}'],
            "job 'j'\\'s log line 3 logs step 1 after step 1 \\(job 'j'\\'s log line 2\\)",
        ),
        (
            ['VERLITE_METRICS {"step": 5, "a": 1}', 'VERLITE_METRICS {"step": 2, "a": 1}'],
            "line 3 logs step 2 after step 5",
        ),
        (['VERLITE_METRICS {"step": true, "a": 1}', ""], "line 2 is not a metrics record"),
        (['VERLITE_METRICS {"step": 1, "a": null}', ""], "line 2: metric 'a' is None"),
        (["VERLITE_METRICS [1, 2]", ""], "line 2 is not a metrics record"),
        (["VERLITE_METRICS_START_AFTER x", ""], "line 2 is not a start line"),
    ],
)
def test_a_marked_line_never_silently_replaces_or_forges_a_record(
    lines: list[str], message: str
) -> None:
    log = "\n".join([metrics_log.start_line(0), *lines])
    with pytest.raises(UserError, match=message):
        metrics_log.parse_marked_lines(log, source="job 'j''s log")


def test_truncate_keeps_the_records_up_to_the_checkpoint_and_drops_torn_lines(
    tmp_path: Path,
) -> None:
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "a": float(s)}) for s in (1, 2, 3, 4)]
    # unreadable too: an integer past the digits Python's json reads (a ValueError of its own)
    huge = '{"step": 2, "a": ' + "9" * 5000 + "}"
    path.write_text("\n".join([*lines[:2], "not json", huge, *lines[2:]]) + '\n{"step": 5, "a"')
    metrics_log.truncate(tmp_path, after_step=3)
    assert path.read_text().splitlines() == lines[:3]
    assert [r["step"] for r in metrics_log.read(tmp_path)] == [1, 2, 3]


def test_writer_and_reader_agree_on_nan_and_a_resumed_run_reads_as_one(tmp_path: Path) -> None:
    writer = metrics_log.MetricsWriter(tmp_path / metrics_log.FILE_NAME)
    for step, value in ((1, 1.0), (2, float("nan")), (3, 3.0)):
        writer.write(step, {"a": value})
    writer.close()
    metrics_log.truncate(tmp_path, after_step=1)  # resumed from the step-1 checkpoint
    writer = metrics_log.MetricsWriter(tmp_path / metrics_log.FILE_NAME)
    writer.write(2, {"a": 2.0})
    writer.close()
    assert metrics_log.read(tmp_path) == [{"step": 1, "a": 1.0}, {"step": 2, "a": 2.0}]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (  # two runs appended to one file
            b'{"step": 1, "a": 1}\n{"step": 2, "a": 2}\n{"step": 1, "a": 1}\n{"step": 2, "a": 2}\n',
            "line 3 logs step 1 after step 2 \\('.*metrics.jsonl' line 2\\)",
        ),
        (b'{"step": true, "a": 1}\n', "line 1 is not a metrics record: its 'step' must be"),
        (b'{"step": 1.0, "a": 1}\n', "line 1 is not a metrics record"),
        (b'{"step": -1, "a": 1}\n', "line 1 is not a metrics record"),
        (b'{"step": 1, "a": null}\n', "line 1: metric 'a' is None; expected a number"),
        (b'{"step": 1, "a": "0.5"}\n', "line 1: metric 'a' is '0.5'; expected a number"),
        (b'{"step": 1, "a": false}\n', "line 1: metric 'a' is False; expected a number"),
        (  # valid JSON that no float holds: verlite compare and metrics crashed on it
            b'{"step": 1, "a": 1' + b"0" * 400 + b"}\n",
            "line 1: metric 'a' is an integer of 401 digits, beyond a float's range",
        ),
        (b'{"step": 1, "a": 1, "step": 5}\n', "line 1: field 'step' is set twice"),
        (b'{"step": 1, "a": \xff}\n', "is not UTF-8 text \\(byte 0xff at offset 17, line 1\\)"),
    ],
)
def test_a_metrics_file_that_is_no_single_run_of_numbers_is_one_line(
    tmp_path: Path, content: bytes, message: str
) -> None:
    (tmp_path / metrics_log.FILE_NAME).write_bytes(content)
    with pytest.raises(UserError, match=message):
        metrics_log.read(tmp_path)


def test_a_metrics_path_that_is_a_pipe_or_device_is_refused_before_reading(tmp_path: Path) -> None:
    # Reading a pipe with no writer blocks forever; /dev/zero would fill the memory.
    os.mkfifo(tmp_path / "metrics.jsonl")
    for path in (tmp_path, tmp_path / "metrics.jsonl", Path("/dev/zero")):
        with pytest.raises(UserError, match="is not a regular file"):
            metrics_log.read(path)


def test_a_restarted_runs_log_reads_as_one_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from verlite.records.tracking import Tracker

    # The first attempt logs steps 1-3 and is restarted from its step-1 checkpoint.
    for start, steps in ((0, (1, 2, 3)), (1, (2, 3, 4))):
        with Tracker(["logline"], output_dir=tmp_path, total_steps=4, start_step=start) as tracker:
            for step in steps:
                tracker.log(step, {"a": float(10 * start + step)})
    records = metrics_log.parse_marked_lines(capsys.readouterr().out)
    assert records == [{"step": 1, "a": 1.0}, *({"step": s, "a": 10.0 + s} for s in (2, 3, 4))]
