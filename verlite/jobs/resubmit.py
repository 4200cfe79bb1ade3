"""Jobs whose driver died, resubmitted (``verlite submit --max-restarts N --wait``), and the
links between a job and its resubmissions that ``verlite status`` prints.

A resubmission of job ``ID`` is job ``ID-rK`` (the K-th), whose metadata names the job it
replaces and the first of the line; it runs the same command with ``trainer.resume=auto``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

RESUBMISSION_OF = "verlite_resubmission_of"
FIRST_SUBMISSION = "verlite_first_submission"
ATTEMPT = "verlite_attempt"
# Ray's error types (``JobErrorType``) of a job whose driver ran: lost with its supervisor,
# or ended by its command's exit.
_SUPERVISOR_DIED = "JOB_SUPERVISOR_ACTOR_DIED"
_COMMAND_ENDED = "JOB_ENTRYPOINT_COMMAND_ERROR"


def driver_died(info: dict[str, Any]) -> bool:
    """Whether a FAILED job's driver died rather than ended the run itself.

    Died: lost with its job supervisor (the head's job agent or node), or killed by a signal
    (a negative exit code, or above 128 through a shell). ``verlite train`` itself exits 1
    for a failure it names (its restarts spent included) and 2 for bad input, which a
    resubmission would only repeat, as it would a job that never started its driver (a
    runtime environment that cannot be set up, a supervisor that cannot be placed).
    """
    kind = info.get("error_type")
    if kind == _SUPERVISOR_DIED:
        return True
    code = info.get("driver_exit_code")
    return kind == _COMMAND_ENDED and isinstance(code, int) and (code < 0 or code > 128)


def resubmission(first: str, previous: str, attempt: int) -> tuple[str, dict[str, str]]:
    """The id and metadata of the ``attempt``-th resubmission of job ``first``."""
    return f"{first}-r{attempt}", {
        RESUBMISSION_OF: previous,
        FIRST_SUBMISSION: first,
        ATTEMPT: str(attempt),
    }


def links(job_id: str, info: dict[str, Any], jobs: Sequence[dict[str, Any]]) -> list[str]:
    """What ``verlite status`` says of job ``job_id``'s line of resubmissions: the job it
    replaced, and the job that replaced it."""
    lines = []
    metadata = info.get("metadata") or {}
    if RESUBMISSION_OF in metadata:
        lines.append(
            f"resubmission {metadata.get(ATTEMPT, '?')} of {metadata.get(FIRST_SUBMISSION, '?')}, "
            f"replacing {metadata[RESUBMISSION_OF]}, whose driver died"
        )
    for job in jobs:
        if (job.get("metadata") or {}).get(RESUBMISSION_OF) == job_id:
            lines.append(f"resubmitted as {job.get('submission_id')}: {job['status']}")
    return lines
