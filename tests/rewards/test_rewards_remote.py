"""The remote verifier against a real HTTP service on 127.0.0.1 (tests/scoring_service.py):
scores in order over batches and concurrent requests, failures a retry can mend retried,
the others not, each reported in one line naming the URL, the batch and the status or value."""

from __future__ import annotations

import io
import re
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from scoring_service import ScoringService, scoring_service

from verlite import redaction
from verlite.config import ConfigError, RemoteRewardConfig, load_config
from verlite.config.fields import MAX_SECONDS
from verlite.errors import RunFailure, UserError
from verlite.rewards import digit_match
from verlite.rewards import remote as remote_module
from verlite.rewards.remote import RemoteRewardError, RemoteScorer

# Ten distinct rows: scores returned out of order would not match the rule's.
ANSWERS = [f"{n:03d}" for n in range(100, 110)]
RESPONSES = [a if i % 3 == 0 else a[:2] + "9" if i % 3 == 1 else "" for i, a in enumerate(ANSWERS)]
PROMPTS = [f"{a}=" for a in ANSWERS]
EXPECTED = [digit_match(r, a, p) for r, a, p in zip(RESPONSES, ANSWERS, PROMPTS, strict=True)]


@pytest.fixture(scope="module")
def server() -> Iterator[ScoringService]:
    with scoring_service() as service:
        yield service


@pytest.fixture
def service(server: ScoringService) -> ScoringService:
    server.reset()
    return server


def scorer(url: str, *, token: str | None = None, **fields: Any) -> RemoteScorer:
    settings = {"batch_size": 4, "concurrency": 2, "timeout_s": 5.0, "retry_backoff_s": 0.0}
    return RemoteScorer(RemoteRewardConfig(url=url, **{**settings, **fields}), token=token)


def score(remote: RemoteScorer) -> tuple[list[float], str]:
    out = io.StringIO()
    return remote.score(RESPONSES, ANSWERS, PROMPTS, stream=out), out.getvalue()


def failure(remote: RemoteScorer) -> str:
    with pytest.raises(RemoteRewardError) as info:
        score(remote)
    message = str(info.value)
    assert "\n" not in message, "errors are one line"
    assert isinstance(info.value, RunFailure), "a run failure: exit 1, resume continues"
    return message


def test_scores_come_back_in_order_over_batches(service: ScoringService) -> None:
    # The first batch's reply comes last.
    service.reset("slow")
    service.delay_s = 0.2
    scores, _ = score(scorer(service.url, batch_size=4, concurrency=3))
    assert scores == EXPECTED
    assert sorted(service.batch_sizes) == [2, 4, 4]


@pytest.mark.parametrize("concurrency", [1, 4])
def test_requests_overlap_up_to_the_concurrency(service: ScoringService, concurrency: int) -> None:
    # Each request waits at the server until `concurrency` of them are in (8 batches: two
    # rounds of 4): with fewer in flight the barrier breaks, and without retries so does
    # the stage.
    service.barrier = threading.Barrier(concurrency) if concurrency > 1 else None
    remote = scorer(
        service.url, batch_size=1, concurrency=concurrency, max_retries=0, timeout_s=30.0
    )
    assert remote.score(RESPONSES[:8], ANSWERS[:8], PROMPTS[:8]) == EXPECTED[:8]
    assert service.max_in_flight == concurrency


@pytest.mark.parametrize(
    ("script", "said"),
    [
        (["500", "500"], "HTTP 500 Internal Server Error"),
        (["429"], "HTTP 429 Too Many Requests"),
        (["drop"], "the connection failed: Remote end closed connection without response"),
        (["slow"], "no whole reply within 0.3 s (reward.remote.timeout_s)"),
        (["trickle"], "no whole reply within 0.3 s (reward.remote.timeout_s)"),
    ],
)
def test_a_failure_a_retry_can_mend_is_retried_and_said(
    service: ScoringService, script: list[str], said: str
) -> None:
    service.reset(*script)
    scores, out = score(scorer(service.url, batch_size=10, timeout_s=0.3, max_retries=2))
    assert scores == EXPECTED
    assert service.requests == len(script) + 1
    assert f"reward.remote.url='{service.url}': batch 0 (responses 0-9): {said}" in out
    assert f"retrying in 0 s (attempt {len(script) + 1} of 3)" in out


