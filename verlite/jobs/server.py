"""One Ray cluster's job server as verlite talks to it: the address, a bounded reachability
check, Ray's token authentication, the dashboard's job API (and Ray's SDK to submit and to
follow a log), with failures turned into one-line :class:`JobsError` messages from which
the token and any authorization header are masked."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO, TypeVar
from urllib.parse import quote, urlsplit

import requests

from verlite.errors import UserError, one_line, shown
from verlite.reachable import is_loopback_host
from verlite.records import metrics_log
from verlite.records.metrics_log import Record
from verlite.redaction import redact_text

if TYPE_CHECKING:
    from ray.job_submission import JobSubmissionClient

ADDRESS_ENV = "RAY_ADDRESS"
# Ray's token settings (Ray >= 2.52): the mode switch, then the token sources in Ray's order.
AUTH_MODE_ENV = "RAY_AUTH_MODE"
TOKEN_ENV = "RAY_AUTH_TOKEN"
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
DEFAULT_TOKEN_FILE = "~/.ray/auth_token"
TOKEN_SOURCES = f"{TOKEN_ENV}, {TOKEN_PATH_ENV} or {DEFAULT_TOKEN_FILE}"
# The reachability check's limits: the Ray SDK sets no timeout on its requests, so an address
# that accepts nothing, or accepts and never answers, is caught here within these bounds.
CONNECT_TIMEOUT_S = 4.0
READ_TIMEOUT_S = 4.0
POLL_INTERVAL_S = 1.0
# A job API call, the whole answer read (a log of a long run is the largest answer).
API_TIMEOUT_S = 30.0
MAX_ANSWER_BYTES = 256 << 20
_T = TypeVar("_T")
RAY_CHATTY_LOGGERS = ("ray", "ray.dashboard.modules.dashboard_sdk", "ray.dashboard.modules.job.sdk")
# The SDK reports a failed request as RuntimeError("Request failed with status code N: body").
_HTTP_ERROR = re.compile(r"status code (\d+): (.*)", re.DOTALL)


class JobsError(UserError):
    """A cluster or job problem the user can fix: the address, the token, the job id."""


class JobServerBusy(JobsError):
    """An answer that a moment later may be different: a head still starting its job agent
    (HTTP 500 "No available agent"), a gateway or server out of service (502, 503, 504), a
    connection reset. Retried for up to ``retry_s`` seconds; other failures are not."""


# How long a job command retries a busy job server by default (a fresh head takes ~20 s to
# start its job agent), and the longest pause between two tries.
RETRY_S = 60.0
MAX_RETRY_PAUSE_S = 8.0
_BUSY_CODES = (502, 503, 504)
_BUSY_500 = re.compile(r"no available agent|try again", re.IGNORECASE)


def resolve_address(address: str | None) -> str:
    """The dashboard URL of the cluster: ``address``, else ``$RAY_ADDRESS``; ``host:port`` means http."""
    address = address or os.environ.get(ADDRESS_ENV)
    if not address:
        raise JobsError(
            "no cluster address: pass --address http://HEAD:8265 (the Ray dashboard) or set RAY_ADDRESS"
        )
    if "://" not in address and address != "auto":
        address = "http://" + address
    if not address.startswith(("http://", "https://")):
        raise JobsError(
            f"expected the Ray dashboard address, e.g. http://HEAD:8265, got {address!r}"
        )
    return address.rstrip("/")


def read_job_metrics(address: str | None, job_id: str) -> list[Record]:
    """The metrics of job ``job_id`` on the cluster whose dashboard is at ``address``
    (None: ``$RAY_ADDRESS``): what ``verlite metrics --job`` shows. A job that has logged none
    is refused in one line with its status: one still starting, or one that ended first."""
    server = connect(address)
    records = server.metrics(job_id)
    if not records:
        status = printable(server.info(job_id)["status"])
        raise JobsError(
            f"job {shown(job_id)} has logged no metrics (status {status}); "
            f"`verlite logs {job_id}` shows its output"
        )
    return records


def printable(value: object) -> str:
    """A value from the job server as one line of plain text: control characters (line
    breaks, terminal escape sequences that would clear or retitle the terminal) escaped."""
    text = str(value)
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def connect(address: str | None, *, retry_s: float = RETRY_S) -> JobServer:
    """Reach the job server at ``address`` (see :func:`resolve_address`) or fail in seconds."""
    url = resolve_address(address)
    _check_reachable(url)
    return JobServer(url, retry_s=retry_s)


class JobServer:
    """The job calls verlite makes, each failing with a :class:`JobsError`.

    Reading and stopping jobs are plain requests to the dashboard's job API, so those commands
    answer without loading Ray; submitting (which packages the working directory) and
    following a log stream go through Ray's Job Submission SDK.
    """

    def __init__(self, url: str, *, retry_s: float = RETRY_S) -> None:
        self.url = url
        self.retry_s = retry_s
        self._sdk: JobSubmissionClient | None = None

    def submit(
        self,
        *,
        entrypoint: str,
        runtime_env: dict[str, Any],
        submission_id: str,
        metadata: dict[str, str] | None = None,
    ) -> None:
        # One id for every try: a try whose answer was lost may have created the job, and
        # the next then finds it instead of starting a second one.
        first = True

        def attempt() -> None:
            nonlocal first
            try:
                with _errors(self.url), _direct(self.url):
                    self.sdk.submit_job(
                        entrypoint=entrypoint,
                        runtime_env=runtime_env,
                        submission_id=submission_id,
                        metadata=metadata,
                    )
            except JobsError as exc:
                if first or "already exists" not in str(exc):
                    raise
            finally:
                first = False

        self._retrying(attempt)

    def _retrying(self, attempt: Callable[[], _T]) -> _T:
        """``attempt()``, tried again while the server is busy, for up to ``retry_s`` seconds."""
        deadline = time.monotonic() + self.retry_s
        pause = 1.0
        while True:
            try:
                return attempt()
            except JobServerBusy as exc:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise JobsError(
                        f"{exc} (still, after retrying for {self.retry_s:g} s)"
                    ) from None
                if pause == 1.0:
                    print(f"verlite: {exc}; retrying for up to {self.retry_s:g} s", file=sys.stderr)
                time.sleep(min(pause, left))
                pause = min(2 * pause, MAX_RETRY_PAUSE_S)

    def info(self, job_id: str) -> dict[str, Any]:
        """The job's record: ``status``, ``message``, ``entrypoint``, ``start_time``, ..."""
        return self._job_record(self._job_request("GET", job_id))

    def logs(self, job_id: str) -> str:
        try:
            return str(self._job_request("GET", job_id, "/logs").get("logs", ""))
        except JobsError as exc:
            if "UnicodeDecodeError" not in str(exc):
                raise
            # Ray's server reads the log file as UTF-8; its traceback says no more than this.
            raise JobsError(
                f"job {job_id!r}'s log holds bytes that are not UTF-8 text, and the job server "
                f"at {self.url} cannot read it back (nor its metrics); jobs verlite submits "
                "write their output as UTF-8"
            ) from None

    def metrics(self, job_id: str) -> list[Record]:
        """The job's metrics records, read from the marked lines of its driver log."""
        return metrics_log.parse_marked_lines(self.logs(job_id), source=f"job {job_id!r}'s log")

    def stop(self, job_id: str) -> bool:
        """Ask the job to stop; False when it had already ended."""
        return bool(self._job_request("POST", job_id, "/stop").get("stopped"))

    def jobs(self) -> list[dict[str, Any]]:
        jobs = self._request("GET", "/api/jobs/")
        if not isinstance(jobs, list):
            raise JobsError(
                f"the job server at {self.url} answered a {type(jobs).__name__}, not a list of jobs"
            )
        return [self._job_record(job) for job in jobs]

    def follow(self, job_id: str, out: TextIO) -> str:
        """Copy the job's log to ``out`` as it grows until the job ends; return its final status."""
        self.info(job_id)  # an unknown id fails here, in one line, not in the websocket
        with _errors(self.url, job_id), _direct(self.url):
            asyncio.run(self._tail(job_id, out))
        from ray.job_submission import JobStatus  # loaded with the SDK the tail used

        # The log stream closes when the job ends; its status may trail by a moment.
        while not JobStatus(status := str(self.info(job_id)["status"])).is_terminal():
            time.sleep(POLL_INTERVAL_S)
        return status

    async def _tail(self, job_id: str, out: TextIO) -> None:
        async for chunk in self.sdk.tail_job_logs(job_id):
            out.write(chunk)
            out.flush()

    def _job_record(self, value: Any) -> dict[str, Any]:
        """A job record as the commands read it: a mapping with a status and an entrypoint."""
        if not isinstance(value, dict) or not {"status", "entrypoint"} <= value.keys():
            shown = redact_text(repr(value), [_token() or ""])[:200]
            raise JobsError(
                f"the job server at {self.url} answered a job record of another shape: {shown}"
            )
        return value

    @property
    def sdk(self) -> JobSubmissionClient:
        """Ray's client, loaded on first use (it takes over a second to import)."""
        if self._sdk is None:
            from ray.job_submission import JobSubmissionClient

            # The SDK logs each package upload, default exclude and websocket close on the
            # console; its problems reach the user as JobsError instead.
            for name in RAY_CHATTY_LOGGERS:
                logging.getLogger(name).setLevel(logging.ERROR)
            with _errors(self.url), _address_env_unset(), _direct(self.url):
                self._sdk = JobSubmissionClient(self.url)
        return self._sdk

    def _job_request(self, method: str, job_id: str, suffix: str = "") -> Any:
        return self._request(method, f"/api/jobs/{quote(job_id, safe='')}{suffix}", job_id)

    def _request(self, method: str, path: str, job_id: str | None = None) -> Any:
        """A call of the dashboard's job API with the user's Ray token, tried again while the
        server is busy; its JSON answer."""
        return self._retrying(lambda: self._request_once(method, path, job_id))

    def _request_once(self, method: str, path: str, job_id: str | None) -> Any:
        token = _token()
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        try:
            code, answer = _answer(method, self.url + path, headers, API_TIMEOUT_S)
        except requests.Timeout:
            raise JobsError(
                f"no complete answer from {self.url} within {API_TIMEOUT_S:g} s"
            ) from None
        except requests.ConnectionError as exc:
            raise JobServerBusy(
                f"lost the connection to {self.url} ({type(exc).__name__})"
            ) from None
        except requests.RequestException as exc:
            raise JobsError(f"lost the connection to {self.url} ({type(exc).__name__})") from None
        if code in (401, 403):
            raise JobsError(_auth_problem(self.url, rejected=code == 403))
        if code == 404 and job_id is not None:
            raise JobsError(f"no job {job_id!r} on {self.url} (`verlite list` shows its jobs)")
        body = redact_text(one_line(answer.decode("utf-8", "replace")), [token or ""])
        if not 200 <= code < 400:
            raise _http_error(self.url, code, body)
        try:
            return json.loads(answer)
        except ValueError:
            raise JobsError(
                f"the job server at {self.url} answered {method} {path} with something that is "
                f"not JSON: {body[:100]!r}"
            ) from None


