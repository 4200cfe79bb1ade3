"""Reading a run's metrics back: ``verlite metrics`` prints a summary table of metrics.jsonl
(or of a Ray job's logged metrics) and optionally plots the main curves to a PNG.

Works on a run still in progress: a partially written last line is ignored.
"""

from __future__ import annotations

import argparse
import difflib
import fnmatch
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from verlite.errors import UserError, import_extra, shown
from verlite.records import metrics_log
from verlite.records.metrics_log import Record
from verlite.table import format_duration

# The table's rows by default, in this order, when present.
DEFAULT_KEYS = (
    "critic/score/mean",
    "val/score/mean",
    "actor/pg_loss",
    "critic/vf_loss",
    "actor/kl_loss",
    "actor/entropy",
    "response_length/mean",
    "actor/grad_norm",
    "critic/grad_norm",
    "perf/throughput",
)

STEP_TIME_KEY = "timing_s/step"

# Plot panels: title and the metrics drawn in it (those present).
PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("score", ("critic/score/mean", "val/score/mean")),
    ("losses", ("actor/pg_loss", "critic/vf_loss")),
    ("KL", ("actor/kl_loss", "actor/ppo_kl", "actor/reward_kl_penalty")),
    ("response length (band: min to max)", ("response_length/mean",)),
)


@dataclass(frozen=True)
class SummaryRow:
    """One metric over a run: ``best`` is None where no direction is better (entropy, lengths)."""

    key: str
    count: int
    first: float
    last: float
    best: float | None
    best_step: int | None
    mean: float


def _series(records: Sequence[Record], key: str) -> list[tuple[int, float]]:
    return [
        (int(r["step"]), float(r[key]))
        for r in records
        if isinstance(r.get(key), int | float) and not isinstance(r.get(key), bool)
    ]


def metric_names(records: Sequence[Record]) -> list[str]:
    """Every numeric metric in the records, in first-seen order."""
    names: dict[str, None] = {}
    for record in records:
        names.update((key, None) for key in record if key != "step" and _series([record], key))
    return list(names)


def _direction(key: str) -> Literal["max", "min"] | None:
    """Which way is better, where one is: none for entropy, lengths, norms, ratios, and the
    policy's losses (``actor/*``: each is its batch's objective against that batch's own
    advantages or reference, no measure of how good the policy is); lower for a value
    model's loss and for seconds."""
    if key.startswith("timing_s/") or ("loss" in key and not key.startswith("actor/")):
        return "min"
    if any(word in key for word in ("score", "accuracy", "throughput", "explained_var")):
        return "max"
    return None


def select_keys(records: Sequence[Record], keys: Sequence[str] | None = None) -> list[str]:
    """The default keys present, or the requested ones (``fnmatch`` patterns allowed, e.g.
    ``timing_s/*``); an unknown one is an error naming close matches."""
    names = metric_names(records)
    if keys is None:
        return [key for key in DEFAULT_KEYS if key in names]
    selected: dict[str, None] = {}
    for key in keys:
        matches = fnmatch.filter(names, key) if any(c in key for c in "*?[") else None
        if matches:
            selected.update(dict.fromkeys(matches))
        elif key in names:
            selected[key] = None
        else:
            containing = [name for name in names if key in name]
            close = list(
                dict.fromkeys(containing + difflib.get_close_matches(key, names, cutoff=0.5))
            )[:4]
            hint = f"did you mean {', '.join(close)}?" if close else "no close match"
            raise UserError(f"unknown metric {shown(key)}; {hint} ({len(names)} metrics logged)")
    return list(selected)


def summary_rows(records: Sequence[Record], keys: Sequence[str] | None = None) -> list[SummaryRow]:
    """First / last / best / mean of each selected metric (see :func:`select_keys`); best and
    mean are over finite values only."""
    rows = []
    for key in select_keys(records, keys):
        series = _series(records, key)
        finite = [(step, value) for step, value in series if math.isfinite(value)]
        direction = _direction(key)
        best: tuple[int, float] | None = None
        if finite and direction is not None:
            pick = max if direction == "max" else min
            best = pick(finite, key=lambda item: item[1])
        rows.append(
            SummaryRow(
                key=key,
                count=len(series),
                first=series[0][1],
                last=series[-1][1],
                best=best[1] if best else None,
                best_step=best[0] if best else None,
                mean=math.fsum(v for _, v in finite) / len(finite) if finite else math.nan,
            )
        )
    return rows