def test_a_reply_whose_head_trickles_in_is_cut_off_at_the_timeout(service: ScoringService) -> None:
    """reward.remote.timeout_s bounds the whole request, its status line and headers too:
    each read of them waited up to the timeout afresh, so a reply whose head trickled in
    held the request for as long as it trickled (a stalled proxy: without end)."""
    service.reset("trickle_head")
    scores, out = score(scorer(service.url, batch_size=10, timeout_s=0.3, max_retries=1))
    assert scores == EXPECTED
    assert "batch 0 (responses 0-9): no whole reply within 0.3 s (reward.remote.timeout_s)" in out
    assert service.head_trickled.wait(timeout=30)
    assert service.heads_cut == 1, "the client left while the head was still coming"


def test_the_backoff_doubles(service: ScoringService) -> None:
    service.reset("500", "500")
    _, out = score(scorer(service.url, batch_size=10, retry_backoff_s=0.05))
    assert "retrying in 0.05 s (attempt 2 of 4)" in out
    assert "retrying in 0.1 s (attempt 3 of 4)" in out


def test_the_backoff_stops_doubling_at_ten_minutes() -> None:
    """The most retries allowed (100) at the default backoff wait at most ten minutes each:
    doubled without a bound, the 31st attempt waited 34 years and the 35th overflowed the
    clock ``threading.Event.wait`` is handed (OverflowError inside the scoring thread)."""
    cfg = RemoteRewardConfig(url="http://127.0.0.1:1/score", max_retries=100)
    waits = [remote_module.retry_wait_s(cfg.retry_backoff_s, a) for a in range(1, 101)]
    assert waits[:4] == [1.0, 2.0, 4.0, 8.0]
    assert max(waits) == waits[-1] == 600.0 and waits[9] == 512.0 and waits[10] == 600.0
    assert max(waits) < threading.TIMEOUT_MAX


def test_a_service_that_stays_down_stops_the_step_after_the_retries(
    service: ScoringService,
) -> None:
    service.down = True
    message = failure(scorer(service.url, max_retries=2, concurrency=1))
    assert message.startswith(
        f"reward.remote.url='{service.url}': batch 0 (responses 0-3): HTTP 500 Internal "
        'Server Error: \'{"error": "scripted"}\', after 3 attempt(s) (reward.remote.max_retries=2)'
    )
    # What a new run of the folder does is the driver's to add (driver.run.run): the service
    # cannot know whether a checkpoint was saved.
    assert message.endswith("the service stays down or failing: run again once it answers")
    assert service.requests == 3, "the first failed batch ends the stage: no other is sent"


def test_connection_refused(service: ScoringService) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/score"
    message = failure(scorer(url, max_retries=1, concurrency=1))
    assert message.startswith(f"reward.remote.url='{url}': batch 0 (responses 0-3): ")
    assert "the connection failed: Connection refused, after 2 attempt(s)" in message


@pytest.mark.parametrize(
    ("behaviour", "said"),
    [
        (
            "malformed",
            "the reply is not JSON (Expecting value: line 1 column 17 (char 16)): "
            "'{\"scores\": [0.5,'",
        ),
        ("short", "the reply holds 3 scores for the batch's 4 responses"),
        ("out_of_range", "response 7 ('109') scored 1.5; scores must be numbers in [0, 1]"),
        ("404", "HTTP 404 Not Found"),
    ],
)
def test_a_reply_a_retry_cannot_mend_stops_at_once(
    service: ScoringService, behaviour: str, said: str
) -> None:
    # The second batch (responses 4-7) breaks the protocol; the first is fine.
    service.reset("ok", behaviour)
    message = failure(scorer(service.url, concurrency=1, max_retries=3))
    assert message.startswith(f"reward.remote.url='{service.url}': batch 1 (responses 4-7): ")
    assert said in message
    assert message.endswith("(not retried)")
    assert service.requests == 2


