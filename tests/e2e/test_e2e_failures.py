"""Failures of a real run: a killed worker, a resume that loses nothing, secrets kept out."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from verlite.driver.checkpoint import complete_checkpoints
from verlite.driver.trainer import divergence
from verlite.rewards.scoring import RewardError

RUN = [
    "trainer.workers_per_node=2",
    "data.num_val_samples=8",
    "data.train_batch_size=32",
    "actor.ppo_mini_batch_size=16",
    "critic.ppo_mini_batch_size=32",
    "actor.micro_batch_size_per_worker=4",
    "critic.micro_batch_size_per_worker=8",
    "trainer.val_freq=4",
    "trainer.save_freq=2",
    "trainer.total_steps=8",
    "critic.warmup_steps=0",  # the actor trains (and is checkpointed) from the first step
]
SECRET = "s3cr3t-token-value-0451"
# `verlite train` in a process of its own, with its own embedded Ray, whose workers (or node) a
# test kills: 20-50 s each, so with the cluster tests (`make test-cluster`, run by CI).
OWN_RAY = pytest.mark.cluster


def command(out: Path, *overrides: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "verlite.cli",
        "train",
        "--config",
        "configs/ppo_tiny.yaml",
        f"trainer.output_dir={out}",
        *RUN,
        *overrides,
    ]


def steps_logged(out: Path) -> int:
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def actor_rank_1(out: Path) -> int:
    """The process of the actor's rank 1 (as the latest placement report records it)."""
    workers = json.loads((out / "workers.json").read_text())
    pid: int = next(w["pid"] for w in workers if w["role"] == "actor" and w["rank"] == 1)
    return pid


def wait_until(ready, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.05)


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory, train_for_module) -> Path:
    """The uninterrupted run, in-process on the shared Ray."""
    out = tmp_path_factory.mktemp("straight") / "run"
    train_for_module(out, *RUN)
    return out


