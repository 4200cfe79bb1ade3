"""Where metrics go: a compact console line with a progress bar and ETA, and metrics.jsonl.

Every logger receives the same ``(step, metrics)`` pairs from the driver; metrics are plain
floats already reduced over micro-batches, ranks and mini-batches.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol, TextIO

# Shown on the console line, in this order, when present.
CONSOLE_KEYS = (
    ("critic/score/mean", "score"),
    ("val/score/mean", "val"),
    ("actor/pg_loss", "pg_loss"),
    ("critic/vf_loss", "vf_loss"),
    ("actor/kl_loss", "kl"),
    ("actor/entropy", "entropy"),
    ("response_length/mean", "resp_len"),
)


class Logger(Protocol):
    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


class JsonlLogger:
    """One JSON object per step (with a ``step`` key), flushed at once so readers see it live."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = path.open("a", encoding="utf-8")

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.file.write(json.dumps({"step": step, **metrics}, allow_nan=True) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


METRICS_LINE_MARKER = "VERLITE_METRICS "


class LogLineLogger:
    """One ``VERLITE_METRICS {json}`` line per step on stdout: a job's driver log carries its
    metrics, so they can be read back from a cluster without access to its files."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stdout

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        print(
            METRICS_LINE_MARKER + json.dumps({"step": step, **metrics}),
            file=self.stream,
            flush=True,
        )

    def close(self) -> None:
        pass


class ConsoleLogger:
    """A compact line per step: progress bar, ETA and the headline metrics."""

    def __init__(
        self, *, total_steps: int, start_step: int = 0, stream: TextIO | None = None
    ) -> None:
        self.total_steps = total_steps
        self.start_step = start_step
        self.stream = stream or sys.stdout
        self.started = time.monotonic()

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        done = step - self.start_step
        elapsed = time.monotonic() - self.started
        remaining = (self.total_steps - step) * elapsed / max(done, 1)
        parts = [f"{_bar(step, self.total_steps)} step {step}/{self.total_steps}"]
        parts += [f"{label} {metrics[key]:.3g}" for key, label in CONSOLE_KEYS if key in metrics]
        parts.append(f"{elapsed / max(done, 1):.1f}s/step ETA {_duration(remaining)}")
        print(" | ".join(parts), file=self.stream, flush=True)

    def close(self) -> None:
        pass


def _bar(step: int, total: int, width: int = 20) -> str:
    filled = min(width, round(width * step / max(total, 1)))
    return "[" + "#" * filled + "-" * (width - filled) + "]"


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class Tracker:
    """Fans metrics out to the configured loggers."""

    def __init__(
        self, names: Sequence[str], *, output_dir: Path, total_steps: int, start_step: int = 0
    ) -> None:
        self.loggers: list[Logger] = []
        for name in names:
            if name == "console":
                self.loggers.append(ConsoleLogger(total_steps=total_steps, start_step=start_step))
            elif name == "jsonl":
                self.loggers.append(JsonlLogger(output_dir / "metrics.jsonl"))
            elif name == "logline":
                self.loggers.append(LogLineLogger())
            else:
                raise ValueError(
                    f"logger {name!r} is not available yet; use console, jsonl or logline"
                )

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for logger in self.loggers:
            logger.log(step, metrics)

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()