def _answer(method: str, url: str, headers: dict[str, str], seconds: float) -> tuple[int, bytes]:
    """The status and the whole body of one request, read within ``seconds`` and
    :data:`MAX_ANSWER_BYTES`: a read timeout bounds each wait for data, not a server that
    trickles a byte at a time, or one that never stops sending. Raises ``requests.Timeout``."""
    deadline = time.monotonic() + seconds
    with (
        _direct(url),
        requests.request(
            method, url, headers=headers, timeout=(CONNECT_TIMEOUT_S, seconds), stream=True
        ) as response,
    ):
        body = bytearray()
        while chunk := response.raw.read1(1 << 20, decode_content=True):
            body += chunk
            if len(body) > MAX_ANSWER_BYTES:
                raise JobsError(
                    f"the server at {url} answered more than {MAX_ANSWER_BYTES >> 20} MiB; "
                    "is it the Ray dashboard?"
                )
            if time.monotonic() > deadline:
                raise requests.Timeout
        return response.status_code, bytes(body)


def _check_reachable(url: str) -> None:
    try:
        code, answer = _answer("GET", f"{url}/api/version", {}, READ_TIMEOUT_S)
    except requests.Timeout:
        raise JobsError(
            f"no answer from {url} within {CONNECT_TIMEOUT_S + READ_TIMEOUT_S:g} s; "
            "is it the Ray dashboard address (usually port 8265)?"
        ) from None
    except requests.RequestException as exc:
        raise JobsError(f"cannot connect to {url}: {_connection_problem(exc)}") from None
    if code in (401, 403):
        return  # a dashboard with token authentication on; the SDK sends the token
    if code != 200 or "ray_version" not in _json_object(answer):
        raise JobsError(
            f"{url} is not a Ray dashboard (GET /api/version answered HTTP {code}); "
            "pass the dashboard address, usually http://HEAD:8265"
        )


