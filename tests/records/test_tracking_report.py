"""``verlite metrics``: the summary table of metrics.jsonl (also while it is being written),
the PNG plot, key selection, a Ray job's metrics, and one-line errors with exit 2."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from verlite import report
from verlite.errors import UserError
from verlite.records.metrics_log import read as load_metrics
from verlite.report import summary_rows
from verlite.table import format_duration

RECORDS: list[dict[str, Any]] = [
    {"step": 1, "critic/score/mean": 0.1, "actor/pg_loss": 1.0, "actor/entropy": 2.0},
    {
        "step": 2,
        "critic/score/mean": 0.5,
        "actor/pg_loss": -2.0,
        "actor/entropy": 1.5,
        "val/score/mean": 0.2,
    },
    {"step": 3, "critic/score/mean": 0.3, "actor/pg_loss": 0.5, "actor/entropy": 1.0},
    {
        "step": 4,
        "critic/score/mean": 0.4,
        "actor/pg_loss": 0.25,
        "actor/entropy": 0.5,
        "val/score/mean": 0.6,
    },
]


def _write(out: Path, records: Sequence[dict[str, Any]], tail: str = "") -> Path:
    out.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({**r, "timing_s/step": 1.5, "response_length/mean": 8.0}) for r in records]
    (out / "metrics.jsonl").write_text("".join(line + "\n" for line in lines) + tail)
    return out


def _metrics(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """Run ``verlite metrics ARGV`` as cli.main does: a UserError is one line on stderr, exit 2."""
    parser = argparse.ArgumentParser(prog="verlite")
    report.add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["metrics", *argv])
    try:
        code: int = args.handler(args)
    except UserError as exc:
        print(f"verlite: error: {exc}", file=sys.stderr)
        code = 2
    out, err = capsys.readouterr()
    return code, out, err


def _row(out: str, key: str) -> list[str]:
    return next(line.split() for line in out.splitlines() if line.startswith(key + " "))


def test_table_has_first_last_best_mean_steps_and_wall_time(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _metrics([str(_write(tmp_path, RECORDS))], capsys)
    assert (code, err) == (0, "")
    assert out.splitlines()[0] == "4 steps (1-4), wall time 6.0 s (sum of timing_s/step)"
    assert _row(out, "critic/score/mean") == [
        "critic/score/mean",
        "4",
        "0.1",
        "0.4",
        "0.5",
        "@2",
        "0.325",
    ]
    assert _row(out, "val/score/mean") == ["val/score/mean", "2", "0.2", "0.6", "0.6", "@4", "0.4"]
    # No direction is better for the policy's loss (its batch's objective) or entropy: no
    # best. Mutation: every loss taken lower-is-better -> fails
    assert _row(out, "actor/pg_loss") == ["actor/pg_loss", "4", "1", "0.25", "-", "-0.0625"]
    assert _row(out, "actor/entropy") == ["actor/entropy", "4", "2", "0.5", "-", "1.25"]
    keys = [line.split()[0] for line in out.splitlines()[2:]]
    assert keys == [
        "critic/score/mean",
        "val/score/mean",
        "actor/pg_loss",
        "actor/entropy",
        "response_length/mean",
    ]  # the default keys present, in their order; timing_s/step is not a default row


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [
        (0.0, "0.0 s"),
        (6.04, "6.0 s"),
        (59.9, "59.9 s"),
        (60.0, "1m00s"),
        (127.6, "2m08s"),  # rounded to the second
        (3723.2, "1h02m03s"),
        (float("inf"), "?"),  # an estimate with nothing to go on
        (float("nan"), "?"),
    ],
)
def test_durations_read_in_seconds_then_minutes_then_hours(seconds: float, shown: str) -> None:
    # The report's wall time and the console's ETA.
    assert format_duration(seconds) == shown


def test_partially_written_last_line_is_ignored(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _write(tmp_path, RECORDS, tail='{"step": 5, "critic/score/me')
    code, out, _ = _metrics([str(tmp_path)], capsys)
    assert code == 0
    assert out.startswith("4 steps (1-4)")
    assert _row(out, "critic/score/mean")[:4] == ["critic/score/mean", "4", "0.1", "0.4"]


def test_complete_last_line_without_newline_counts(tmp_path: Path) -> None:
    _write(tmp_path, RECORDS[:3], tail=json.dumps(RECORDS[3]))
    assert [r["step"] for r in load_metrics(tmp_path)] == [1, 2, 3, 4]


def test_a_repeated_step_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Two runs in one file: a resumed run drops its records after the checkpoint first.
    code, out, err = _metrics([str(_write(tmp_path, [*RECORDS, *RECORDS[2:]]))], capsys)
    assert (code, out) == (2, "")
    assert "line 5 logs step 3 after step 4" in err and err.count("\n") == 1


def test_keys_select_metrics_and_patterns(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = _metrics(
        [str(_write(tmp_path, RECORDS)), "--keys", "timing_s/*,actor/entropy"], capsys
    )
    assert code == 0
    assert [line.split()[0] for line in out.splitlines()[2:]] == ["timing_s/step", "actor/entropy"]
    assert _row(out, "timing_s/step") == ["timing_s/step", "4", "1.5", "1.5", "1.5", "@1", "1.5"]


def test_unknown_key_exits_2_naming_close_matches(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _metrics([str(_write(tmp_path, RECORDS)), "--keys", "actor/pg_los"], capsys)
    assert (code, out) == (2, "")
    assert err.count("\n") == 1
    assert "unknown metric 'actor/pg_los'" in err
    assert "did you mean actor/pg_loss" in err


def test_nan_values_are_left_out_of_best_and_mean(tmp_path: Path) -> None:
    """A value model's loss is better lower (the policy's has no best: the table test)."""
    records = [
        {
            "step": r["step"],
            "critic/vf_loss": float("nan") if r["step"] == 2 else r["actor/pg_loss"],
        }
        for r in RECORDS
    ]
    (row,) = summary_rows(load_metrics(_write(tmp_path, records)), ["critic/vf_loss"])
    assert (row.count, row.best, row.best_step) == (4, 0.25, 4)
    assert row.mean == pytest.approx((1.0 + 0.5 + 0.25) / 3)


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ("no_folder", "no such folder"),
        ("no_file", "no metrics file"),
        ("empty", "holds no metrics yet"),
        ("only_torn", "holds no metrics yet"),
        ("bad_middle_line", "line 2: malformed JSON"),
        ("no_step", "line 1 is not a metrics record"),
    ],
)
def test_unreadable_runs_exit_2_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], setup: str, message: str
) -> None:
    out = tmp_path / "run"
    files = {
        "empty": "",
        "only_torn": '{"step": 1, "a"',
        "bad_middle_line": '{"step": 1}\n{"step": 2,,}\n{"step": 3}\n',
        "no_step": '{"a": 1.0}\n',
    }
    if setup != "no_folder":
        out.mkdir()
    if setup in files:
        (out / "metrics.jsonl").write_text(files[setup])
    code, stdout, err = _metrics([str(out)], capsys)
    assert (code, stdout) == (2, "")
    assert err.count("\n") == 1 and message in err


def test_plot_writes_a_png_matplotlib_reads_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from matplotlib.image import imread

    png = tmp_path / "plots" / "run.png"
    code, out, _ = _metrics([str(_write(tmp_path / "run", RECORDS)), "--plot", str(png)], capsys)
    assert code == 0
    assert out.splitlines()[-1] == f"wrote {png}"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, channels = imread(png).shape
    assert width > height > 400 and channels in (3, 4)


def test_a_diverged_runs_huge_and_infinite_values_are_gaps_in_the_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # matplotlib cannot lay out an axis spanning 1e308 (it raised a ValueError traceback).
    diverged = [
        {"step": 1, "critic/score/mean": 1e308, "actor/pg_loss": 0.5},
        {"step": 2, "critic/score/mean": float("nan"), "actor/pg_loss": 0.4},
        {"step": 3, "critic/score/mean": float("-inf"), "actor/pg_loss": 0.3},
    ]
    png = tmp_path / "run.png"
    code, _, err = _metrics([str(_write(tmp_path / "run", diverged)), "--plot", str(png)], capsys)
    assert code == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_needs_a_png_name_and_matplotlib(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    run = str(_write(tmp_path, RECORDS))
    code, out, err = _metrics([run, "--plot", str(tmp_path / "run.jpg")], capsys)
    assert code == 2 and "name the file *.png" in err
    assert out == ""  # refused before the table, not after it
    # quoted as every value a message quotes (errors.shown): a pasted page is cut, not repeated
    code, _, err = _metrics([run, "--plot", "x" * 5000 + ".bmp"], capsys)
    assert code == 2 and "not 'xxx" in err and "[...]" in err and len(err) < 400, err
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code, out, err = _metrics([run, "--plot", str(tmp_path / "run.png")], capsys)
    assert (
        code == 2 and "pip install 'matplotlib>=3.7' (verlite's 'plot' extra)" in err and out == ""
    )
    assert not (tmp_path / "run.png").exists()


def test_a_plot_named_in_a_deleted_current_folder_is_refused_before_the_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shell left in a folder removed since: a relative --plot path is of no folder (the
    look for the folder to make it in ran out of folders: StopIteration, or the table printed
    and then the write failed)."""
    run = str(_write(tmp_path / "run", RECORDS))
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    for png in ("run.png", "plots/run.png", "../run.png"):
        code, out, err = _metrics([run, "--plot", png], capsys)
        assert (code, out) == (2, "")
        assert err == (
            f"verlite: error: --plot {png!r}: cannot write: the current folder no longer exists\n"
        )


