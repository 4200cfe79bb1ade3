"""The job commands that read and stop jobs, against a real HTTP server on 127.0.0.1 that
answers like a Ray dashboard's job API: the records they print, the token they send, and one
line for every kind of bad answer, with no credential in it. They load neither Ray nor torch."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import psutil
import pytest
from jobs_support import REPO, client_env

from verlite.jobs import server as jobs_server
from verlite.jobs.entrypoint import job_entrypoint
from verlite.jobs.server import JobsError
from verlite.records import metrics_log

TOKEN = "tok-7f3e9a"
JOB = {
    "type": "SUBMISSION",
    "submission_id": "raysubmit_1",
    "status": "FAILED",
    "message": "the driver exited with 1",
    "entrypoint": job_entrypoint(["train", "--config", "configs/ppo_tiny.yaml"]),
    "start_time": 1_700_000_000_000,
}
DRIVER = {**JOB, "type": "DRIVER", "submission_id": None, "entrypoint": "python x.py"}


class Dashboard(BaseHTTPRequestHandler):
    """Routes of the job API; ``answers`` (class level) overrides a path's answer."""

    answers: ClassVar[dict[str, tuple[int, str]]] = {}
    seen: ClassVar[list[tuple[str, str, str | None]]] = []
    # Job API answers still to give as a head does while its job agent starts.
    busy: ClassVar[list[tuple[int, str]]] = []

    def _answer(self) -> None:
        self.seen.append((self.command, self.path, self.headers.get("Authorization")))
        if self.busy and self.path != "/api/version":
            code, text = self.busy.pop(0)
            self._send(code, text)
            return
        routes = {
            "/api/version": (200, json.dumps({"ray_version": "2.60"})),
            "/api/jobs/": (200, json.dumps([JOB, DRIVER])),
            "/api/jobs/raysubmit_1": (200, json.dumps(JOB)),
            "/api/jobs/raysubmit_1/logs": (200, json.dumps({"logs": "line 1\nline 2\n"})),
            "/api/jobs/raysubmit_1/stop": (200, json.dumps({"stopped": True})),
        }
        code, body = self.answers.get(self.path) or routes.get(self.path, (404, "no such job"))
        if self.path != "/api/version" and self.headers.get("Authorization") != f"Bearer {TOKEN}":
            code, body = (403, "bad token") if self.headers.get("Authorization") else (401, "")
        self._send(code, body)

    def _send(self, code: int, body: str) -> None:
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _answer

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def dashboard() -> Iterator[str]:
    Dashboard.answers, Dashboard.seen, Dashboard.busy = {}, [], []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Dashboard)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def verlite(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environment = client_env(**{"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": TOKEN, **env})
    return subprocess.run(
        [sys.executable, "-m", "verlite", *args],
        cwd=REPO,
        env=environment,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_status_logs_stop_and_list_read_the_job_api_with_the_token(dashboard: str) -> None:
    status = verlite("status", "raysubmit_1", "--address", dashboard)
    assert status.returncode == 0 and status.stdout == "FAILED\n"
    assert status.stderr == "the driver exited with 1\n"
    logs = verlite("logs", "raysubmit_1", "--address", dashboard)
    assert logs.stdout == "line 1\nline 2\n"
    stop = verlite("stop", "raysubmit_1", "--address", dashboard)
    assert stop.stdout == "stop requested for raysubmit_1\n"
    listing = verlite("list", "--address", dashboard)
    lines = listing.stdout.splitlines()
    assert lines[0].split() == ["ID", "STATUS", "STARTED", "COMMAND"]
    assert len(lines) == 2 and lines[1].startswith("raysubmit_1  FAILED")  # no DRIVER entry
    assert lines[1].endswith("  verlite train --config configs/ppo_tiny.yaml")  # what the job runs
    assert ("POST", "/api/jobs/raysubmit_1/stop", f"Bearer {TOKEN}") in Dashboard.seen
    assert TOKEN not in "".join(p.stdout + p.stderr for p in (status, logs, stop, listing))


class Proxy(BaseHTTPRequestHandler):
    """A proxy of the environment: it records what it is sent and answers 502."""

    seen: ClassVar[list[str | None]] = []

    def _answer(self) -> None:
        self.seen.append(self.headers.get("Authorization"))
        self.send_response(502)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_POST = _answer

    def log_message(self, *args: Any) -> None:
        pass


def test_a_dashboard_on_this_machine_is_reached_without_the_environments_proxy(
    dashboard: str,
) -> None:
    # A local head or an SSH tunnel's end: requests sent the Ray token in cleartext to the
    # proxy (http_proxy), which cannot reach it.
    Proxy.seen = []
    proxy = ThreadingHTTPServer(("127.0.0.1", 0), Proxy)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        address = f"http://127.0.0.1:{proxy.server_address[1]}"
        env = {"http_proxy": address, "HTTP_PROXY": address, "no_proxy": "", "NO_PROXY": ""}
        status = verlite("status", "raysubmit_1", "--address", dashboard, **env)
    finally:
        proxy.shutdown()
        proxy.server_close()
    assert (status.returncode, status.stdout, Proxy.seen) == (0, "FAILED\n", []), status.stderr


def test_reading_a_job_loads_neither_ray_nor_torch(dashboard: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "verlite", "status", "raysubmit_1"],
        cwd=REPO,
        env=client_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=TOKEN, RAY_ADDRESS=dashboard),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if "|" in line}
    assert "requests" in imported  # the probe sees imports at all
    assert not {"ray", "torch", "transformers"} & imported