@pytest.mark.parametrize("bad", ["1e999", "-0.5", "true", '"1"', "null"])
def test_every_score_must_be_a_number_in_0_1(bad: str) -> None:
    remote = scorer("http://127.0.0.1:9/score")
    batch = remote_module._Batch(0, 0, ["a", "b"], ["p", "p"], ["x", "x"])
    assert remote._scores(b'{"scores": [0, 1]}', batch) == [0.0, 1.0]
    with pytest.raises(remote_module._Broken, match=r"response 1 \('b'\) scored"):
        remote._scores(f'{{"scores": [0.5, {bad}]}}'.encode(), batch)


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> None:
    # The tokens registered here mask nothing in other tests.
    monkeypatch.setattr(redaction, "_registered", set())


# The token in its spellings differs: a quote for repr and JSON, '/' and '+' for URLs.
TOKEN = 'sk-live-51Hx/q+"r0ken'


@pytest.mark.usefixtures("registry")
@pytest.mark.parametrize(
    ("behaviour", "said"),
    [
        ("echo_auth", "HTTP 400 Bad Request: 'bad request from Bearer ***'"),
        ("token_reason_401", "HTTP 401 ***: '{}' (not retried)"),
        ("token_score", "response 7 ('109') scored '***'; scores must be numbers in [0, 1]"),
        ("token_json", 'HTTP 400 Bad Request: \'{"error": "unknown key ***"}\''),
        ("token_cut", "HTTP 400 Bad Request: 'xxxxx"),
        ("token_url", "HTTP 404 Not Found: 'no route /v1/***/score'"),
    ],
)
def test_the_token_is_sent_and_never_shown(
    service: ScoringService, behaviour: str, said: str
) -> None:
    # The service echoes the token in its status line, its body (JSON-escaped, URL-encoded,
    # cut at what a message quotes) or as a score.
    service.reset("ok", behaviour)
    message = failure(scorer(service.url, token=TOKEN, concurrency=1))
    assert service.authorization[0] == f"Bearer {TOKEN}"
    assert said in message
    for fragment in ("51Hx", "r0ken", "sk-live"):
        assert fragment not in message


@pytest.mark.usefixtures("registry")
def test_a_client_error_is_not_retried_however_late_its_reply_ends(service: ScoringService) -> None:
    """A 4xx is the service's answer (bad request, a token it refuses) whenever it comes: a
    401 whose body was still arriving at reward.remote.timeout_s was retried as 'no whole
    reply within 0.3 s', and its status never shown. The body read by then is quoted with
    the start of the token it holds masked."""
    service.reset("token_slow_401")
    message = failure(scorer(service.url, token=TOKEN, batch_size=10, timeout_s=0.3))
    assert message.startswith(
        f"reward.remote.url='{service.url}': batch 0 (responses 0-9): HTTP 401 Unauthorized"
    ), message
    assert message.endswith("(not retried)") and service.requests == 1
    for fragment in ("sk-l", "51Hx", "r0ken"):
        assert fragment not in message


@pytest.mark.usefixtures("registry")
def test_the_token_is_never_shown_in_a_retry_line(service: ScoringService) -> None:
    service.reset("token_reason_503")
    scores, out = score(scorer(service.url, token=TOKEN, batch_size=10))
    assert scores == EXPECTED
    assert "batch 0 (responses 0-9): HTTP 503 ***: '{}'; retrying in 0 s (attempt 2 of 4)" in out
    assert "51Hx" not in out


@pytest.mark.usefixtures("registry")
def test_the_token_in_the_url_is_never_shown(
    service: ScoringService, capsys: pytest.CaptureFixture[str]
) -> None:
    token = "pathtoken-0a1b2c3d"
    url = service.url.replace("/score", f"/{token}/score")
    shown = service.url.replace("/score", "/***/score")
    scorer(url, token=token).probe("100=", "100")
    assert capsys.readouterr().out.startswith(f"reward: remote verifier {shown} answered")
    service.reset("404")
    assert failure(scorer(url, token=token, concurrency=1)).startswith(
        f"reward.remote.url='{shown}': batch 0"
    )