def _connection_problem(exc: requests.RequestException) -> str:
    text = str(exc)
    if isinstance(exc, requests.exceptions.SSLError):
        return "TLS certificate verification failed"
    if "NameResolutionError" in text or "Name or service not known" in text:
        return "unknown host"
    if "Connection refused" in text:
        return "connection refused (is the cluster running, and is this the dashboard port?)"
    return "the connection failed (is this the Ray dashboard port, usually 8265?)"


def _json_object(answer: bytes) -> dict[str, Any]:
    try:
        body = json.loads(answer)
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


@contextlib.contextmanager
def _address_env_unset() -> Iterator[None]:
    # JobSubmissionClient replaces the address it is given by $RAY_API_SERVER_ADDRESS or
    # $RAY_ADDRESS when either is set; the address resolved above must be the one used.
    saved = {
        name: os.environ.pop(name)
        for name in ("RAY_API_SERVER_ADDRESS", ADDRESS_ENV)
        if name in os.environ
    }
    try:
        yield
    finally:
        os.environ.update(saved)


@contextlib.contextmanager
def _direct(url: str) -> Iterator[None]:
    """Requests to a dashboard on this machine (a local head, an SSH tunnel's end) go to it
    directly: a proxy of the environment (http_proxy) would get them, the Ray token in
    cleartext with them, and could not reach it. Requests and Ray's SDK read ``no_proxy``
    when they send."""
    host = urlsplit(url).hostname or ""
    if not is_loopback_host(host):
        yield
        return
    saved = {name: os.environ.get(name) for name in ("no_proxy", "NO_PROXY")}
    for name, value in saved.items():
        os.environ[name] = f"{value},{host}" if value else host
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def _errors(url: str, job_id: str | None = None) -> Iterator[None]:
    """Turn the SDK's failures into one line. Messages are built here from the status and the
    server's answer, never from request headers, so the token cannot leak into them."""
    import aiohttp
    from ray.exceptions import AuthenticationError

    try:
        yield
    except AuthenticationError as exc:
        # Ray's message starts "Authentication failed" when the cluster refused the token
        # sent (HTTP 403), and "Authentication required" when none was sent (HTTP 401).
        rejected = str(exc).startswith("Authentication failed")
        raise JobsError(_auth_problem(url, rejected=rejected)) from None
    except RuntimeError as exc:
        match = _HTTP_ERROR.search(str(exc))
        if match is None:  # e.g. the log stream closing abnormally
            message = redact_text(one_line(exc), [_token() or ""])
            raise JobsError(f"{url}: {message[:300]}") from None
        code = int(match[1])
        body = redact_text(one_line(match[2]).rstrip("."), [_token() or ""])
        if code == 404 and job_id is not None:
            raise JobsError(f"no job {job_id!r} on {url} (`verlite list` shows its jobs)") from None
        raise _http_error(url, code, body) from None
    except json.JSONDecodeError as exc:
        raise JobsError(
            f"the job server at {url} answered with something that is not JSON ({exc.msg})"
        ) from None
    except (ConnectionError, requests.ConnectionError, aiohttp.ClientConnectionError) as exc:
        raise JobServerBusy(f"lost the connection to {url} ({type(exc).__name__})") from None
    except (requests.RequestException, aiohttp.ClientError) as exc:
        raise JobsError(f"lost the connection to {url} ({type(exc).__name__})") from None