@pytest.mark.parametrize(
    ("path", "answer", "message"),
    [
        (
            "/api/jobs/raysubmit_1",
            (200, "<html>gateway</html>"),
            "not JSON: '<html>gateway</html>'",
        ),
        (
            "/api/jobs/raysubmit_1",
            (200, json.dumps({"state": "ok"})),
            "job record of another shape",
        ),
        ("/api/jobs/raysubmit_1", (200, json.dumps([1, 2])), "job record of another shape"),
        (
            "/api/jobs/raysubmit_1",
            (500, f"boom; request headers: Authorization: Bearer {TOKEN}"),
            "answered HTTP 500: boom; request headers: Authorization: ***",
        ),
    ],
)
def test_bad_answers_are_one_line_without_the_token(
    dashboard: str, path: str, answer: tuple[int, str], message: str
) -> None:
    Dashboard.answers[path] = answer
    proc = verlite("status", "raysubmit_1", "--address", dashboard)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert message in proc.stderr and TOKEN not in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_servers_control_characters_and_bogus_times_are_printed_harmlessly(
    dashboard: str,
) -> None:
    # A terminal escape clears the screen; a line break forges a row; a start time that is
    # a string or past year 9999 once raised a traceback.
    hostile = {
        **JOB,
        "submission_id": "raysubmit_\x1b[2J",
        "entrypoint": "x\r\nraysubmit_0  SUCCEEDED",
        "status": "RUNNING\x1b]0;title\x07",
    }
    for start in ("soon", 1e30, True):
        Dashboard.answers["/api/jobs/"] = (200, json.dumps([{**hostile, "start_time": start}]))
        listing = verlite("list", "--address", dashboard)
        assert listing.returncode == 0 and listing.stderr == "", listing.stderr
        row = listing.stdout.splitlines()[1]
        assert len(listing.stdout.splitlines()) == 2 and "\x1b" not in listing.stdout
        assert row.split() == [
            "raysubmit_\\x1b[2J",
            "RUNNING\\x1b]0;title\\x07",
            "-",
            "x\\r\\nraysubmit_0",
            "SUCCEEDED",
        ]


NO_AGENT = (500, "No available agent to submit job, please try again later.")