@OWN_RAY
def test_a_lost_worker_restarts_the_run_in_place_until_max_restarts_are_spent(
    tmp_path: Path, straight: Path, metrics
) -> None:
    out = tmp_path / "restarted"
    proc = subprocess.Popen(
        command(out, "trainer.max_restarts=1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_until(lambda: steps_logged(out) >= 3, proc)  # past the checkpoint of step 2
    first = actor_rank_1(out)
    os.kill(first, signal.SIGKILL)
    # Placed again (a new placement report), then trained past the checkpoint it resumed.
    wait_until(lambda: actor_rank_1(out) != first, proc)
    resumed_at = steps_logged(out)
    wait_until(lambda: steps_logged(out) > resumed_at + 1, proc)
    os.kill(actor_rank_1(out), signal.SIGKILL)
    stdout, stderr = proc.communicate(timeout=120)

    (restart,) = [line for line in stdout.splitlines() if line.startswith("restart 1 of 1")]
    assert "worker group 'actor': rank 1" in restart and "worker process died" in restart
    assert re.search(r"resuming from \S+/checkpoints/step_[24]$", restart), restart
    # Lost once more than max_restarts: exit 1 naming the last loss.
    assert proc.returncode == 1, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("verlite: error: worker group 'actor': rank 1"), stderr[-3000:]
    # ... and what a new run of the folder does: continue from the checkpoint it resumed past.
    assert re.search(
        r"\(after 1 restart; trainer\.max_restarts=1\); a new `verlite train` with "
        r"trainer\.resume=auto continues from \S+/checkpoints/step_\d+$",
        last,
    ), last
    # What the restarted run logged is the uninterrupted run's, step for step.
    logged = metrics(out, stable_only=True)
    assert len(logged) >= 4 and logged == metrics(straight, stable_only=True)[: len(logged)]
    restarts = [r["trainer/restarts"] for r in metrics(out)]
    assert restarts[0] == 0 and restarts[-1] == 1


@OWN_RAY
def test_killed_worker_stops_the_run_and_resume_matches_an_uninterrupted_run(
    tmp_path: Path, straight: Path, train, metrics, capsys: pytest.CaptureFixture[str], monkeypatch
) -> None:
    env = {**os.environ, "VERLITE_TEST_SECRET": SECRET, "RAY_AUTH_TOKEN": SECRET}

    out = tmp_path / "crashed"
    proc = subprocess.Popen(
        command(out), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    deadline = time.monotonic() + 300
    while steps_logged(out) < 3:  # two checkpoints' worth of progress, then a worker dies
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    actor = next(
        w
        for w in json.loads((out / "workers.json").read_text())
        if w["role"] == "actor" and w["rank"] == 1
    )
    os.kill(actor["pid"], signal.SIGKILL)
    _, stderr = proc.communicate(timeout=60)  # a hang guard only
    assert proc.returncode == 1
    last = stderr.strip().splitlines()[-1]
    # Seen as the process's death (the message says so), not as a timeout.
    assert "actor" in last and "rank 1" in last and "worker process died" in last, stderr[-3000:]
    assert "Traceback" not in stderr
    checkpoints = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert "step_2" in checkpoints

    # The resumed run goes on in-process, on the shared Ray (a second fresh Ray costs seconds).
    monkeypatch.setenv("VERLITE_TEST_SECRET", SECRET)
    capsys.readouterr()
    train(out, *RUN)
    resumed = capsys.readouterr()
    assert "resumed from" in resumed.out
    assert metrics(out, stable_only=True) == metrics(straight, stable_only=True)

    # nothing the run wrote or printed carries the environment's secrets
    for path in out.rglob("*"):
        if path.is_file() and path.suffix in {".json", ".jsonl", ".txt", ".yaml"}:
            assert SECRET not in path.read_text(errors="ignore"), path
    assert SECRET not in resumed.out + resumed.err + stderr


@pytest.mark.parametrize("policy", ["truncate", "drop"])
def test_prompts_over_the_limit_are_counted(
    tmp_path: Path, train, policy: str, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "prompts.jsonl"
    lines = [{"prompt": f"{i:03d}=", "answer": f"{i:03d}"} for i in range(40)]
    lines += [{"prompt": "1234567890123=", "answer": "1"}] * 3
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    # Validation's were cut without a count.
    held_out = tmp_path / "validation.jsonl"
    held_out.write_text("".join(json.dumps(x) + "\n" for x in lines[-8:]))
    train(
        tmp_path / "run",
        *RUN,
        "data.task=null",
        f"data.train_file={prompts}",
        f"data.val_file={held_out}",
        f"data.prompt_overflow={policy}",
        "trainer.total_steps=1",
        "trainer.workers_per_node=1",
        "actor.micro_batch_size_per_worker=8",
        "critic.micro_batch_size_per_worker=8",
    )
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    counts = {key: value for key, value in record.items() if key.endswith("_prompts")}
    if policy == "truncate":
        assert counts == {"data/truncated_prompts": 3, "val/data/truncated_prompts": 3}
        return
    assert counts == {
        "data/truncated_prompts": 0,
        "data/dropped_prompts": 3,
        "val/data/truncated_prompts": 0,
        "val/data/dropped_prompts": 3,
    }
    out = capsys.readouterr().out
    for split, total in (("train", 43), ("validation", 8)):
        assert (
            f"data.prompt_overflow=drop: 3 of {total} {split} prompts are longer than "
            "data.max_prompt_length=8 tokens and left out\n"
        ) in out


def test_divergence_stops_after_the_configured_streak() -> None:
    assert (
        divergence({"actor/nonfinite_streak": 2.0, "critic/nonfinite_streak": 0.0}, limit=3) is None
    )
    error = divergence({"actor/nonfinite_streak": 0.0, "critic/nonfinite_streak": 3.0}, limit=3)
    assert error is not None
    assert re.search(r"critic: 3 consecutive updates skipped .*max_consecutive_skips=3", str(error))


def test_a_reward_that_raises_stops_the_run_in_one_line(tmp_path: Path, train, monkeypatch) -> None:
    # In-process on the shared Ray: the CLI prints a UserError in one line with exit 2
    # (tests/test_cli_errors.py); here, the run stops with the message that line shows.
    (tmp_path / "userreward.py").write_text(
        "def score(response, answer, prompt):\n    raise ValueError(f'cannot parse {response!r}')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RewardError) as raised:
        train(tmp_path / "run", "reward.fn=userreward:score", "trainer.total_steps=1")
    message = str(raised.value)
    assert message.startswith("reward function userreward:score raised on response 0")
    assert "ValueError: cannot parse" in message and "\n" not in message
    # ... ending, as every error that ends a run, on what a new run of its folder does (a
    # user error met mid-run used to end without it).
    assert re.search(
        r"; no checkpoint saved \(trainer.save_freq=0 saves none\): a new `verlite train` of "
        r"\S+ starts from the first step, with trainer.overwrite=true to move this run's files "
        r"aside$",
        message,
    ), message


def test_someones_folder_is_left_untouched(tmp_path: Path, cli) -> None:
    out = tmp_path / "theirs"
    out.mkdir()
    (out / "config.json").write_text('{"mine": true}')
    proc = cli(
        "train", "--config", "configs/ppo_tiny.yaml", f"trainer.output_dir={out}", timeout=120
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "is not empty (it holds config.json)" in proc.stderr
    assert [p.name for p in out.iterdir()] == ["config.json"]
    assert (out / "config.json").read_text() == '{"mine": true}'


@OWN_RAY
def test_sigterm_stops_the_run_in_one_line_with_its_files_whole(tmp_path: Path) -> None:
    # `verlite stop` and schedulers' preemption send SIGTERM; the run used to exit 15 silently.
    out = tmp_path / "run"
    proc = subprocess.Popen(
        command(out, "trainer.total_steps=200", "trainer.workers_per_node=1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 300
    while steps_logged(out) < 1:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == "verlite: terminated (SIGTERM)"
    # What a new run of the folder does, by what the stopped run left there.
    saved = complete_checkpoints(out)
    said = (
        f"stopped: a new `verlite train` with trainer.resume=auto continues from {saved[-1]}"
        if saved
        else "stopped: no checkpoint saved yet (trainer.save_freq=2)"
    )
    assert said in stdout, stdout
    assert "Traceback" not in stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))


@OWN_RAY
def test_the_embedded_rays_node_dying_stops_the_run_in_one_line_without_a_restart(
    tmp_path: Path,
) -> None:
    """Its raylet killed, the embedded session has no node to restart on: the run says so
    and ends (exit 1), rather than a "worker process died" restart into a wait for a node."""
    out = tmp_path / "run"
    proc = subprocess.Popen(
        command(out, "trainer.total_steps=200", "trainer.max_restarts=2"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_until(lambda: steps_logged(out) >= 1, proc)
    (raylet,) = [
        pid
        for pid in descendants(proc.pid)
        if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].endswith(b"/raylet")
    ]
    os.kill(raylet, signal.SIGKILL)
    try:
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()  # a run that restarted into a wait for a node is not left behind
    assert proc.returncode == 1, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("verlite: error: the embedded Ray's node is gone (its raylet")
    # What a new run of the folder does, by what the run left there (the driver's line, or
    # the node watcher's when Ray ended the driver first: both the same).
    saved = complete_checkpoints(out)
    said = (
        f"; a new `verlite train` with trainer.resume=auto continues from {saved[-1]}"
        if saved
        else "; no checkpoint saved yet (trainer.save_freq=2): a new `verlite train` of "
        f"{out} starts from the first step, with trainer.overwrite=true to move this run's "
        "files aside"
    )
    assert last.endswith(said) and "restart 1" not in stdout, last


def descendants(pid: int) -> list[int]:
    """The processes ``pid`` started, and theirs (the embedded Ray's GCS, raylet, workers)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry.name))
    found, queue = [], [pid]
    while queue:
        found.extend(kids := children.get(queue.pop(), []))
        queue.extend(kids)
    return found