@pytest.mark.parametrize(
    ("argv", "start"),
    [
        (["--keys", "," * 5000], "verlite: error: --keys ',,,"),
        (["--keys", "x" * 5000], "verlite: error: unknown metric 'xxx"),
    ],
)
def test_a_pasted_value_is_quoted_cut_in_the_metrics_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], start: str
) -> None:
    """--keys and a metric's name are quoted as every value a message quotes (errors.shown):
    a pasted page is cut, not repeated (they were a bare repr)."""
    code, _, err = _metrics([str(_write(tmp_path, RECORDS)), *argv], capsys)
    assert code == 2 and err.startswith(start) and "[...]" in err and len(err) < 400, err[:200]


def test_a_reader_that_stops_early_ends_the_command_quietly(tmp_path: Path) -> None:
    """`verlite metrics RUN | head -1`: the closed pipe is not an error worth a traceback."""
    run = _write(tmp_path, [{"step": i, **{f"actor/m{j}": j for j in range(300)}} for i in (1, 2)])
    read_end, write_end = os.pipe()
    proc = subprocess.Popen(
        [sys.executable, "-m", "verlite", "metrics", str(run), "--keys", "actor/*"],
        stdout=write_end,
        stderr=subprocess.PIPE,
    )
    os.close(write_end)
    os.close(read_end)  # the reader goes away before the table is written
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 141, err
    assert err == b""


