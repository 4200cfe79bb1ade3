"""Remote verifiers: a step's responses scored by a user's HTTP service (``reward.remote``).

The protocol. The responses go in batches of at most ``reward.remote.batch_size``, each one
``POST <url>`` with ``Content-Type: application/json`` (and ``Authorization: Bearer <token>``
when ``reward.remote.auth_env`` names a variable) and the body
``{"responses": [...], "prompts": [...], "answers": [...]}``: three lists of strings of one
length, row by row. The service answers ``200`` with ``{"scores": [...]}``: one JSON number
in [0, 1] per response, in the same order (other keys are ignored). Redirects are not
followed (they would carry the token elsewhere), and a service on this machine is reached
without the environment's proxy (``http_proxy``).

Failures. Retried up to ``max_retries`` times, waiting ``retry_backoff_s`` and twice as long
at each further retry, at most ``MAX_RETRY_WAIT_S`` (10 minutes) a wait: no connection
(refused, reset, dropped before the reply), no whole reply within ``timeout_s``
(:class:`_Deadline` shuts the connection then, wherever the reply is: a status line, headers
or a body still arriving are cut off), HTTP 5xx and 429 -- what a service that restarts or
sheds load does. Not retried, since a retry cannot mend a service's bug: any other status
(a 4xx is the service's answer however late its reply ends: one whose body is cut off at
``timeout_s`` is shown with what came of it, not taken for a slow reply), a
reply that is not JSON or not ``{"scores": [...]}``, another count of scores than of
responses, a score that is not a number in [0, 1]. Either way the step stops with a
:class:`RemoteRewardError` (a run failure: exit 1, the checkpoints written so far stay
valid) in one line naming the URL (without credentials), the batch and its responses, and
the status or the value; after retries, how many attempts were made. A retry is said on the
console when it is made. When batches in flight fail, the first to fail for good is the
stage's error. A reply that is not plain JSON (``NaN`` or ``Infinity``, nested too deeply to
parse, not UTF-8) breaks the protocol.

The token. It is registered with :mod:`verlite.redaction` when read, so no message, console
line or record shows it in any spelling (a service may echo it in its status line, its body
or as a score); a token shorter than ``MIN_SECRET_LENGTH`` characters cannot be masked and
is refused.

Up to ``concurrency`` requests are in flight at once, in threads (the driver waits on the
network). A scoring stage that takes long prints its progress, as ``scoring.py`` does, and
so does the start-up probe while it waits.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, TextIO
from urllib.parse import urlsplit

from verlite.config import RemoteRewardConfig
from verlite.config.sections_reward import MAX_RETRY_WAIT_S
from verlite.errors import RunFailure, UserError, one_line, shown
from verlite.reachable import is_loopback_host
from verlite.redaction import MIN_SECRET_LENGTH, redact_text, register_secret
from verlite.rewards.scoring import PROGRESS_EVERY_S

# A reply larger than this is no list of scores (64 MiB holds millions of them).
MAX_REPLY_BYTES = 64 * 2**20
_CHUNK_BYTES = 2**16
_EXCERPT_BYTES = 300  # of a reply, quoted in a message


def retry_wait_s(backoff_s: float, attempt: int) -> float:
    """The wait after failed attempt ``attempt`` (1, 2, ...): ``backoff_s`` doubled at each
    further attempt, at most ``MAX_RETRY_WAIT_S``: unbounded, the 31st attempt of a 1 s
    backoff (``reward.remote.max_retries`` may be 100) would wait 34 years, and a later one
    overflow the clock it waits on."""
    return min(backoff_s * 2.0 ** (attempt - 1), MAX_RETRY_WAIT_S)


class RemoteRewardError(RunFailure):
    """The remote verifier failed a batch: it stayed unreachable, slow or failing after the
    retries, or answered what a retry cannot mend."""


class _Failed(Exception):
    """A failed request. Its message quotes what the service sent (a status line, a body, a
    score), which may echo the token: masked here, before any retry line or error shows it."""

    def __init__(self, message: str, *, answered: bool = False) -> None:
        super().__init__(redact_text(message))
        # The service's status line came: the failure is what it answered, however late its
        # reply ended (a 4xx whose body is cut off at the deadline is still a 4xx).
        self.answered = answered


class _Retryable(_Failed):
    """A failed request that a retry may mend: no connection, too slow, HTTP 5xx or 429."""


class _Broken(_Failed):
    """A reply that breaks the protocol: a retry would get the same."""


class _Abandoned(Exception):
    """A batch given up because another one failed (whose error is the stage's)."""


class _Stage:
    """What the batches of one scoring stage share: ``stop``, set once a batch failed for
    good (no request is sent or retried after that), and that first failure, recorded before
    ``stop`` is set: a batch abandoned because of it can never be taken for the cause."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self._lock = threading.Lock()

    def fail(self, error: BaseException) -> None:
        with self._lock:
            if self.error is None:
                self.error = error
        self.stop.set()


@dataclass(frozen=True)
class _Batch:
    """The rows of one request: ``start`` is the first one's index in the step."""

    index: int
    start: int
    responses: Sequence[str]
    prompts: Sequence[str]
    answers: Sequence[str]

    @property
    def where(self) -> str:
        return f"batch {self.index} (responses {self.start}-{self.start + len(self.responses) - 1})"


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    # A redirect would carry the request and its Authorization header to another URL: a
    # 3xx stays an HTTPError, reported as what it is.
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


class RemoteScorer:
    """Scores responses with the service at ``reward.remote.url``; see the module docstring
    for the protocol and which failures are retried."""

    def __init__(self, cfg: RemoteRewardConfig, *, token: str | None = None) -> None:
        if cfg.url is None:
            raise ValueError("RemoteScorer needs reward.remote.url")
        self.cfg = cfg
        self.url = cfg.url
        if token is not None:
            register_secret(token)
        # What messages show of the URL: its scheme, host, port and path, never a query's
        # credentials (``?key=...``) nor the token (a path may hold it).
        parts = urlsplit(cfg.url)
        self.shown_url = redact_text(f"{parts.scheme}://{parts.netloc}{parts.path}")
        self._headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if token is not None:
            self._headers["Authorization"] = f"Bearer {token}"
        handlers: list[urllib.request.BaseHandler] = [
            _NoRedirects(),
            _HTTPHandler(),
            _HTTPSHandler(),
        ]
        if is_loopback_host(parts.hostname or ""):
            # A service on this machine is reached directly: a proxy of the environment
            # (http_proxy) would get the request, the token in cleartext over the network
            # that the http:// check keeps it off, and could not reach the service anyway.
            handlers.append(urllib.request.ProxyHandler({}))
        self._opener = urllib.request.build_opener(*handlers)

    @classmethod
    def from_config(cls, cfg: RemoteRewardConfig) -> RemoteScorer | None:
        """The run's remote verifier (None when ``reward.remote.url`` is unset), with the
        bearer token read from the environment variable ``reward.remote.auth_env`` names."""
        if cfg.url is None:
            return None
        token = None
        if cfg.auth_env is not None:
            token = os.environ.get(cfg.auth_env) or None
            # Named only when it looks like a variable's name: a pasted token may not.
            name = f"={cfg.auth_env}" if _CONVENTIONAL_NAME.fullmatch(cfg.auth_env) else ""
            if token is None:
                raise UserError(
                    f"reward.remote.auth_env{name}: the environment variable is not set or is "
                    "empty in this process; export it with the service's token"
                )
            if len(token) < MIN_SECRET_LENGTH:
                raise UserError(
                    f"reward.remote.auth_env{name}: the token in the variable is {len(token)} "
                    f"characters long; at least {MIN_SECRET_LENGTH} are needed (a shorter one "
                    "could not be masked in messages without garbling them)"
                )
        return cls(cfg, token=token)

    def probe(self, prompt: str, answer: str) -> None:
        """One request, not retried: an empty response to ``prompt`` with ``answer``. Before
        a run starts, a service that is down, refuses the token or breaks the protocol
        fails in seconds (a :class:`UserError`, as a wrong URL is) instead of after the
        first rollout."""
        started = time.monotonic()
        # In a thread of its own, as a scoring stage's requests are: the wait says how long
        # it has been (a service slow to answer, a long reward.remote.timeout_s).
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward")
        request = pool.submit(self._post, _Batch(0, 0, ("",), (prompt,), (answer,)))
        pool.shutdown(wait=False)
        try:
            while True:
                try:
                    request.result(timeout=PROGRESS_EVERY_S)
                    break
                except TimeoutError:  # concurrent.futures' (the builtin's since 3.11)
                    print(
                        f"reward: waiting for the remote verifier {self.shown_url} to answer "
                        f"the start-up probe ({time.monotonic() - started:.0f} s of "
                        f"reward.remote.timeout_s={self.cfg.timeout_s:g})",
                        flush=True,
                    )
        except _Failed as exc:
            raise UserError(
                f"reward.remote.url={shown(self.shown_url)}: the start-up probe (one request "
                f"scoring an empty response to the first training prompt) failed: {exc}; start "
                "the service or correct the URL"
            ) from None
        print(
            f"reward: remote verifier {self.shown_url} answered the probe in "
            f"{time.monotonic() - started:.2f} s",
            flush=True,
        )

    def score(
        self,
        responses: Sequence[str],
        answers: Sequence[str],
        prompts: Sequence[str],
        *,
        stream: TextIO | None = None,
    ) -> list[float]:
        """The service's score of each response, in order: batches of ``batch_size``, up
        to ``concurrency`` of them in flight."""
        if not len(responses) == len(answers) == len(prompts):
            raise ValueError(
                f"RemoteScorer.score needs one answer and prompt per response; got "
                f"{len(responses)} responses, {len(answers)} answers, {len(prompts)} prompts"
            )
        out = stream or sys.stdout
        size = self.cfg.batch_size
        batches = [
            _Batch(
                i,
                start,
                responses[start : start + size],
                prompts[start : start + size],
                answers[start : start + size],
            )
            for i, start in enumerate(range(0, len(responses), size))
        ]
        if not batches:
            return []
        stage = _Stage()
        pool = ThreadPoolExecutor(
            max_workers=min(self.cfg.concurrency, len(batches)), thread_name_prefix="reward"
        )
        try:
            futures = [pool.submit(self._score_batch, batch, stage, out) for batch in batches]
            self._wait(futures, stage, out, total=len(responses))
        finally:
            stage.stop.set()  # the stage is over: no more retries
            # Requests still in flight after a failure end within timeout_s on their own.
            pool.shutdown(wait=False, cancel_futures=True)
        return [score for future in futures for score in future.result()]

    def _wait(
        self, futures: list[Future[list[float]]], stage: _Stage, out: TextIO, *, total: int
    ) -> None:
        """Until every batch is scored; the first batch that failed for good stops the stage
        at once with its error."""
        started = time.monotonic()
        next_report = started + PROGRESS_EVERY_S
        pending: set[Future[list[float]]] = set(futures)
        while pending:
            timeout = max(next_report - time.monotonic(), 0.0)
            _, pending = wait(pending, timeout=timeout, return_when=FIRST_EXCEPTION)
            # A batch that raised recorded its error first, or was abandoned because of one
            # recorded (anything but a RemoteRewardError is a bug).
            if any(future.done() and future.exception() is not None for future in futures):
                assert stage.error is not None
                raise stage.error
            now = time.monotonic()
            if pending and now >= next_report:
                done = [f for f in futures if f.done()]
                scored = sum(len(f.result()) for f in done)
                print(
                    f"reward: {len(done)}/{len(futures)} batches ({scored}/{total} responses) "
                    f"scored by {self.shown_url} in {now - started:.0f} s",
                    file=out,
                    flush=True,
                )
                next_report = now + PROGRESS_EVERY_S

    def _score_batch(self, batch: _Batch, stage: _Stage, out: TextIO) -> list[float]:
        """The batch's scores, or the stage failed with its error (:meth:`_Stage.fail`)."""
        try:
            return self._retried(batch, stage.stop, out)
        except _Abandoned:
            raise
        except BaseException as exc:
            stage.fail(exc)
            raise

    def _retried(self, batch: _Batch, stop: threading.Event, out: TextIO) -> list[float]:
        """The batch's scores, retried as the module docstring says until ``stop``."""
        attempts = self.cfg.max_retries + 1
        where = f"reward.remote.url={shown(self.shown_url)}: {batch.where}"
        for attempt in range(1, attempts + 1):
            if stop.is_set():
                break
            try:
                return self._post(batch)
            except _Broken as exc:
                raise RemoteRewardError(f"{where}: {exc} (not retried)") from None
            except _Retryable as exc:
                if attempt == attempts:
                    raise RemoteRewardError(
                        f"{where}: {exc}, after {attempt} attempt(s) (reward.remote.max_retries="
                        f"{self.cfg.max_retries}); the service stays down or failing: run "
                        "again once it answers"
                    ) from None
                wait_s = retry_wait_s(self.cfg.retry_backoff_s, attempt)
                print(
                    f"reward: {where}: {exc}; retrying in {wait_s:g} s "
                    f"(attempt {attempt + 1} of {attempts})",
                    file=out,
                    flush=True,
                )
                stop.wait(wait_s)
        raise _Abandoned

    def _post(self, batch: _Batch) -> list[float]:
        """One request: the batch's scores, checked; :class:`_Retryable` or :class:`_Broken`."""
        body = json.dumps(
            {
                "responses": list(batch.responses),
                "prompts": list(batch.prompts),
                "answers": list(batch.answers),
            }
        ).encode()
        request = urllib.request.Request(self.url, data=body, headers=self._headers, method="POST")
        timeout_s = self.cfg.timeout_s
        too_slow = f"no whole reply within {timeout_s:g} s (reward.remote.timeout_s)"
        with _Deadline(timeout_s) as deadline:
            try:
                raw = self._exchange(request, deadline)
            except _Failed as exc:
                # What the cut made of a reply without a status: a reset, a short body.
                if deadline.passed and not exc.answered:
                    raise _Retryable(too_slow) from None
                raise
            except TimeoutError:  # one read waited the socket's timeout
                raise _Retryable(too_slow) from None
        if deadline.passed:  # a reply cut where it could have ended
            raise _Retryable(too_slow)
        return self._scores(raw, batch)

    def _exchange(self, request: urllib.request.Request, deadline: _Deadline) -> bytes:
        """The reply's body to ``request``; :class:`_Failed`, or TimeoutError. An error
        status is what the service answered whenever it came: its body as read by
        ``deadline`` is quoted (cut there, the start of a secret at its end masked)."""
        try:
            with self._opener.open(request, timeout=self.cfg.timeout_s) as reply:
                return _read_body(reply)
        except urllib.error.HTTPError as exc:
            body = _body_of(exc)
            status = f"HTTP {exc.code} {exc.reason}{_excerpt(body, cut=deadline.passed)}"
            if exc.code == 429 or exc.code >= 500:
                raise _Retryable(status, answered=True) from None
            raise _Broken(status, answered=True) from None
        except (OSError, http.client.HTTPException) as exc:  # URLError and timeouts too
            reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
            if isinstance(reason, TimeoutError):
                raise TimeoutError from None
            raise _Retryable(f"the connection failed: {_reason(reason)}") from None

    def _scores(self, raw: bytes, batch: _Batch) -> list[float]:
        try:
            reply = json.loads(raw, parse_constant=_not_json)
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError alike
            raise _Broken(f"the reply is not JSON ({exc}){_excerpt(raw)}") from None
        except RecursionError:
            raise _Broken(f"the reply is nested too deeply to parse{_excerpt(raw)}") from None
        scores = reply.get("scores") if isinstance(reply, dict) else None
        if not isinstance(scores, list):
            raise _Broken(f'the reply is not {{"scores": [...]}}{_excerpt(raw)}')
        if len(scores) != len(batch.responses):
            raise _Broken(
                f"the reply holds {len(scores)} scores for the batch's "
                f"{len(batch.responses)} responses"
            )
        for i, score in enumerate(scores):
            # A JSON number (true and false are not); NaN fails the comparison too.
            if isinstance(score, bool) or not isinstance(score, int | float) or not 0 <= score <= 1:
                raise _Broken(
                    f"response {batch.start + i} ({shown(batch.responses[i], 60)}) scored "
                    f"{shown(score, 60)}; scores must be numbers in [0, 1]"
                )
        return [float(score) for score in scores]


# Environment variables are conventionally named in capitals; a token rarely is.
_CONVENTIONAL_NAME = re.compile(r"[A-Z_][A-Z0-9_]*")


def _not_json(constant: str) -> float:
    # Python's json reads NaN, Infinity and -Infinity; JSON has no such numbers.
    raise ValueError(f"{constant} is not a JSON number")


def _excerpt(raw: bytes, *, cut: bool = False) -> str:
    """The start of a reply, for a message: one line, credentials masked, the start of one
    too where the reply is cut (an error's body is read up to ``_EXCERPT_BYTES``; ``cut``:
    its reading was cut off before)."""
    text = one_line(raw[:_EXCERPT_BYTES].decode("utf-8", "replace"))
    text = redact_text(text, cut=cut or len(raw) >= _EXCERPT_BYTES)
    return f": {shown(text, 160)}" if text else ""


def _read_body(reply: http.client.HTTPResponse) -> bytes:
    """The reply's body, read by chunks up to :data:`MAX_REPLY_BYTES`."""
    chunks, size = [], 0
    while chunk := reply.read1(_CHUNK_BYTES):
        size += len(chunk)
        if size > MAX_REPLY_BYTES:
            raise _Broken(f"the reply is larger than {MAX_REPLY_BYTES} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


# The request each thread is making (its :class:`_Deadline`), for the connections it opens.
_current = threading.local()


class _Deadline:
    """One request's time limit, whatever the service sends: the socket's own timeout bounds
    each read, not a reply whose status line, headers or body trickle in; at ``timeout_s``
    the request's connection is shut, which ends the read that waits at once."""

    def __init__(self, timeout_s: float) -> None:
        self.passed = False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(timeout_s, self._expire)
        self._timer.daemon = True

    def __enter__(self) -> _Deadline:
        _current.deadline = self
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()
        _current.deadline = None

    def watch(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.append(sock)
            if self.passed:
                _shut(sock)

    def _expire(self) -> None:
        with self._lock:
            self.passed = True
            for sock in self._sockets:
                _shut(sock)


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):  # closed already, or handed to TLS
        sock.shutdown(socket.SHUT_RDWR)


def _watched(sock: socket.socket) -> socket.socket:
    deadline: _Deadline | None = getattr(_current, "deadline", None)
    if deadline is not None:
        deadline.watch(sock)
    return sock


class _WatchedConnection(http.client.HTTPConnection):
    """A connection of this thread's request, shut at its :class:`_Deadline`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        create = self._create_connection  # type: ignore[has-type]
        # The TCP socket as soon as it connects (a TLS handshake that stalls is cut too).
        self._create_connection = lambda *a, **k: _watched(create(*a, **k))

    def connect(self) -> None:
        super().connect()
        _watched(self.sock)  # the TLS socket that replaces it for https


class _WatchedTLSConnection(_WatchedConnection, http.client.HTTPSConnection):
    pass


class _HTTPHandler(urllib.request.HTTPHandler):
    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(_WatchedConnection, req)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def do_open(self, http_class: Any, req: urllib.request.Request, **kwargs: Any) -> Any:
        return super().do_open(_WatchedTLSConnection, req, **kwargs)


def _body_of(error: urllib.error.HTTPError) -> bytes:
    try:
        return error.read(_EXCERPT_BYTES)
    except http.client.IncompleteRead as exc:  # cut off (at the deadline): what came
        return exc.partial[:_EXCERPT_BYTES]
    except (OSError, http.client.HTTPException):
        return b""


def _reason(reason: object) -> str:
    if isinstance(reason, OSError) and reason.strerror:
        return reason.strerror
    return one_line(reason) or type(reason).__name__