def _http_error(url: str, code: int, body: str) -> JobsError:
    """The error for an HTTP failure ``code`` with the (redacted) ``body``: busy or not."""
    message = f"the job server at {url} answered HTTP {code}: {body[:300]}"
    busy = code in _BUSY_CODES or (code == 500 and _BUSY_500.search(body) is not None)
    return JobServerBusy(message) if busy else JobsError(message)


def _auth_problem(url: str, *, rejected: bool) -> str:
    """What to do when the cluster refused the token sent (``rejected``) or got none."""
    if rejected:
        return f"the cluster at {url} rejected the Ray token from {_token_source()}; use that cluster's token"
    if os.environ.get(AUTH_MODE_ENV, "").lower() != "token":
        return (
            f"the cluster at {url} requires a Ray token: set {AUTH_MODE_ENV}=token and provide the "
            f"token in {TOKEN_SOURCES}"
        )
    if os.environ.get(TOKEN_PATH_ENV) and not os.environ.get(TOKEN_ENV):
        return f"{TOKEN_PATH_ENV}={os.environ[TOKEN_PATH_ENV]} cannot be read or is empty"
    return f"{AUTH_MODE_ENV}=token but no Ray token was found in {TOKEN_SOURCES}"


def _token() -> str | None:
    """The Ray token a client sends, found where Ray's own clients look: none unless
    ``RAY_AUTH_MODE=token``; then ``RAY_AUTH_TOKEN``, the file ``RAY_AUTH_TOKEN_PATH`` names,
    or ``~/.ray/auth_token``."""
    if os.environ.get(AUTH_MODE_ENV, "").lower() != "token":
        return None
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV].strip()
    path = token_files()[0]
    try:
        return path.read_text().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def token_files() -> list[Path]:
    """The files a Ray token is read from on this machine, the one Ray reads first first:
    ``RAY_AUTH_TOKEN_PATH`` when set, and ``~/.ray/auth_token``."""
    named = os.environ.get(TOKEN_PATH_ENV)
    return [Path(p).expanduser() for p in ([named] if named else []) + [DEFAULT_TOKEN_FILE]]


def _token_source() -> str:
    if os.environ.get(TOKEN_ENV):
        return TOKEN_ENV
    if os.environ.get(TOKEN_PATH_ENV):
        return f"{TOKEN_PATH_ENV}={os.environ[TOKEN_PATH_ENV]}"
    return DEFAULT_TOKEN_FILE
