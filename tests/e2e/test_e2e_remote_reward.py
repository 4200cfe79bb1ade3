"""A whole run scored by a remote verifier (a real HTTP service on 127.0.0.1): failures a
retry mends lose no step, a service that stays down stops the run in one line, and the
resumed run logs what a run scored by the same rule in-process logs."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from scoring_service import ScoringService, scoring_service

from verlite import redaction
from verlite.cli import main
from verlite.config import load_config
from verlite.driver.preflight import RunInputs
from verlite.errors import UserError
from verlite.redaction import redacted_output
from verlite.rewards.remote import RemoteRewardError

# Two scoring requests a step (16 responses, 8 a batch); validation (8 prompts, one
# request) at the end; a checkpoint every step; no critic (one worker group to start).
RUN = (
    "algorithm.adv_estimator=reinforce_plus_plus",
    "trainer.total_steps=2",
    "data.train_batch_size=16",
    "data.num_val_samples=8",
    "trainer.save_freq=1",
)


@pytest.fixture(scope="module")
def service() -> Iterator[ScoringService]:
    with scoring_service() as started:
        yield started


def test_a_flaky_service_loses_no_step_and_one_that_stays_down_resumes(
    tmp_path: Path, service: ScoringService, train, metrics, capsys: pytest.CaptureFixture[str]
) -> None:
    local = train(tmp_path / "local", *RUN)
    assert local.reward.fn is None  # the copy task's own reward: digit_match, as the service's
    remote = (
        f"reward.remote.url={service.url}",
        "reward.remote.batch_size=8",
        "reward.remote.timeout_s=0.5",
        "reward.remote.retry_backoff_s=0",
    )
    out = tmp_path / "remote"
    # The probe, then a 500, a reply past the timeout and a dropped connection in step 1
    # (each retried); down for good after step 1 (3 replies).
    service.reset("ok", "500", "slow", "drop")
    service.down_after = 3
    capsys.readouterr()
    with pytest.raises(RemoteRewardError) as stopped:
        train(out, *RUN, *remote)
    said = capsys.readouterr().out
    for failure in (
        "HTTP 500 Internal Server Error",
        "no whole reply within 0.5 s",
        "Remote end closed connection without response",
    ):
        assert failure in said
    assert str(stopped.value).startswith(f"reward.remote.url='{service.url}': batch ")
    assert "HTTP 500 Internal Server Error" in str(stopped.value)
    assert "after 4 attempt(s) (reward.remote.max_retries=3)" in str(stopped.value)
    assert [r["step"] for r in metrics(out)] == [1]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_1"]
    # What a new run of the folder does (the driver's word; the service cannot know).
    assert str(stopped.value).endswith(
        "the service stays down or failing: run again once it answers; a new `verlite train` "
        f"with trainer.resume=auto continues from {out / 'checkpoints' / 'step_1'}"
    ), str(stopped.value)

    service.reset()  # back up: the run resumes from its last checkpoint
    train(out, *RUN, *remote)
    assert "resumed from" in capsys.readouterr().out
    # The same rule scored remotely: its source's metrics are the local run's reward/fn/*.
    resumed = [
        {key.replace("reward/remote/", "reward/fn/"): value for key, value in record.items()}
        for record in metrics(out, stable_only=True)
    ]
    assert resumed == metrics(tmp_path / "local", stable_only=True)


def test_a_service_that_is_down_fails_the_start_before_ray(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/score"
    cfg = load_config(
        "configs/ppo_tiny.yaml", [f"reward.remote.url={url}", f"trainer.output_dir={tmp_path}/run"]
    )
    with pytest.raises(UserError, match=rf"^reward.remote.url='{url}': the start-up probe "):
        RunInputs.load(cfg)
    assert not (tmp_path / "run").exists()


# A variable named like no credential: the token is masked for being the token, whatever
# holds it. Its spellings differ (repr, JSON, URL).
TOKEN_VARIABLE, TOKEN = "VERIFIER_BEARER", 'vt-51Hx/q+"Zk9wQ'


@pytest.fixture
def token(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(redaction, "_registered", set())  # registered for this test only
    monkeypatch.setenv(TOKEN_VARIABLE, TOKEN)
    return TOKEN


def test_the_cli_never_shows_the_token_a_service_echoes(
    tmp_path: Path, service: ScoringService, token: str, capfd: pytest.CaptureFixture[str]
) -> None:
    # The probe meets the token as the status line's reason: one line, exit 2, before Ray.
    service.reset("token_reason_401")
    code = main(
        [
            "train",
            "--config",
            "configs/ppo_tiny.yaml",
            f"reward.remote.url={service.url}",
            f"reward.remote.auth_env={TOKEN_VARIABLE}",
            f"trainer.output_dir={tmp_path}/run",
        ]
    )
    out, err = capfd.readouterr()
    assert code == 2
    # The last line (the shared Ray may still be forwarding an earlier test's worker lines).
    said = err.splitlines()[-1]
    assert said.startswith(f"verlite: error: reward.remote.url='{service.url}': the start-up ")
    assert "HTTP 401 ***" in said
    assert "51Hx" not in out + err


def test_a_run_never_shows_or_records_the_token_a_service_echoes(
    tmp_path: Path, service: ScoringService, token: str, train, capfd: pytest.CaptureFixture[str]
) -> None:
    # Step 1: the token as a 503's reason (retried, the retry said); step 2: as a score.
    service.reset("ok", "token_reason_503", "ok", "ok", "token_score")
    out = tmp_path / "run"
    capfd.readouterr()
    with redacted_output(), pytest.raises(RemoteRewardError) as stopped:
        train(
            out,
            *RUN,
            f"reward.remote.url={service.url}",
            f"reward.remote.auth_env={TOKEN_VARIABLE}",
            "reward.remote.batch_size=8",
            "reward.remote.retry_backoff_s=0",
            "trainer.loggers=[console,jsonl,logline]",
        )
    said, err = capfd.readouterr()
    assert "HTTP 503 ***: '{}'; retrying in 0 s (attempt 2 of 4)" in said
    assert "scored '***'; scores must be numbers in [0, 1]" in str(stopped.value)
    assert service.authorization[0] == f"Bearer {token}"
    written = [p.read_bytes() for p in out.rglob("*") if p.is_file()]
    assert any(b'"step": 1' in text for text in written), "metrics.jsonl holds step 1"
    for text in (said, err, str(stopped.value), *map(repr, written)):
        assert "51Hx" not in text