def format_summary(records: Sequence[Record], rows: Sequence[SummaryRow]) -> str:
    """A header line (steps, wall time) and the table of ``rows``."""
    steps = [int(r["step"]) for r in records]
    step_times = [seconds for _, seconds in _series(records, STEP_TIME_KEY)]
    header = f"{len(steps)} steps ({steps[0]}-{steps[-1]})"
    if step_times:
        header += f", wall time {format_duration(math.fsum(step_times))} (sum of {STEP_TIME_KEY})"
    table = [("metric", "steps", "first", "last", "best", "(step)", "mean")]
    for row in rows:
        table.append(
            (
                row.key,
                str(row.count),
                _number(row.first),
                _number(row.last),
                "-" if row.best is None else _number(row.best),
                "" if row.best_step is None else f"@{row.best_step}",
                _number(row.mean),
            )
        )
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    lines = [
        "  ".join(
            cell.ljust(width) if i == 0 else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(line, widths, strict=True))
        ).rstrip()
        for line in table
    ]
    return "\n".join([header, *lines])


def _number(value: float) -> str:
    return f"{value:.4g}"


PLOT_LIMIT = 1e30


def plot_metrics(records: Sequence[Record], path: str | Path, *, title: str = "") -> None:
    """Write a PNG with panels for score and validation score, losses, KL and response length
    over steps. Renders with Agg through matplotlib's object API: no pyplot, no global state."""
    path = check_plot_target(path)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 7.5), layout="constrained")
    FigureCanvasAgg(figure)
    if title:
        figure.suptitle(title)
    for axes, (name, keys) in zip(figure.subplots(2, 2).flat, PANELS, strict=True):
        axes.set_title(name)
        axes.set_xlabel("step")
        axes.grid(alpha=0.3)
        drawn = _draw_panel(axes, records, keys)
        if not drawn:
            axes.text(0.5, 0.5, "not logged", ha="center", va="center", transform=axes.transAxes)
        elif len(drawn) == 1:
            axes.set_ylabel(drawn[0].get_label())
        elif len(drawn) > 1:
            axes.legend(handles=drawn, fontsize="small")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(path, dpi=110)
    except OSError as exc:
        raise _unwritable(path, exc.strerror) from None


def check_plot_target(path: str | Path) -> Path:
    """The PNG path, once it is known to be writable and matplotlib importable: checked
    before any work, so a bad --plot fails before the table is printed. Its missing folders
    are made as the plot is written (:func:`plot_metrics`), as a run makes its output folder,
    not here: a command refused later (a run folder that does not exist) leaves none."""
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise UserError(f"--plot writes a PNG: name the file *.png, not {shown(str(path))}")
    import_extra("matplotlib", feature="--plot", extra="plot")
    try:  # a relative path is the current folder's, which may have been deleted since
        where = path.absolute()
    except FileNotFoundError:
        raise _unwritable(path, "the current folder no longer exists") from None
    try:  # the folder the missing ones would be made in: the root at the latest
        folder = next(p for p in (where.parent, *where.parent.parents) if p.exists())
    except OSError as exc:  # a name too long for the file system
        raise _unwritable(path, exc.strerror) from None
    if not folder.is_dir():
        raise _unwritable(path, f"{shown(str(folder))} is not a folder")
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise _unwritable(path, "permission denied")
    return path


def _unwritable(path: Path, why: str | None) -> UserError:
    """The line for a --plot file that cannot be written, and ``why``."""
    return UserError(f"--plot {shown(str(path))}: cannot write: {why}")


