"""What every benchmark's flags share: ``--repeats`` below two (the quartiles each reports
need two repetitions) is refused in one line, exit 2, in every benchmark that has it, and
every number a flag takes is checked by its type (``verlite.arguments``): a bare ``int`` or
``float`` let ``--env-threads 0`` or a negative latency end in a traceback."""

import argparse
import re
from pathlib import Path

import pytest

from benchmarks.common import add_repeats

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.parametrize("value", ["1", "0", "-3", "two"])
def test_fewer_than_two_repeats_are_refused_in_one_line(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser(prog="bench")
    add_repeats(parser, 5)
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(["--repeats", value])
    assert exited.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("bench: error: argument --repeats: expected ") and value in error
    assert parser.parse_args(["--repeats", "2"]).repeats == 2
    assert parser.parse_args([]).repeats == 5


def test_every_benchmark_takes_its_repeats_through_add_repeats() -> None:
    by_hand = [
        path.name
        for path in sorted(BENCHMARKS.glob("*.py"))
        if path.name != "common.py"
        and re.search(r"add_argument\(\s*\"--repeats\"", path.read_text())
    ]
    assert by_hand == []


def test_no_benchmark_takes_an_unchecked_number() -> None:
    unchecked = [
        path.name
        for path in sorted(BENCHMARKS.glob("*.py"))
        if re.search(r"type=(int|float)\b", path.read_text())
    ]
    assert unchecked == []


@pytest.mark.parametrize("argv", [["--help"], ["nope"], ["lora", "--bogus"]])
def test_run_all_refuses_what_is_no_benchmark_before_running_any(
    argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # ``run_all --help`` once ran a benchmark named --help, and an unknown name failed only
    # when its turn came, the results of those before it never written.
    from benchmarks import run_all

    ran: list[str] = []
    monkeypatch.setattr(run_all, "run", ran.append)
    with pytest.raises(SystemExit) as exited:
        run_all.main(argv)
    assert ran == []
    out, err = capsys.readouterr()
    if argv == ["--help"]:
        assert exited.value.code == 0 and ", ".join(run_all.BENCHMARKS) in " ".join(out.split())
    else:
        assert exited.value.code == 2
        assert err.strip().splitlines()[-1].startswith("python -m benchmarks.run_all: error: ")
    if argv == ["nope"]:
        assert "unknown benchmark 'nope'; allowed: orchestration, " in err
