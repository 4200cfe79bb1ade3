"""The job commands of the ``verlite`` CLI: ``submit``, ``status``, ``logs``, ``stop``, ``list``.

Each handler takes the parsed arguments and returns the exit code; problems raise
:class:`~verlite.errors.UserError` (one line on stderr, exit 2 in ``verlite.cli.main``).
"""

from __future__ import annotations

import argparse
import math
import sys
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from verlite.jobs.entrypoint import shown_command
from verlite.jobs.resubmit import driver_died, links, resubmission
from verlite.jobs.server import RETRY_S, JobServer, connect, printable

if TYPE_CHECKING:
    from verlite.jobs.submission import Submission

ADDRESS_HELP = "Ray dashboard URL, e.g. http://HEAD:8265 (default: $RAY_ADDRESS)"
TOKEN_NOTE = (
    "On clusters with token authentication, set RAY_AUTH_MODE=token and provide the token in "
    "RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token, as for any Ray client."
)


def _server_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default=None, help=ADDRESS_HELP)
    parser.add_argument(
        "--retry-for",
        metavar="SECONDS",
        type=_seconds,
        default=RETRY_S,
        help="how long to retry a job server that answers busy (a head still starting its "
        "job agent, HTTP 502/503/504, a reset connection); a refused token or an unknown job "
        f"fails at once (default: {RETRY_S:g})",
    )


def _count(text: str) -> int:
    if not text.isdigit() or int(text) > 1000:
        raise argparse.ArgumentTypeError(f"expected a whole number from 0 to 1000, got {text!r}")
    return int(text)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value <= 86_400:
        raise argparse.ArgumentTypeError(f"expected seconds from 0 to 86400, got {text!r}")
    return value


def add_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``submit``, ``status``, ``logs``, ``stop`` and ``list`` on the CLI's subparsers."""
    submit = subparsers.add_parser(
        "submit",
        help="run `verlite train` as a job on a Ray cluster",
        description="Ship the project and the config to a Ray cluster and start `verlite train` there "
        "as a Ray job, with metrics in its log (trainer.loggers gains logline). The config is checked "
        "here first. Prints the submission id. " + TOKEN_NOTE,
    )
    _server_arguments(submit)
    submit.add_argument("--config", required=True, help="run config YAML, inside the working dir")
    submit.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    submit.add_argument(
        "--wait",
        action="store_true",
        help="follow the job's log until it ends; exit 0 if it SUCCEEDED, 1 otherwise",
    )
    submit.add_argument(
        "--max-restarts",
        metavar="N",
        type=_count,
        default=None,
        help="set trainer.max_restarts=N (restart in place when a worker or node is lost); "
        "with --wait, also resubmit the job with trainer.resume=auto, up to N times, when its "
        "driver dies (the job FAILED without verlite ending it), as jobs ID-r1, ID-r2, ...",
    )
    submit.add_argument(
        "--runtime-env", metavar="FILE", help="YAML runtime_env merged in (env_vars, pip, ...)"
    )
    submit.add_argument("--submission-id", metavar="ID", help="job id to use (default: generated)")
    submit.add_argument(
        "--working-dir",
        type=Path,
        default=None,
        help="directory shipped as the job's working directory (default: this verlite checkout)",
    )
    submit.set_defaults(handler=cmd_submit)

    status = subparsers.add_parser(
        "status",
        help="print a job's status",
        description="Print PENDING, RUNNING, SUCCEEDED, FAILED or STOPPED.",
    )
    status.add_argument("job_id", metavar="ID", help="submission id")
    _server_arguments(status)
    status.set_defaults(handler=cmd_status)

    logs = subparsers.add_parser(
        "logs", help="print a job's log", description="Print a job's driver log."
    )
    logs.add_argument("job_id", metavar="ID", help="submission id")
    _server_arguments(logs)
    logs.add_argument(
        "--follow",
        action="store_true",
        help="keep printing until the job ends; exit 0 if it SUCCEEDED, 1 otherwise",
    )
    logs.set_defaults(handler=cmd_logs)

    stop = subparsers.add_parser(
        "stop", help="stop a job", description="Ask a running job to stop."
    )
    stop.add_argument("job_id", metavar="ID", help="submission id")
    _server_arguments(stop)
    stop.set_defaults(handler=cmd_stop)

    jobs = subparsers.add_parser(
        "list", help="list a cluster's jobs", description="List the submitted jobs, oldest first."
    )
    _server_arguments(jobs)
    jobs.set_defaults(handler=cmd_list)