@pytest.mark.usefixtures("registry")
def test_a_service_on_this_machine_is_reached_without_the_environments_proxy(
    service: ScoringService, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A proxy of the environment got the request (the token in cleartext over the network
    # the http:// check keeps it off) and answered in the service's stead.
    seen: list[str | None] = []

    class Proxy(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            pass

        def do_POST(self) -> None:
            seen.append(self.headers.get("Authorization"))
            self.send_response(502)
            self.send_header("Content-Length", "0")
            self.end_headers()

    proxy = ThreadingHTTPServer(("127.0.0.1", 0), Proxy)
    threading.Thread(target=proxy.serve_forever, args=(0.05,), daemon=True).start()
    try:
        monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{proxy.server_address[1]}")
        monkeypatch.delenv("no_proxy", raising=False)
        monkeypatch.delenv("NO_PROXY", raising=False)
        for url in (service.url, service.url.replace("127.0.0.1", "localhost")):
            scores, _ = score(scorer(url, token=TOKEN, max_retries=0))
            assert scores == EXPECTED
    finally:
        proxy.shutdown()
        proxy.server_close()
    assert seen == []
    assert service.authorization[-1] == f"Bearer {TOKEN}"


def test_the_first_batch_to_fail_for_good_is_the_stage_error(service: ScoringService) -> None:
    # Batch 0 meets a 503 and waits to retry; only then does batch 1 meet a reply that is not
    # JSON, which ends the stage and wakes batch 0, abandoned. Whichever of the two the
    # stage sees first, batch 1's error is the stage's (it was a 1-in-2 race: ten rounds).
    for _ in range(10):
        waiting = threading.Event()

        def choose(body: dict[str, Any], waiting: threading.Event = waiting) -> str:
            if body["responses"][0] == RESPONSES[0]:
                return "503"
            assert waiting.wait(timeout=30)
            return "malformed"

        service.reset()
        service.choose = choose
        out = _Watched("retrying in", waiting)
        remote = scorer(service.url, batch_size=5, max_retries=1, retry_backoff_s=60.0)
        with pytest.raises(RemoteRewardError) as info:
            remote.score(RESPONSES, ANSWERS, PROMPTS, stream=out)
        assert "batch 1 (responses 5-9): the reply is not JSON" in str(info.value)
        assert service.requests == 2, "batch 0 is not retried once the stage is over"


class _Watched(io.StringIO):
    """A console that sets ``event`` once a line with ``text`` is written to it."""

    def __init__(self, text: str, event: threading.Event) -> None:
        super().__init__()
        self.text, self.event = text, event

    def write(self, line: str) -> int:
        written = super().write(line)
        if self.text in line:
            self.event.set()
        return written


@pytest.mark.parametrize(
    ("reply", "said"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "the reply is nested too deeply to parse: '[[[["),
        (b'{"scores": [0.5, NaN]}', "the reply is not JSON (NaN is not a JSON number)"),
        (b'{"scores": [Infinity, 1]}', "the reply is not JSON (Infinity is not a JSON number)"),
        (b'{"scores": [0.5, \xff]}', "the reply is not JSON ('utf-8' codec can't decode"),
        (b'{"scores": [true, 1]}', "response 0 ('a') scored True; scores must be numbers"),
        (b'{"scores": [1, ' + b"9" * 5000 + b"]}", "the reply is not JSON (Exceeds the limit"),
    ],
    ids=["deep", "nan", "infinity", "not-utf8", "bool", "huge-int"],
)
def test_a_pathological_reply_breaks_the_protocol(reply: bytes, said: str) -> None:
    remote = scorer("http://127.0.0.1:9/score")
    batch = remote_module._Batch(0, 0, ["a", "b"], ["p", "p"], ["x", "x"])
    with pytest.raises(remote_module._Broken) as info:
        remote._scores(reply, batch)
    assert str(info.value).startswith(said)
    assert "\n" not in str(info.value) and len(str(info.value)) < 400


def test_the_token_comes_from_the_variable_auth_env_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cfg = RemoteRewardConfig(url="http://127.0.0.1:9/score", auth_env="SCORER_BEARER")
    monkeypatch.delenv("SCORER_BEARER", raising=False)
    with pytest.raises(UserError, match=r"^reward.remote.auth_env=SCORER_BEARER: the environment"):
        RemoteScorer.from_config(cfg)
    monkeypatch.setenv("SCORER_BEARER", "abc")
    # A token that short could not be masked without garbling every message.
    with pytest.raises(UserError) as info:
        RemoteScorer.from_config(cfg)
    assert str(info.value) == (
        "reward.remote.auth_env=SCORER_BEARER: the token in the variable is 3 characters long; "
        "at least 8 are needed (a shorter one could not be masked in messages without "
        "garbling them)"
    )
    monkeypatch.setenv("SCORER_BEARER", "abcd1234")
    assert RemoteScorer.from_config(cfg)._headers["Authorization"] == "Bearer abcd1234"
    assert RemoteScorer.from_config(RemoteRewardConfig()) is None


def test_a_long_stage_says_how_far_it_is(
    service: ScoringService, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(remote_module, "PROGRESS_EVERY_S", 0.1)
    service.reset("ok", "slow")
    service.delay_s = 0.4
    _, out = score(scorer(service.url, concurrency=1))
    assert f"reward: 1/3 batches (4/10 responses) scored by {service.url} in 0 s" in out


def test_the_probe_is_one_request_not_retried_on_a_service_that_is_down(
    service: ScoringService, monkeypatch: pytest.MonkeyPatch
) -> None:
    # It fails in seconds: the one request is refused at once, and never retried however
    # many retries the stages may make (counted, not timed).
    scorer(service.url).probe("100=", "100")
    assert service.batch_sizes == [1]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/score?model=small"
    down = scorer(url, max_retries=5)
    post, posts = down._post, []
    monkeypatch.setattr(down, "_post", lambda batch: posts.append(batch) or post(batch))
    with pytest.raises(UserError) as info:
        down.probe("100=", "100")
    assert len(posts) == 1
    shown = url.split("?")[0]
    assert str(info.value) == (
        f"reward.remote.url='{shown}': the start-up probe (one request scoring an empty "
        "response to the first training prompt) failed: the connection failed: Connection "
        "refused; start the service or correct the URL"
    )


def test_a_timeout_no_clock_can_wait_is_refused_at_load_and_the_longest_works(
    service: ScoringService,
) -> None:
    """reward.remote.timeout_s=1e10 and reward.timeout_s=5e6 passed the config, then every
    request (the start-up probe's first) raised ``OverflowError: timestamp out of range for
    platform time_t`` from the socket, and the math reward's verifier ``OverflowError:
    timeout is too large`` from its select: a traceback. Refused at load in one line; the
    longest accepted (a day) scores."""
    for field, value in (("reward.remote.timeout_s", 1e10), ("reward.timeout_s", 5e6)):
        with pytest.raises(ConfigError) as info:
            load_config("configs/ppo_tiny.yaml", [f"{field}={value!r}"])
        message = str(info.value)
        assert message.startswith(f"{field}={value!r}: ") and "\n" not in message
        assert f"less than or equal to {MAX_SECONDS:g}" in message
    assert score(scorer(service.url, timeout_s=MAX_SECONDS))[0] == EXPECTED


def test_a_slow_probe_says_it_waits(
    service: ScoringService, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The start-up probe waits up to reward.remote.timeout_s (up to a day) for a service that
    is slow to answer, as a scoring stage does: it says so every PROGRESS_EVERY_S, where it
    printed nothing until the answer."""
    monkeypatch.setattr(remote_module, "PROGRESS_EVERY_S", 0.05)
    service.reset("slow")
    service.delay_s = 1.0
    scorer(service.url, timeout_s=30.0).probe("100=", "100")
    out = capsys.readouterr().out
    waiting = f"reward: waiting for the remote verifier {service.url} to answer the start-up probe"
    assert re.search(rf"{re.escape(waiting)} \(\d+ s of reward.remote.timeout_s=30\)", out)
    assert f"reward: remote verifier {service.url} answered the probe in" in out
