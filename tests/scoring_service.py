"""A real scoring service for the remote-verifier tests: a ``ThreadingHTTPServer`` on
127.0.0.1 (an ephemeral port) that speaks verlite's protocol (docs/reward-models-and-verifiers.md)
and scores with ``digit_match``, with failures scripted request by request."""

from __future__ import annotations

import json
import select
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from verlite.rewards import digit_match

# What the next requests meet, one behaviour each (then "ok"):
#   ok            the right scores
#   slow          the right scores after ``ScoringService.delay_s``
#   500, 429, 404 that status
#   drop          the connection closed without a reply
#   trickle       the right scores, a byte every 0.05 s
#   trickle_head  a status line and a header a byte every 0.05 s (for 5 s), never ended:
#                 ``heads_cut`` counts the clients that left before it was all sent
#   malformed     a reply that is not JSON
#   short         one score fewer than responses
#   out_of_range  the last score 1.5
#   echo_auth     HTTP 400 whose body quotes the request's Authorization header
# and some that echo the bearer token of the request's Authorization header:
#   token_reason_503, token_reason_401   that status with the token as its reason phrase
#   token_score   a reply whose last score is the token
#   token_json    HTTP 400 whose JSON body quotes the token (JSON-escaped)
#   token_cut     HTTP 400 whose body's first 300 bytes end inside the token
#   token_url     HTTP 404 whose body quotes the token URL-encoded
#   token_slow_401  HTTP 401 at once, its body (the token first) a byte every 0.05 s


class ScoringService:
    """The server and what it saw: request count, batch sizes, most requests in flight."""

    def __init__(self) -> None:
        self.script: list[str] = []
        self.delay_s = 1.0
        self.down = False  # every request answers 500 (a service that stays down)
        self.down_after: int | None = None  # down once it has answered this many "ok"
        self.answered = 0
        self.barrier: threading.Barrier | None = None  # requests wait until this many overlap
        # When set, what each request meets, from its body, instead of the script.
        self.choose: Callable[[dict[str, Any]], str] | None = None
        self.requests = 0
        self.batch_sizes: list[int] = []
        self.authorization: list[str | None] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.heads_cut = 0
        self.head_trickled = threading.Event()  # a trickle_head reply ended
        self.lock = threading.Lock()
        self.server = _QuietServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/score"

    def reset(self, *script: str) -> None:
        # A handler may still be finishing a reply the client already has.
        deadline = time.monotonic() + 5
        while self.in_flight and time.monotonic() < deadline:
            time.sleep(0.01)
        with self.lock:
            self.script, self.delay_s = list(script), 1.0
            self.down, self.down_after, self.answered, self.barrier = False, None, 0, None
            self.choose = None
            self.requests, self.batch_sizes, self.authorization = 0, [], []
            self.max_in_flight, self.heads_cut = 0, 0
            self.head_trickled.clear()

    def next_behaviour(self, body: dict[str, Any]) -> str:
        with self.lock:
            self.requests += 1
            choose = self.choose
        if choose is not None:
            return choose(body)  # outside the lock: it may wait for another request
        with self.lock:
            self.down = self.down or self.answered == self.down_after
            if self.down:
                return "500"
            behaviour = self.script.pop(0) if self.script else "ok"
            self.answered += behaviour == "ok"
            return behaviour


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a client that timed out and left: what it saw is what the tests check


@contextmanager
def scoring_service() -> Iterator[ScoringService]:
    service = ScoringService()
    thread = threading.Thread(target=service.server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield service
    finally:
        service.server.shutdown()
        service.server.server_close()


def _handler(service: ScoringService) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            pass  # the tests read what the client says

        def do_POST(self) -> None:
            with service.lock:
                service.in_flight += 1
                service.max_in_flight = max(service.max_in_flight, service.in_flight)
            self.counted = True
            try:
                self._answer()
            finally:
                self._done()

        def _done(self) -> None:
            # Once its reply starts the request is no longer in flight: the client may send
            # its next one before this thread gets back here.
            if self.counted:
                self.counted = False
                with service.lock:
                    service.in_flight -= 1

        def _answer(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            behaviour = service.next_behaviour(body)
            with service.lock:
                service.batch_sizes.append(len(body["responses"]))
                service.authorization.append(self.headers.get("Authorization"))
            if service.barrier is not None:
                service.barrier.wait(timeout=10)
            if behaviour == "drop":
                self.close_connection = True
                return
            if behaviour == "trickle_head":
                self._trickle_head()
                return
            if behaviour == "slow":
                time.sleep(service.delay_s)
            if behaviour.isdigit():
                self._send(int(behaviour), b'{"error": "scripted"}')
                return
            if behaviour == "echo_auth":
                self._send(400, f"bad request from {self.headers['Authorization']}".encode())
                return
            token = str(self.headers["Authorization"]).removeprefix("Bearer ")
            if behaviour.startswith("token_reason_"):
                self._send(int(behaviour.rsplit("_", 1)[1]), b"{}", reason=token)
                return
            if behaviour in _TOKEN_BODIES:
                status, body_of = _TOKEN_BODIES[behaviour]
                self._send(
                    status, body_of(token).encode(), trickle=behaviour.startswith("token_slow")
                )
                return
            if behaviour == "malformed":
                self._send(200, b'{"scores": [0.5,')
                return
            scores = [
                digit_match(r, a, p)
                for r, a, p in zip(body["responses"], body["answers"], body["prompts"], strict=True)
            ]
            if behaviour == "short":
                scores = scores[:-1]
            if behaviour == "out_of_range":
                scores[-1] = 1.5
            if behaviour == "token_score":
                scores[-1] = token  # type: ignore[call-overload]
            self._send(200, json.dumps({"scores": scores}).encode(), trickle=behaviour == "trickle")

        def _trickle_head(self) -> None:
            self._done()
            self.close_connection = True
            head = b"HTTP/1.1 200 OK\r\nX-Trickle: " + b"x" * 100
            try:
                for i in range(len(head)):
                    if _closed_by_peer(self.connection):
                        with service.lock:
                            service.heads_cut += 1
                        break
                    self.wfile.write(head[i : i + 1])
                    self.wfile.flush()
                    time.sleep(0.05)
            except OSError:  # the client reset the connection
                with service.lock:
                    service.heads_cut += 1
            finally:
                service.head_trickled.set()

        def _send(
            self, status: int, payload: bytes, *, trickle: bool = False, reason: str | None = None
        ) -> None:
            self._done()
            self.send_response(status, reason)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if not trickle:
                self.wfile.write(payload)
                return
            for i in range(len(payload)):
                self.wfile.write(payload[i : i + 1])
                self.wfile.flush()
                time.sleep(0.05)

    return Handler


def _closed_by_peer(connection: socket.socket) -> bool:
    """Whether the client has shut or closed its end (a read would see the end of it)."""
    readable, _, _ = select.select([connection], [], [], 0)
    try:
        return bool(readable) and connection.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


_TOKEN_BODIES: dict[str, tuple[int, Callable[[str], str]]] = {
    "token_json": (400, lambda token: json.dumps({"error": f"unknown key {token}"})),
    "token_cut": (400, lambda token: "x" * (300 - len(token) // 2) + token),
    "token_url": (404, lambda token: f"no route /v1/{urllib.parse.quote(token, safe='')}/score"),
    "token_slow_401": (401, lambda token: f"{token} is not a key of this service"),
}