def cmd_submit(args: argparse.Namespace) -> int:
    # Checking the config loads torch (the config validates names against the loss and
    # advantage registries); the other job commands answer without it.
    from verlite.jobs.submission import default_working_dir, new_submission_id, prepare_submission

    job_id = args.submission_id or new_submission_id()
    submission = prepare_submission(
        config=args.config,
        overrides=args.overrides,
        working_dir=args.working_dir or default_working_dir(),
        job_id=job_id,
        runtime_env_file=args.runtime_env,
        max_restarts=args.max_restarts,
        resubmit=args.wait and bool(args.max_restarts),
    )
    server = connect(args.address, retry_s=args.retry_for)
    server.submit(
        entrypoint=submission.entrypoint,
        runtime_env=submission.runtime_env,
        submission_id=job_id,
    )
    print(job_id, flush=True)
    where = f"--address {server.url}"
    if not args.wait:
        print(
            f"output: {submission.output_dir}"
            f"{'' if Path(submission.output_dir).is_absolute() else ' (in the job working directory)'}\n"
            f"follow: verlite logs {job_id} --follow {where}\n"
            f"status: verlite status {job_id} {where}\n"
            f"stop:   verlite stop {job_id} {where}",
            file=sys.stderr,
        )
        return 0
    return _follow(server, submission, job_id, args.max_restarts or 0)


def _follow(server: JobServer, submission: Submission, first: str, max_restarts: int) -> int:
    """Follow job ``first`` to its end, resubmitting it while its driver dies, up to
    ``max_restarts`` times; 0 when the last job SUCCEEDED, 1 otherwise."""
    from verlite.jobs.submission import RESUME_OVERRIDES

    job_id, attempt = first, 0
    while True:
        print(f"following {job_id}; Ctrl-C stops following, not the job", file=sys.stderr)
        status = _follow_to_end(server, job_id)
        if status == "SUCCEEDED":
            return 0
        info = server.info(job_id)
        if status != "FAILED" or attempt == max_restarts or not driver_died(info):
            return 1
        attempt += 1
        previous = job_id
        job_id, metadata = resubmission(first, previous, attempt)
        server.submit(
            entrypoint=submission.resume_entrypoint,
            runtime_env=submission.runtime_env,
            submission_id=job_id,
            metadata=metadata,
        )
        print(
            f"job {previous}'s driver died (exit code {info.get('driver_exit_code')}); "
            f"resubmitted as {job_id} ({attempt} of {max_restarts}, --max-restarts) with "
            f"{' '.join(RESUME_OVERRIDES)}: it continues from the latest checkpoint in "
            f"{submission.output_dir}, or, where the job saved none, starts from the first "
            "step with the job's files moved aside (its log says which)",
            file=sys.stderr,
            flush=True,
        )


def _follow_to_end(server: JobServer, job_id: str) -> str:
    """Copy job ``job_id``'s log to stdout until it ends, then its status to stderr; the status."""
    status = server.follow(job_id, sys.stdout)
    print(f"job {job_id} {printable(status)}", file=sys.stderr)
    return status


def cmd_status(args: argparse.Namespace) -> int:
    server = connect(args.address, retry_s=args.retry_for)
    info = server.info(args.job_id)
    print(printable(info["status"]))
    if info["status"] == "FAILED" and info.get("message"):
        print(printable(info["message"]), file=sys.stderr)
    jobs = server.jobs() if info["status"] == "FAILED" else []
    for line in links(args.job_id, info, jobs):
        print(printable(line), file=sys.stderr)
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    server = connect(args.address, retry_s=args.retry_for)
    if args.follow:
        return 0 if _follow_to_end(server, args.job_id) == "SUCCEEDED" else 1
    sys.stdout.write(server.logs(args.job_id))
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    server = connect(args.address, retry_s=args.retry_for)
    if server.stop(args.job_id):
        print(f"stop requested for {args.job_id}")
    else:
        print(f"{args.job_id} had already ended: {printable(server.info(args.job_id)['status'])}")
    return 0


def _start_ms(job: dict[str, Any]) -> float | None:
    """The job's start time in ms since the epoch, when the server gave a plausible one."""
    start = job.get("start_time")
    if isinstance(start, bool) or not isinstance(start, int | float):
        return None
    return start if 0 < start < 1e14 else None  # 1e14 ms is the year 5138


def cmd_list(args: argparse.Namespace) -> int:
    # DRIVER entries are the trainers' own connections to Ray, not submitted jobs.
    jobs = [
        job
        for job in connect(args.address, retry_s=args.retry_for).jobs()
        if job.get("type") == "SUBMISSION"
    ]
    if not jobs:
        print("no jobs", file=sys.stderr)
        return 0
    rows = [("ID", "STATUS", "STARTED", "COMMAND")]
    for job in sorted(jobs, key=lambda j: _start_ms(j) or 0):
        start = _start_ms(job)
        started = datetime.fromtimestamp(start / 1000).isoformat(" ", "seconds") if start else "-"
        fields = (job.get("submission_id") or "-", job["status"], shown_command(job["entrypoint"]))
        submission_id, status, command = map(printable, fields)
        rows.append((submission_id, status, started, command))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for *cells, command in rows:
        print("  ".join([*(c.ljust(w) for c, w in zip(cells, widths, strict=True)), command]))
    return 0
