"""Jobs on real Ray clusters: submit ``verlite train`` through the Ray Job Submission API, watch
and stop it, and read its metrics back from its log.

``verlite.jobs.commands`` holds the CLI commands; ``read_job_metrics`` serves
``verlite metrics --job``.
"""

from verlite.jobs.server import JobsError, JobServer, connect, read_job_metrics, resolve_address

__all__ = [
    "JobServer",
    "JobsError",
    "connect",
    "read_job_metrics",
    "resolve_address",
]
