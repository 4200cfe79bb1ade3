"""`verlite compare RUN_A RUN_B`: two real run folders, their first difference or their
sameness, through the CLI's ``main`` (and once as a user runs it, in a subprocess)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from verlite.records.compare import Difference, first_difference, relative_difference

STEPS = [
    {"step": 1, "critic/score/mean": 0.25, "actor/pg_loss": -0.01, "timing_s/step": 0.2},
    {"step": 2, "critic/score/mean": 0.5, "actor/pg_loss": 0.02, "timing_s/step": 0.3},
    {"step": 3, "critic/score/mean": 0.75, "actor/pg_loss": float("nan"), "perf/throughput": 9.0},
]


def write_run(folder: Path, records: list[dict]) -> Path:
    folder.mkdir(parents=True)
    lines = (json.dumps(r, allow_nan=True) + "\n" for r in records)
    (folder / "metrics.jsonl").write_text("".join(lines))
    return folder


def changed(step: int, **values: float) -> list[dict]:
    return [{**r, **values} if r["step"] == step else dict(r) for r in STEPS]


@pytest.fixture
def run(verlite_main):
    def compare(*args: str | Path) -> tuple[int, str, str]:
        proc = verlite_main("compare", *args)
        return proc.returncode, proc.stdout, proc.stderr

    return compare


def test_runs_that_differ_only_in_wall_clock_metrics_are_identical(tmp_path: Path, run) -> None:
    a = write_run(tmp_path / "a", STEPS)
    b = write_run(tmp_path / "b", [{**r, "timing_s/step": 9.9} for r in STEPS])
    code, out, err = run(a, b)
    assert (code, err) == (0, "")
    assert (
        out
        == f"{a} and {b} are identical to 0 over 3 steps (2 metrics a step; timings and restarts not compared)\n"
    )


def test_validation_memory_is_run_history_and_its_scores_are_compared() -> None:
    """A reward model's peak memory while it scored validation (``val/perf/...``) differs
    between equal runs (a process's peak RSS on CPU) as the step's own does; ``val/score/mean``
    is what the run trained to."""
    memory = "val/perf/max_memory_allocated_gb/reward_model"
    a = [{**r, "val/score/mean": 0.5, memory: 1.25} for r in STEPS]
    b = [{**r, "val/score/mean": 0.5, memory: 1.5} for r in STEPS]
    assert first_difference(a, b, tolerance=0.0) is None
    c = [{**r, "val/score/mean": 0.75} for r in b]
    assert first_difference(a, c, tolerance=0.0) == Difference(1, "val/score/mean", 0.5, 0.75)


def test_the_first_step_and_metric_that_differ_are_named(tmp_path: Path, run) -> None:
    a = write_run(tmp_path / "a", STEPS)
    later = [
        {**r, "critic/score/mean": 0.5000001, "actor/pg_loss": 0.03}
        if r["step"] == 2
        else {**r, "critic/score/mean": 0.7}
        if r["step"] == 3
        else r
        for r in STEPS
    ]
    b = write_run(tmp_path / "b", later)
    code, out, _ = run(a, b)
    assert code == 1
    assert out == (
        f"{a} and {b} differ: step 2: actor/pg_loss = 0.02 in {a}, 0.03 in {b} "
        "(relative difference 0.333)\n"
    )


def test_a_tolerance_accepts_rounding_and_not_more(tmp_path: Path, run) -> None:
    a = write_run(tmp_path / "a", STEPS)
    b = write_run(tmp_path / "b", changed(2, **{"critic/score/mean": 0.5000001}))
    assert run(a, b)[0] == 1  # exact by default
    code, out, _ = run(a, b, "--tolerance", "1e-6")
    assert code == 0 and "identical to 1e-06 over 3 steps" in out
    code, out, _ = run(a, b, "--tolerance", "1e-8")
    assert code == 1 and "step 2: critic/score/mean = 0.5 in" in out


def test_an_absolute_tolerance_accepts_noise_around_zero_and_not_more(tmp_path: Path, run) -> None:
    """The PPO KL of a step's first mini-batch is 0 in exact arithmetic: one layout logs
    0.0, another -9.5e-19, a relative difference of 1."""
    a = write_run(tmp_path / "a", changed(1, **{"actor/ppo_kl": 0.0}))
    b = write_run(tmp_path / "b", changed(1, **{"actor/ppo_kl": -9.5e-19}))
    assert run(a, b, "--tolerance", "1e-9")[0] == 1
    code, out, _ = run(a, b, "--tolerance", "1e-9", "--atol", "1e-15")
    assert code == 0 and "identical to 1e-09 (absolute 1e-15) over 3 steps" in out
    # the absolute tolerance does not widen the relative one for larger values
    plain = write_run(tmp_path / "plain", STEPS)
    c = write_run(tmp_path / "c", changed(2, **{"critic/score/mean": 0.5 + 1e-12}))
    code, out, _ = run(plain, c, "--tolerance", "1e-15", "--atol", "1e-15")
    assert code == 1 and "step 2: critic/score/mean" in out


def test_a_missing_step_or_metric_is_a_difference(tmp_path: Path, run) -> None:
    a = write_run(tmp_path / "a", STEPS)
    shorter = write_run(tmp_path / "shorter", STEPS[:2])
    code, out, _ = run(a, shorter)
    assert code == 1 and out.endswith(f"differ: step 3 is logged by {a} only\n")
    extra = write_run(tmp_path / "extra", changed(1, **{"actor/kl_loss": 0.0}))
    code, out, _ = run(a, extra)
    assert code == 1 and out.endswith(f"differ: step 1: actor/kl_loss is logged by {extra} only\n")


def test_nan_equals_nan_and_nothing_else() -> None:
    nan, inf = float("nan"), float("inf")
    assert relative_difference(nan, nan) == 0 and relative_difference(inf, inf) == 0
    assert math.isinf(relative_difference(nan, 1.0)) and math.isinf(relative_difference(inf, -inf))
    assert relative_difference(0.0, 0.0) == 0 and relative_difference(2.0, 1.0) == 0.5
    steps = [{"step": 1, "x": nan}]
    assert first_difference(steps, steps, tolerance=0) is None
    assert first_difference(steps, [{"step": 1, "x": 1.0}], tolerance=1e9) is not None


def test_a_file_holding_two_runs_is_named_not_compared_as_its_last_records(
    tmp_path: Path, run
) -> None:
    two_runs = write_run(tmp_path / "two", [*changed(2, **{"actor/pg_loss": 5.0}), *STEPS])
    b = write_run(tmp_path / "b", STEPS)
    code, out, err = run(two_runs, b)
    assert (code, out) == (2, "") and err.count("\n") == 1, err
    assert "metrics.jsonl' line 4 logs step 1 after step 3" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["nope", "nope2"], "no such folder: 'nope'"),
        (["{a}", "{null}"], "line 2: metric 'actor/pg_loss' is None; expected a number"),
        (["{a}", "{bytes}"], "is not UTF-8 text (byte 0xfe at offset 1, line 1)"),
        (["{a}", "{a}", "--tolerance", "-1"], "expected a finite number >= 0, got '-1'"),
        (["{a}", "{a}", "--tolerance", "inf"], "expected a finite number >= 0, got 'inf'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    tmp_path: Path, run, args: list[str], message: str
) -> None:
    a = write_run(tmp_path / "a", STEPS)
    null = write_run(tmp_path / "null", changed(2, **{"actor/pg_loss": None}))
    (bytes_ := tmp_path / "bytes").mkdir()
    (bytes_ / "metrics.jsonl").write_bytes(b"{\xfe}\n")
    code, out, err = run(*(x.format(a=a, null=null, bytes=bytes_) for x in args))
    assert code == 2 and out == "" and err.count("\n") == 1 and message in err, err


def test_as_a_user_runs_it(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a", STEPS)
    b = write_run(tmp_path / "b", changed(3, **{"critic/score/mean": 0.5}))
    proc = subprocess.run(
        [sys.executable, "-m", "verlite", "compare", str(a), str(b)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    assert "differ: step 3: critic/score/mean = 0.75" in proc.stdout