def test_a_busy_job_server_is_retried_with_one_line_and_other_failures_are_not(
    dashboard: str,
) -> None:
    # A head a few seconds old answers 500 "No available agent"; a gateway 502/503.
    Dashboard.busy = [NO_AGENT, (503, "starting")]
    status = verlite("status", "raysubmit_1", "--address", dashboard, "--retry-for", "30")
    assert status.returncode == 0 and status.stdout == "FAILED\n", status.stderr
    retrying = [line for line in status.stderr.splitlines() if "retrying" in line]
    assert len(retrying) == 1 and "No available agent" in retrying[0]
    assert not Dashboard.busy  # every busy answer was met by a new try
    # Still busy when the time is up: one line that says it retried.
    Dashboard.busy = [NO_AGENT] * 100
    gave_up = verlite("status", "raysubmit_1", "--address", dashboard, "--retry-for", "2")
    assert gave_up.returncode == 2, gave_up.stderr
    assert gave_up.stderr.splitlines()[-1].endswith("(still, after retrying for 2 s)")
    # Not busy: a plain 500, an unknown job and a refused token fail at the first answer.
    Dashboard.busy = [(500, "internal error")] + [NO_AGENT] * 5
    plain = verlite("status", "raysubmit_1", "--address", dashboard, "--retry-for", "30")
    assert plain.returncode == 2 and "retrying" not in plain.stderr
    assert len(Dashboard.busy) == 5
    Dashboard.busy = []
    for args, env in (
        (("status", "raysubmit_9"), {}),
        (("status", "raysubmit_1"), {"RAY_AUTH_TOKEN": "wrong"}),
    ):
        proc = verlite(*args, "--address", dashboard, "--retry-for", "30", **env)
        assert proc.returncode == 2 and "retrying" not in proc.stderr


