"""A job's metrics read back from its driver log, where the ``logline`` logger writes one
``VERLITE_METRICS {json}`` line per step."""

from __future__ import annotations

import json
from typing import Any

from verlite.jobs.server import connect
from verlite.tracking import METRICS_LINE_MARKER


def parse_metrics(log: str) -> list[dict[str, Any]]:
    """One record per step, in step order; a later line for a step replaces an earlier one
    (a resumed run logs its steps again)."""
    by_step: dict[int, dict[str, Any]] = {}
    for line in log.splitlines():
        _, marker, payload = line.partition(METRICS_LINE_MARKER)
        if not marker:
            continue
        try:
            record = json.loads(payload)
        except json.JSONDecodeError:
            continue  # the line the job is still writing when a running job is read
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            by_step[record["step"]] = record
    return [by_step[step] for step in sorted(by_step)]


def read_job_metrics(address: str | None, job_id: str) -> list[dict[str, Any]]:
    """The metrics of job ``job_id`` on the cluster whose dashboard is at ``address``
    (None: ``$RAY_ADDRESS``); raises :class:`~verlite.jobs.server.JobsError` (a UserError)."""
    return parse_metrics(connect(address).logs(job_id))
