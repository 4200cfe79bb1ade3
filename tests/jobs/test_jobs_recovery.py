"""Jobs that survive a lost node or a lost driver, on a real cluster started with `ray start`
(a head that runs drivers only, and two worker nodes of 2 CPUs; token authentication on):

- a worker node's raylet killed mid-run, a replacement node started: the run restarts in place
  from its latest checkpoint (``trainer.max_restarts``) and ends SUCCEEDED with the metrics of
  an uninterrupted run;
- the same without a replacement: the restart waits ``trainer.resource_timeout_s`` and fails,
  naming what it waited for;
- the job's driver killed: ``verlite submit --max-restarts 1 --wait`` resubmits it, and the
  resubmission resumes to the same metrics;
- four jobs submitted at once to nodes that fit two: each succeeds or fails for want of
  resources, none hangs, and each writes its own folder.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from multiprocessing.pool import ThreadPool
from pathlib import Path
from typing import Any

import pytest
from jobs_support import BIN, REPO, RayCluster, run_verlite, started_cluster

from verlite.config import load_config
from verlite.records.metrics_log import is_run_history

pytestmark = pytest.mark.cluster

CONFIG = "configs/ppo_tiny.yaml"
STEPS = 8
NODE_CPUS = 2
DONE = {"SUCCEEDED", "FAILED", "STOPPED"}


@pytest.fixture(scope="module")
def cluster() -> Iterator[RayCluster]:
    yield from started_cluster(0, [NODE_CPUS, NODE_CPUS])


def run_overrides(out: Path | None, *, nnodes: int, steps: int = STEPS) -> list[str]:
    """The main job with two ranks a role, on one node or spread over two (half a CPU a
    rank: both layouts fit beside each other), checkpointed every 3 steps."""
    cfg = load_config(REPO / CONFIG)
    overrides = [
        f"trainer.total_steps={steps}",
        f"trainer.nnodes={nnodes}",
        f"trainer.workers_per_node={2 // nnodes}",
        "trainer.cpus_per_worker=0.5",
        "trainer.val_freq=4",
        "trainer.save_freq=3",
        "critic.warmup_steps=0",  # the actor trains from the first step
    ]
    for role in ("actor", "critic"):
        section = getattr(cfg, role)
        micro = math.gcd(section.micro_batch_size_per_worker, section.ppo_mini_batch_size // 2)
        overrides.append(f"{role}.micro_batch_size_per_worker={micro}")
    return [*([f"trainer.output_dir={out}"] if out else []), *overrides]


def submit(cluster: RayCluster, *args: str) -> str:
    result = run_verlite(
        ["submit", "--address", cluster.url, "--config", CONFIG, *args], cluster.env()
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()[0]


def steps_logged(out: Path) -> int:
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def wait_for_steps(cluster: RayCluster, job_id: str, out: Path, steps: int) -> None:
    deadline = time.monotonic() + 300
    while steps_logged(out) < steps:
        job = cluster.job(job_id)
        assert job["status"] not in DONE, cluster.logs_of(job_id)[-3000:]
        assert time.monotonic() < deadline, f"{job_id}: {steps_logged(out)} steps after 300 s"
        time.sleep(0.2)


def records(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def trained(out: Path) -> list[dict[str, Any]]:
    """What a run trained, step by step: its metrics without those of its history."""
    return [{k: v for k, v in r.items() if not is_run_history(k)} for r in records(out)]


def nodes_of(out: Path) -> set[str]:
    return {w["node_id"] for w in json.loads((out / "workers.json").read_text())}


def wait_for_line(cluster: RayCluster, job_id: str, text: str, timeout: float) -> float:
    """When ``text`` first showed in the job's log (polled every 0.2 s)."""
    deadline = time.monotonic() + timeout
    while text not in cluster.logs_of(job_id):
        assert cluster.job(job_id)["status"] not in DONE, cluster.logs_of(job_id)[-3000:]
        assert time.monotonic() < deadline, f"no {text!r} in {job_id}'s log after {timeout:.0f} s"
        time.sleep(0.2)
    return time.monotonic()


def line_with(log: str, text: str) -> str:
    return next(line for line in log.splitlines() if text in line)


