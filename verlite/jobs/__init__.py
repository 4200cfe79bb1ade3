"""Jobs on real Ray clusters: submit ``verlite train`` through the Ray Job Submission API, watch
and stop it, and read its metrics back from its log.

``add_job_commands`` registers the CLI commands; ``read_job_metrics`` serves
``verlite metrics --job``.
"""

from verlite.jobs.commands import add_job_commands
from verlite.jobs.server import JobsError, JobServer, connect, read_job_metrics, resolve_address

__all__ = [
    "JobServer",
    "JobsError",
    "add_job_commands",
    "connect",
    "read_job_metrics",
    "resolve_address",
]