def test_job_metrics_use_the_same_table(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[str, str]] = []

    def read_job_metrics(address: str, job_id: str) -> list[dict[str, Any]]:
        calls.append((address, job_id))
        return list(RECORDS)  # one per step in step order, as metrics_log.parse_marked_lines gives

    jobs = types.ModuleType("verlite.jobs")
    jobs.read_job_metrics = read_job_metrics  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "verlite.jobs", jobs)
    code, out, _ = _metrics(["--job", "raysubmit_1", "--address", "http://head:8265"], capsys)
    assert code == 0
    assert calls == [("http://head:8265", "raysubmit_1")]
    assert out.startswith("4 steps (1-4)\n")  # no timing_s/step in these records
    assert _row(out, "critic/score/mean")[2:] == ["0.1", "0.4", "0.5", "@2", "0.325"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "give the run's OUTPUT_DIR"),
        (["some/dir", "--job", "j1", "--address", "http://h:8265"], "not both"),
        (["some/dir", "--address", "http://h:8265"], "--address goes with --job"),
        (["some/dir", "--keys", ","], "--keys ',' names no metric"),
        (["some/dir", "--keys", " "], "--keys ' ' names no metric"),
    ],
)
def test_job_flags_are_checked(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, _, err = _metrics(argv, capsys)
    assert code == 2 and message in err
