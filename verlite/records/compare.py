"""``verlite compare RUN_A RUN_B``: are two runs the same run?

Two output folders are compared step by step on every metric except those of the run's
history (``timing_s/*``, ``perf/*``, ``trainer/*`` and their ``val/`` forms: clocks, memory
and restarts, which differ between equal runs). A value differs when ``|a - b| > max(tolerance * max(|a|, |b|), atol)``; NaN
equals NaN and an infinity equals itself. ``atol`` (default 0) serves metrics that are zero
in exact arithmetic, such as the PPO KL of a step's first mini-batch: their rounding noise
(~1e-18 in float64) has no meaningful relative difference. The first step (in step order)
and metric (in name order) that differ is reported; runs of
different lengths, or a metric logged by one run only, differ too.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from verlite.errors import shown
from verlite.records import metrics_log
from verlite.records.metrics_log import Record


@dataclass(frozen=True)
class Difference:
    """Where two runs first part: a step, and a metric of it."""

    step: int
    metric: str | None = None  # None: the step itself
    a: float | None = None
    b: float | None = None
    only_in: Literal["a", "b"] | None = None  # the step or metric is logged by one run only

    def describe(self, name_a: str, name_b: str) -> str:
        where = f"step {self.step}" + (f": {self.metric}" if self.metric else "")
        if self.only_in is not None:
            return f"{where} is logged by {name_a if self.only_in == 'a' else name_b} only"
        assert self.a is not None and self.b is not None
        return (
            f"{where} = {self.a!r} in {name_a}, {self.b!r} in {name_b} "
            f"(relative difference {relative_difference(self.a, self.b):.3g})"
        )


def relative_difference(a: float, b: float) -> float:
    """``|a - b| / max(|a|, |b|)``; 0 for equal values (NaN with NaN included), inf when only
    one is NaN or the two are different infinities."""
    if a == b or (math.isnan(a) and math.isnan(b)):
        return 0.0
    if math.isnan(a) or math.isnan(b) or math.isinf(a) or math.isinf(b):
        return math.inf
    return abs(a - b) / max(abs(a), abs(b))


def differs(a: float, b: float, *, tolerance: float, atol: float = 0.0) -> bool:
    """Whether ``a`` and ``b`` differ by more than ``tolerance`` (relative) and ``atol``."""
    relative = relative_difference(a, b)
    return relative > tolerance and (math.isinf(relative) or abs(a - b) > atol)


def compared_metrics(record: Record) -> dict[str, float]:
    """A record's metrics that two equal runs share: all but the step and those of the run's
    history (clocks, restarts)."""
    return {
        key: float(value)
        for key, value in record.items()
        if key != "step" and not metrics_log.is_run_history(key)
    }


def first_difference(
    run_a: list[Record], run_b: list[Record], *, tolerance: float, atol: float = 0.0
) -> Difference | None:
    """The first step and metric where the runs differ (:func:`differs`), if any."""
    steps_a = {r["step"]: compared_metrics(r) for r in run_a}
    steps_b = {r["step"]: compared_metrics(r) for r in run_b}
    for step in sorted(steps_a.keys() | steps_b.keys()):
        if step not in steps_b:
            return Difference(step, only_in="a")
        if step not in steps_a:
            return Difference(step, only_in="b")
        metrics_a, metrics_b = steps_a[step], steps_b[step]
        for metric in sorted(metrics_a.keys() | metrics_b.keys()):
            if metric not in metrics_b:
                return Difference(step, metric, only_in="a")
            if metric not in metrics_a:
                return Difference(step, metric, only_in="b")
            a, b = metrics_a[metric], metrics_b[metric]
            if differs(a, b, tolerance=tolerance, atol=atol):
                return Difference(step, metric, a, b)
    return None


def add_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``verlite compare`` on the CLI's subparsers."""
    parser = subparsers.add_parser(
        "compare",
        help="compare two runs' metrics step by step",
        description="Compare the metrics.jsonl of two runs step by step on every metric but "
        "those of the run's history (timing_s/*, perf/*, trainer/*, val/perf/*). Print the first step and "
        "metric that differ by more than the tolerance (relative), or that the runs are "
        "identical. Exit 0 when identical, 1 when they differ, 2 on bad input.",
    )
    parser.add_argument("run_a", metavar="RUN_A", help="a run's output folder (or metrics.jsonl)")
    parser.add_argument("run_b", metavar="RUN_B", help="the run to compare it with")
    parser.add_argument(
        "--tolerance",
        type=_tolerance,
        default=0.0,
        help="largest relative difference |a-b|/max(|a|,|b|) still equal (default 0: exact)",
    )
    parser.add_argument(
        "--atol",
        type=_tolerance,
        default=0.0,
        help="largest absolute difference still equal, for metrics near zero (default 0)",
    )
    parser.set_defaults(handler=cmd_compare)


def _tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {shown(text)}") from None
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {shown(text)}")
    return value


def cmd_compare(args: argparse.Namespace) -> int:
    run_a, run_b = metrics_log.read(args.run_a), metrics_log.read(args.run_b)
    name_a, name_b = Path(args.run_a).as_posix(), Path(args.run_b).as_posix()
    difference = first_difference(run_a, run_b, tolerance=args.tolerance, atol=args.atol)
    if difference is not None:
        print(f"{name_a} and {name_b} differ: {difference.describe(name_a, name_b)}")
        return 1
    metrics = len(compared_metrics(run_a[-1]))
    atol = f" (absolute {args.atol:g})" if args.atol else ""
    print(
        f"{name_a} and {name_b} are identical to {args.tolerance:g}{atol} over {len(run_a)} steps "
        f"({metrics} metrics a step; timings and restarts not compared)"
    )
    return 0
