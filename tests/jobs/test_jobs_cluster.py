"""verlite's job commands against a real two-node Ray cluster with token authentication: a run
submitted and followed to SUCCEEDED over both nodes, its metrics, log, status and listing, a
run stopped while running, and the errors of an unknown job and of missing or wrong tokens."""

from __future__ import annotations

import json
import math
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from jobs_support import REPO, RayCluster, client_env, run_verlite

from verlite.config import load_config
from verlite.jobs.entrypoint import shown_command

pytestmark = pytest.mark.cluster

CONFIG = "configs/ppo_tiny.yaml"


def two_node_overrides(steps: int) -> list[str]:
    """The main job for ``steps`` steps, its actor and critic spread over both nodes (with
    micro-batches that fit each worker's half of a mini-batch)."""
    cfg = load_config(REPO / CONFIG)
    overrides = [f"trainer.total_steps={steps}", "trainer.val_freq=0", "trainer.nnodes=2"]
    overrides.append("critic.warmup_steps=0")  # the actor's update spans both nodes too
    for role in ("actor", "critic"):
        section = getattr(cfg, role)
        micro = math.gcd(section.micro_batch_size_per_worker, section.ppo_mini_batch_size // 2)
        overrides.append(f"{role}.micro_batch_size_per_worker={micro}")
    return overrides


def assert_one_line_error(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("verlite: error: ")
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in result.stderr


@pytest.fixture(scope="module")
def finished_job(ray_cluster: RayCluster) -> tuple[str, subprocess.CompletedProcess[str]]:
    """`verlite submit --wait` of a 2-step run over both nodes: its job id and the process."""
    started = time.monotonic()
    where = ["--address", ray_cluster.url]
    submit = ["submit", *where, "--wait", "--config", CONFIG, *two_node_overrides(2)]
    result = run_verlite(submit, ray_cluster.env())
    print(f"submit --wait: {time.monotonic() - started:.1f} s")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout.splitlines()[0], result


def test_submit_wait_follows_the_run_to_success_on_both_nodes(
    ray_cluster: RayCluster, finished_job: tuple[str, subprocess.CompletedProcess[str]]
) -> None:
    job_id, result = finished_job
    assert job_id.startswith("raysubmit_")
    assert "on 2 nodes" in result.stdout  # the placement report: training spanned both nodes
    assert "step 2/2" in result.stdout
    assert f"job {job_id} SUCCEEDED" in result.stderr
    job = ray_cluster.job(job_id)
    assert job["status"] == "SUCCEEDED"
    # The head has no verlite on its PATH; the entrypoint found it beside Ray's Python.
    assert shutil.which("verlite", path=ray_cluster.head_path()) is None
    command = shown_command(job["entrypoint"])
    assert command.startswith(f"verlite train --config {CONFIG} ")
    assert command.endswith("trainer.ray_address=auto 'trainer.loggers=[console,jsonl,logline]'")
    assert ray_cluster.token not in result.stdout + result.stderr


def test_read_job_metrics_returns_one_record_per_step(
    ray_cluster: RayCluster, finished_job: tuple[str, subprocess.CompletedProcess[str]]
) -> None:
    job_id, _ = finished_job
    code = (
        "import json, sys\n"
        "from verlite.jobs import read_job_metrics\n"
        "print(json.dumps(read_job_metrics(sys.argv[1], sys.argv[2])))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, ray_cluster.url, job_id],
        env=ray_cluster.env(),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    records: list[dict[str, Any]] = json.loads(result.stdout)
    assert [r["step"] for r in records] == [1, 2]
    assert all(isinstance(r["critic/score/mean"], float) for r in records)


def test_status_logs_and_follow_print_the_finished_job(
    ray_cluster: RayCluster, finished_job: tuple[str, subprocess.CompletedProcess[str]]
) -> None:
    job_id, _ = finished_job
    where = ["--address", ray_cluster.url]
    status = run_verlite(["status", job_id, *where], ray_cluster.env())
    assert (status.returncode, status.stdout) == (0, "SUCCEEDED\n")
    for follow in ([], ["--follow"]):
        logs = run_verlite(["logs", job_id, *where, *follow], ray_cluster.env())
        assert logs.returncode == 0, logs.stderr
        assert "step 2/2" in logs.stdout
        assert logs.stdout.count('VERLITE_METRICS {"step": ') == 2


def test_stop_ends_a_running_job_and_list_shows_every_job(
    ray_cluster: RayCluster, finished_job: tuple[str, subprocess.CompletedProcess[str]]
) -> None:
    where = ["--address", ray_cluster.url]
    submitted = run_verlite(
        ["submit", *where, "--config", CONFIG, *two_node_overrides(10_000)], ray_cluster.env()
    )
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    ray_cluster.wait_for_status(job_id, {"RUNNING"}, timeout=120)

    stopped = run_verlite(["stop", job_id, *where], ray_cluster.env())
    assert (stopped.returncode, stopped.stdout) == (0, f"stop requested for {job_id}\n")
    ray_cluster.wait_for_status(job_id, {"STOPPED", "FAILED", "SUCCEEDED"}, timeout=60)
    status = run_verlite(["status", job_id, *where], ray_cluster.env())
    assert status.stdout == "STOPPED\n"

    listed = run_verlite(["list", *where], ray_cluster.env())
    assert listed.returncode == 0, listed.stderr
    rows = {line.split()[0]: line.split()[1] for line in listed.stdout.splitlines()[1:]}
    assert rows == {finished_job[0]: "SUCCEEDED", job_id: "STOPPED"}


def test_an_unknown_job_id_is_a_one_line_error(ray_cluster: RayCluster) -> None:
    for command in ("status", "stop"):
        result = run_verlite(
            [command, "raysubmit_nope", "--address", ray_cluster.url], ray_cluster.env()
        )
        assert_one_line_error(result, "no job 'raysubmit_nope'", ray_cluster.url)


def test_a_wrong_token_is_rejected_without_being_printed(ray_cluster: RayCluster) -> None:
    wrong = secrets.token_hex(32)
    result = run_verlite(
        ["list", "--address", ray_cluster.url], ray_cluster.env(RAY_AUTH_TOKEN=wrong)
    )
    assert_one_line_error(result, "rejected the Ray token from RAY_AUTH_TOKEN")
    assert wrong not in result.stdout + result.stderr
    assert ray_cluster.token not in result.stdout + result.stderr


def test_a_missing_token_says_how_to_provide_one(ray_cluster: RayCluster, tmp_path: Path) -> None:
    # HOME without ~/.ray/auth_token: no token anywhere.
    no_mode = ray_cluster.env(HOME=str(tmp_path))
    del no_mode["RAY_AUTH_MODE"], no_mode["RAY_AUTH_TOKEN_PATH"]
    result = run_verlite(["list", "--address", ray_cluster.url], no_mode)
    assert_one_line_error(result, "requires a Ray token: set RAY_AUTH_MODE=token")

    no_token = {**no_mode, "RAY_AUTH_MODE": "token"}
    result = run_verlite(["list", "--address", ray_cluster.url], no_token)
    assert_one_line_error(result, "RAY_AUTH_MODE=token but no Ray token was found")

    unreadable = {**no_token, "RAY_AUTH_TOKEN_PATH": str(tmp_path / "missing")}
    result = run_verlite(["list", "--address", ray_cluster.url], unreadable)
    assert_one_line_error(result, "cannot be read or is empty")


def test_a_driver_here_joins_a_loopback_cluster_by_its_address(
    ray_cluster: RayCluster, tmp_path: Path
) -> None:
    """`ray start --node-ip-address=127.0.0.1` registers this machine's routable IP: a driver
    given the head's 127.0.0.1 address attaches to the raylet here whatever address it
    registered (it waited 30 s for a raylet at 127.0.0.1, then said no cluster answered); one
    without the cluster's token is told so in one line, exit 2."""
    args = [
        "train",
        "--config",
        "configs/ppo_tiny.yaml",
        f"trainer.ray_address={ray_cluster.gcs_address}",
        "trainer.total_steps=1",
        "trainer.val_freq=0",
        "critic.warmup_steps=0",
    ]
    run = run_verlite([*args, f"trainer.output_dir={tmp_path / 'run'}"], ray_cluster.env())
    assert run.returncode == 0, run.stderr[-3000:]
    assert "step 1/1 |" in run.stdout
    refused = run_verlite([*args, f"trainer.output_dir={tmp_path / 'no_token'}"], client_env())
    assert refused.returncode == 2, refused.stderr[-3000:]
    # Before it, Ray's C++ client logs each of its retries (its own lines, not verlite's).
    last = refused.stderr.splitlines()[-1]
    assert "Traceback" not in refused.stderr and last.startswith("verlite: error: ")
    assert "the cluster refused this driver's authentication token" in last
    assert ray_cluster.token not in refused.stderr