@pytest.fixture(scope="module")
def reference(cluster: RayCluster, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """The uninterrupted run, its two ranks a role on one node (submitted, not waited for)."""
    out = tmp_path_factory.mktemp("reference") / "run"
    return submit(cluster, *run_overrides(out, nnodes=1)), out


def report(capsys: pytest.CaptureFixture[str], text: str) -> None:
    """Print a measured figure past pytest's capture (docs/checkpoints-and-restarts.md quotes
    them)."""
    with capsys.disabled():
        print(text, flush=True)


def test_a_lost_node_is_replaced_and_the_run_ends_as_if_uninterrupted(
    cluster: RayCluster,
    reference: tuple[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "run"
    job_id = submit(cluster, *run_overrides(out, nnodes=2), "trainer.max_restarts=2")
    wait_for_steps(cluster, job_id, out, 5)
    reference_id, reference_out = reference
    wait_for_steps(cluster, reference_id, reference_out, 1)
    (victim,) = nodes_of(out) - nodes_of(reference_out)  # spare the reference's node
    cluster.kill_raylet(victim)
    killed = time.monotonic()
    cluster.add_node(num_cpus=NODE_CPUS, wait=False)  # the replacement joins meanwhile
    seen = wait_for_line(cluster, job_id, "restart 1 of 2", timeout=120)
    again = wait_for_line(cluster, job_id, "restart 1: training again", timeout=300)
    assert cluster.wait_for_status(job_id, DONE, timeout=600) == "SUCCEEDED"
    assert cluster.wait_for_status(reference_id, DONE, timeout=600) == "SUCCEEDED"

    log = cluster.logs_of(job_id)
    restart = line_with(log, "restart 1 of 2")
    assert (
        "worker group" in restart and "resuming from" in restart and "checkpoints/step_" in restart
    )
    report(
        capsys,
        f"\nkill -> failure seen {seen - killed:.1f} s, -> training again {again - killed:.1f} s "
        f"(+/- 0.2 s polling)\n{restart}\n{line_with(log, 'restart 1: training again')}",
    )
    assert victim not in nodes_of(out)  # placed again on the replacement
    assert trained(out) == trained(reference_out)
    assert [r["trainer/restarts"] for r in records(out)][-1] == 1.0
    assert {r["trainer/restarts"] for r in records(reference_out)} == {0.0}  # uninterrupted


def test_without_a_replacement_the_restart_fails_naming_what_it_waited_for(
    cluster: RayCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    timeout_s = 20
    job_id = submit(
        cluster,
        *run_overrides(out, nnodes=2, steps=40),
        "trainer.max_restarts=2",
        f"trainer.resource_timeout_s={timeout_s}",
    )
    wait_for_steps(cluster, job_id, out, 2)
    cluster.kill_raylet(sorted(nodes_of(out))[0])
    killed = time.monotonic()
    # One node is left: it could hold the run on one node, but the run asks for two.
    assert cluster.wait_for_status(job_id, DONE, timeout=timeout_s + 120) == "FAILED"
    report(
        capsys,
        f"\nkill -> FAILED {time.monotonic() - killed:.1f} s (resource timeout {timeout_s} s)",
    )
    log = cluster.logs_of(job_id)
    assert "restart 1 of 2" in log
    last = log.strip().splitlines()
    error = next(line for line in reversed(last) if line.startswith("verlite: error:"))
    assert f"cannot place pool 'actor+critic' within {timeout_s}s" in error
    assert "asked for 2 node(s) x 1 bundle(s) of {CPU 0.5}" in log
    cluster.add_node(num_cpus=NODE_CPUS)  # two worker nodes again for the next tests


def test_a_killed_driver_is_resubmitted_and_resumes_to_the_same_metrics(
    cluster: RayCluster, reference: tuple[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "run"
    command = [
        str(BIN / "verlite"),
        "submit",
        "--address",
        cluster.url,
        "--config",
        CONFIG,
        "--max-restarts",
        "1",
        "--wait",
        *run_overrides(out, nnodes=2),
    ]
    proc = subprocess.Popen(
        command,
        cwd=REPO,
        env=cluster.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    job_id = proc.stdout.readline().strip()
    stderr: list[str] = []
    reader = threading.Thread(target=lambda: stderr.extend(proc.stderr or []), daemon=True)
    reader.start()
    drain = threading.Thread(target=lambda: proc.stdout and proc.stdout.read(), daemon=True)
    drain.start()
    wait_for_steps(cluster, job_id, out, 4)
    os.kill(int(cluster.job(job_id)["driver_info"]["pid"]), signal.SIGKILL)
    assert proc.wait(timeout=600) == 0, "".join(stderr)[-3000:]
    reader.join(timeout=10)
    said = "".join(stderr)
    assert f"resubmitted as {job_id}-r1 (1 of 1, --max-restarts)" in said
    # It cannot see the folder (the cluster's): both outcomes, not "resuming from the latest
    # checkpoint" of a job that may have saved none.
    assert "or, where the job saved none, starts from the first step" in said
    assert f"job {job_id}-r1 SUCCEEDED" in said
    assert cluster.job(job_id)["status"] == "FAILED"

    reference_id, reference_out = reference
    assert cluster.wait_for_status(reference_id, DONE, timeout=600) == "SUCCEEDED"
    assert trained(out) == trained(reference_out)
    where = ["--address", cluster.url]
    first = run_verlite(["status", job_id, *where], cluster.env())
    assert first.stdout == "FAILED\n"
    assert f"resubmitted as {job_id}-r1: SUCCEEDED" in first.stderr
    second = run_verlite(["status", f"{job_id}-r1", *where], cluster.env())
    assert second.stdout == "SUCCEEDED\n"
    assert f"resubmission 1 of {job_id}, replacing {job_id}, whose driver died" in second.stderr


def test_jobs_beyond_the_clusters_room_wait_or_fail_for_resources_and_never_share_a_folder(
    cluster: RayCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    # A whole CPU a rank on each worker node: the cluster fits two of these jobs at once.
    overrides = [*run_overrides(None, nnodes=2, steps=2), "trainer.cpus_per_worker=1"]
    started = time.monotonic()
    with ThreadPool() as pool:
        jobs = pool.map(lambda _: submit(cluster, *overrides), range(4))
    statuses = {job: cluster.wait_for_status(job, DONE, timeout=900) for job in jobs}
    report(capsys, f"\n4 jobs ended within {time.monotonic() - started:.0f} s: {statuses}")
    folders = set()
    for job, status in statuses.items():
        log = cluster.logs_of(job)
        if status == "FAILED":
            assert "cannot place pool" in log, log[-3000:]
            continue
        assert status == "SUCCEEDED"
        folders.add(
            line_with(log, "trainer.output_dir=").split("trainer.output_dir=")[1].split()[0]
        )
    assert folders == {f"outputs/ppo_tiny/{job}" for job, s in statuses.items() if s == "SUCCEEDED"}
    assert len(folders) >= 2