def _draw_panel(axes: Any, records: Sequence[Record], keys: Sequence[str]) -> list[Any]:
    """Draw the present ``keys``; a second metric of a very different scale (vf_loss next to a
    near-zero pg_loss) gets its own y axis on the right. Returns the drawn lines."""
    drawn: list[Any] = []
    first_scale = 0.0
    for key in keys:
        series = _series(records, key)
        if not series:
            continue
        steps = [step for step, _ in series]
        # A diverged run's 1e308 or inf has no place on an axis (matplotlib fails to lay
        # one out): such points are left as gaps in the line.
        values = [v if abs(v) <= PLOT_LIMIT else math.nan for _, v in series]
        scale = max((abs(v) for v in values if math.isfinite(v)), default=0.0)
        target = axes
        if not drawn:
            first_scale = scale
        elif len(drawn) == 1 and not first_scale / 10 <= scale <= first_scale * 10:
            target = axes.twinx()
            axes.set_ylabel(drawn[0].get_label(), color="C0")
            target.set_ylabel(key, color="C1")
        (line,) = target.plot(
            steps,
            values,
            color=f"C{len(drawn)}",
            label=key,
            marker="o" if len(series) <= 30 or key.startswith("val/") else None,
            markersize=3,
        )
        drawn.append(line)
        if key == "response_length/mean":
            low, high = (
                _series(records, "response_length/min"),
                _series(records, "response_length/max"),
            )
            if low and high:
                axes.fill_between(
                    [s for s, _ in low],
                    [v for _, v in low],
                    [v for _, v in high],
                    alpha=0.2,
                    color="C0",
                )
    return drawn


def add_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``verlite metrics`` on the CLI's subparsers."""
    parser = subparsers.add_parser(
        "metrics",
        help="summarize a run's metrics (table, optional PNG plot)",
        description="Read OUTPUT_DIR/metrics.jsonl (also while the run is going) or a Ray job's "
        "logged metrics (--job, --address) and print first/last/best/mean of the main metrics, "
        "the number of steps and the wall time.",
    )
    parser.add_argument(
        "output_dir",
        nargs="?",
        metavar="OUTPUT_DIR",
        help="the run's trainer.output_dir (or its metrics.jsonl)",
    )
    parser.add_argument(
        "--plot",
        metavar="FILE.png",
        help="also write the main curves to a PNG; folders missing from its path are made, as "
        "a run's trainer.output_dir is",
    )
    parser.add_argument(
        "--keys",
        metavar="k1,k2",
        help="comma-separated metrics to show instead of the main ones (patterns such as "
        "'timing_s/*' allowed)",
    )
    parser.add_argument("--job", metavar="ID", help="read the metrics of this Ray job instead")
    parser.add_argument(
        "--address",
        metavar="URL",
        help="Ray dashboard address of --job (default: the RAY_ADDRESS variable)",
    )
    parser.set_defaults(handler=cmd_metrics)


def cmd_metrics(args: argparse.Namespace) -> int:
    """Print the summary table (and write the plot) of a run folder or a Ray job."""
    keys = None
    if args.keys is not None:
        keys = [k.strip() for k in args.keys.split(",") if k.strip()]
        if not keys:
            raise UserError(f"--keys {shown(args.keys)} names no metric; give k1,k2 or a pattern")
    if args.plot:
        check_plot_target(args.plot)
    if args.job is not None:
        if args.output_dir is not None:
            raise UserError("give either OUTPUT_DIR or --job, not both")
        from verlite.jobs import read_job_metrics

        records = read_job_metrics(args.address, args.job)
        title = f"job {args.job}"
    else:
        if args.output_dir is None:
            raise UserError("give the run's OUTPUT_DIR (or --job ID [--address URL])")
        if args.address is not None:
            raise UserError("--address goes with --job")
        records, title = metrics_log.read(args.output_dir), str(args.output_dir)
    print(format_summary(records, summary_rows(records, keys)))
    if args.plot:
        plot_metrics(records, args.plot, title=title)
        print(f"wrote {args.plot}")
    return 0
