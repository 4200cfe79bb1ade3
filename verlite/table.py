"""Plain text for the terminal: tables of left-aligned columns two spaces apart, durations."""

from __future__ import annotations

import math
from collections.abc import Sequence


def format_table(rows: Sequence[Sequence[str]]) -> str:
    """The rows (the first a header, usually) as aligned lines, without trailing spaces."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def format_duration(seconds: float) -> str:
    """``12.3 s`` under a minute, then ``2m07s`` and ``1h02m03s`` (whole seconds, rounded);
    ``?`` for a duration not known (not finite)."""
    if not math.isfinite(seconds):
        return "?"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"