def test_unknown_job_and_token_problems_say_what_to_do(dashboard: str) -> None:
    unknown = verlite("status", "raysubmit_9", "--address", dashboard)
    assert unknown.returncode == 2 and "no job 'raysubmit_9'" in unknown.stderr
    rejected = verlite("status", "raysubmit_1", "--address", dashboard, RAY_AUTH_TOKEN="wrong")
    assert (
        rejected.returncode == 2 and "rejected the Ray token from RAY_AUTH_TOKEN" in rejected.stderr
    )
    none = subprocess.run(
        [sys.executable, "-m", "verlite", "status", "raysubmit_1", "--address", dashboard],
        cwd=REPO,
        env=client_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert none.returncode == 2 and "set RAY_AUTH_MODE=token" in none.stderr


class EndlessAnswer(BaseHTTPRequestHandler):
    """A server that trickles a chunked answer a byte at a time, or never stops sending."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        trickle = self.path == "/trickle"
        with contextlib.suppress(OSError):  # the client hangs up
            while True:
                data = b" " if trickle else b" " * (1 << 16)
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()
                if trickle:
                    time.sleep(0.1)

    def log_message(self, *args: Any) -> None:
        pass


def test_an_answer_that_trickles_or_never_ends_is_cut_at_its_time_and_size_bounds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The read timeout bounds one wait for data only: both servers would hold the command
    # forever (or fill the memory) without a bound on the whole answer.
    server = ThreadingHTTPServer(("127.0.0.1", 0), EndlessAnswer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setattr(jobs_server, "API_TIMEOUT_S", 1.0)
    monkeypatch.setattr(jobs_server, "MAX_ANSWER_BYTES", 1 << 20)
    try:
        # Cut by the whole answer's deadline (the message says so); only pytest's timeout
        # guards against a hang, not a bound on the wall time.
        with pytest.raises(JobsError, match=r"no complete answer from .* within 1 s"):
            jobs_server.JobServer(url)._request("GET", "/trickle")
        with pytest.raises(JobsError, match=r"answered more than 1 MiB"):
            jobs_server.JobServer(url)._request("GET", "/endless")
    finally:
        server.shutdown()
        server.server_close()


def test_a_log_the_job_server_cannot_decode_is_named_in_one_line(dashboard: str) -> None:
    # Ray's server reads the log file as UTF-8 and answers its traceback.
    Dashboard.answers["/api/jobs/raysubmit_1/logs"] = (
        500,
        'Traceback (most recent call last):\n  File "job_head.py", line 591\n'
        "UnicodeDecodeError: 'utf-8' codec can't decode byte 0xff in position 7",
    )
    for command in ("logs", "metrics"):
        args = (command, "raysubmit_1") if command == "logs" else (command, "--job", "raysubmit_1")
        proc = verlite(*args, "--address", dashboard)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert "job 'raysubmit_1''s log holds bytes that are not UTF-8 text" in proc.stderr
        assert "Traceback" not in proc.stderr


def test_a_jobs_output_reaches_its_log_as_utf8_with_its_metrics_and_exit_code() -> None:
    # The child writes raw bytes, a character split over two writes, a metrics record.
    child = (
        "import os, time; os.write(1, b'caf\\xc3'); time.sleep(0.2); os.write(1, b'\\xa9 \\xff\\n');"
        'os.write(2, b\'VERLITE_METRICS {"step": 1, "a": 0.5}\\n\'); raise SystemExit(3)'
    )
    wrapper = (
        "import sys; from verlite.jobs.entrypoint import run_with_utf8_output; "
        "sys.exit(run_with_utf8_output([sys.executable, '-c', sys.argv[1]]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", wrapper, child], cwd=REPO, capture_output=True, timeout=60
    )
    assert proc.returncode == 3
    log = proc.stdout.decode("utf-8")  # strict: Ray's server reads it so
    assert log.startswith("caf\u00e9 \ufffd\n")
    assert log.endswith("held 1 byte(s) that are not UTF-8 text, shown as \ufffd\n")
    assert metrics_log.parse_marked_lines(log) == [{"step": 1, "a": 0.5}]


def test_a_stopped_jobs_output_is_copied_until_it_ends() -> None:
    # Ray stops a job by sending SIGTERM to the entrypoint and all its children.
    wrapper = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from verlite.jobs.entrypoint import run_with_utf8_output; "
            "sys.exit(run_with_utf8_output([sys.executable, '-c', sys.argv[1]]))",
            "import signal, sys, time\n"
            "def stop(*a): print('stopping', flush=True); sys.exit(143)\n"
            "signal.signal(signal.SIGTERM, stop); print('ready', flush=True); time.sleep(60)",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert wrapper.stdout is not None and wrapper.stdout.readline() == "ready\n"
    entrypoint = psutil.Process(wrapper.pid)
    for process in [entrypoint, *entrypoint.children(recursive=True)]:
        process.send_signal(signal.SIGTERM)
    assert wrapper.stdout.read() == "stopping\n"
    assert wrapper.wait(timeout=30) == 143


def test_a_users_print_of_a_record_does_not_replace_the_jobs_metrics(dashboard: str) -> None:
    record = '{"step": 1, "critic/score/mean": 0.5}'
    log = (
        f'{metrics_log.start_line(0)}\ndebug: VERLITE_METRICS {{"step": 1, "x": 9}}\n'
        f"VERLITE_METRICS {record}\n"
    )
    Dashboard.answers["/api/jobs/raysubmit_1/logs"] = (200, json.dumps({"logs": log}))
    proc = verlite("metrics", "--job", "raysubmit_1", "--address", dashboard)
    assert proc.returncode == 0, proc.stderr
    assert "critic/score/mean" in proc.stdout and " x " not in proc.stdout
    forged = log + f"VERLITE_METRICS {record}\n"  # printed by user code at a line's start
    Dashboard.answers["/api/jobs/raysubmit_1/logs"] = (200, json.dumps({"logs": forged}))
    proc = verlite("metrics", "--job", "raysubmit_1", "--address", dashboard)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "job 'raysubmit_1''s log line 4 logs step 1 after step 1 (" in proc.stderr


def test_a_job_without_metrics_is_named_with_its_status(dashboard: str) -> None:
    # The job's log holds no marked line: it ended before its first step, or is starting.
    for status in ("FAILED", "RUNNING"):
        Dashboard.answers["/api/jobs/raysubmit_1"] = (200, json.dumps({**JOB, "status": status}))
        proc = verlite("metrics", "--job", "raysubmit_1", "--address", dashboard)
        assert proc.returncode == 2 and proc.stdout == "", proc.stderr
        assert proc.stderr == (
            f"verlite: error: job 'raysubmit_1' has logged no metrics (status {status}); "
            "`verlite logs raysubmit_1` shows its output\n"
        )
