"""What a stopped or failed run says a new run of its output folder does
(``output_folder.stopped_run_hint``): a Ctrl-C or SIGTERM, every run failure (a worker that
died or raised, a lost node, a diverged run, a reward service that stays down) and the
watcher's line when Ray ends the driver with its node. Each is checked against what the
folder's contract then does (``prepare_output_folder``), with and without a checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from checkpoint_support import fake_checkpoint

from verlite import load_config
from verlite.config import Config, ConfigError
from verlite.controller import WorkerGroupError
from verlite.controller.session import NODE_GONE
from verlite.driver import output_folder
from verlite.driver import run as driver_run
from verlite.driver import trainer as driver_trainer
from verlite.driver.output_folder import prepare_output_folder
from verlite.driver.trainer import Trainer, divergence
from verlite.errors import RunFailure
from verlite.policy_folder import INCOMPLETE_MARK, POLICY_FOLDER
from verlite.rewards.remote import RemoteRewardError

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "ppo_tiny.yaml"
PROMPTS = {"records": 8, "sha256": "0" * 64}  # fake checkpoints record none: any passes


def config(out: Path, **fields: Any) -> Config:
    return load_config(CONFIG, {"trainer.output_dir": str(out), **fields})


def checkpoint(out: Path, step: int) -> Path:
    """``out``'s checkpoint of ``step``, saved under the settings :func:`new_run_of` runs."""
    return fake_checkpoint(
        out, step, ["actor", "critic"], config=config(out).model_dump(mode="json")
    )


def new_run_of(out: Path, **fields: Any) -> Path | str | None:
    """What a new ``verlite train`` of ``out`` does: the checkpoint it continues from, None
    (the first step), or the one-line refusal."""
    try:
        resume_from, hold = prepare_output_folder(config(out, **fields), train_set=PROMPTS)
    except ConfigError as exc:
        return str(exc)
    hold.release()
    return resume_from


def worker_failure(*, lost: bool, cause: str) -> WorkerGroupError:
    return WorkerGroupError(
        group="rollout",
        rank=0,
        node_id="f" * 40,
        node_ip="127.0.0.1",
        method="generate",
        cause=cause,
        lost=lost,
    )


# The failures a run ends with, as their own builders make them.
FAILURES = {
    "diverged": lambda: divergence({"actor/nonfinite_streak": 3.0}, limit=3),
    "service down": lambda: RemoteRewardError(
        "reward.remote.url='http://127.0.0.1:1/score': batch 0 (responses 0-3): connection "
        "refused, after 3 attempt(s) (reward.remote.max_retries=2); the service stays down or "
        "failing: run again once it answers"
    ),
    "weight sync": lambda: worker_failure(
        lost=False, cause="WeightSyncError: weights of version 3 failed their check"
    ),
    "worker died": lambda: worker_failure(lost=True, cause="the worker process died"),
    "node lost": lambda: worker_failure(lost=True, cause="the worker process died"),
}


@pytest.mark.parametrize("name", list(FAILURES))
def test_a_failed_run_says_what_a_new_run_of_its_folder_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    # Each of these promised "trainer.resume=auto continues from the last (latest)
    # checkpoint" whatever the folder held; the main job (trainer.save_freq=0) holds none,
    # and a new run of its folder is refused.
    out = tmp_path / "run"
    inputs = SimpleNamespace(resume_from=None, folder=SimpleNamespace(release=lambda: None))
    if name == "node lost":
        gone = NODE_GONE.format(gone="raylet (exit code -9)")
        monkeypatch.setattr(driver_run, "lost_embedded_node", lambda: gone)
    written: list[str] = []

    def failed(*args: object) -> None:
        # The run wrote its records; the checkpoint was written before, when one is there.
        out.mkdir(exist_ok=True)
        (out / "metrics.jsonl").write_text('{"step": 1}\n')
        raise FAILURES[name]()

    monkeypatch.setattr(driver_run, "_attempt", failed)
    monkeypatch.setattr(driver_run, "say_after_node_loss", written.append)

    def message(**fields: Any) -> str:
        with pytest.raises(RunFailure) as info:
            driver_run.run(config(out, **fields), inputs)  # type: ignore[arg-type]
        said = str(info.value)
        assert "\n" not in said and "last checkpoint" not in said, said
        assert "latest checkpoint" not in said, said
        return said

    said = message(**{"trainer.save_freq": 0})
    assert said.endswith(
        f"; no checkpoint saved (trainer.save_freq=0 saves none): a new `verlite train` of {out} "
        "starts from the first step, with trainer.overwrite=true to move this run's files aside"
    ), said
    assert "is not empty" in str(new_run_of(out))
    assert new_run_of(out, **{"trainer.overwrite": True}) is None
    # The watcher's line, told as the run started (an empty folder then: a fresh start).
    assert written == [
        f"no checkpoint saved (trainer.save_freq=0 saves none): a new `verlite "
        f"train` of {out} starts from the first step"
    ]

    for path in out.iterdir():  # what overwrite=true moved aside
        path.unlink()
    step_2 = checkpoint(out, 2)
    said = message(**{"trainer.save_freq": 2})
    assert said.endswith(
        f"; a new `verlite train` with trainer.resume=auto continues from {step_2}"
    )
    assert new_run_of(out) == step_2


@pytest.mark.parametrize("stop", [SystemExit(15), KeyboardInterrupt()], ids=["SIGTERM", "Ctrl-C"])
def test_a_stopped_run_says_what_a_new_run_of_its_folder_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], stop
) -> None:
    # `verlite stop` of the main job (trainer.save_freq=0) used to end on "trainer.resume=auto
    # continues from the last checkpoint", and the new run was then refused: there was none.
    out = tmp_path / "run"
    inputs = SimpleNamespace(resume_from=None, folder=SimpleNamespace(release=lambda: None))

    def stopped(*args: object) -> None:
        raise stop

    monkeypatch.setattr(driver_run, "_attempt", stopped)

    def line(save_freq: int) -> str:
        with pytest.raises(type(stop)):
            driver_run.run(config(out, **{"trainer.save_freq": save_freq}), inputs)  # type: ignore[arg-type]
        return capsys.readouterr().out

    # Stopped before it wrote anything: the folder takes a fresh run as it is.
    said = line(5)
    assert (
        f"stopped: no checkpoint saved yet (trainer.save_freq=5): a new `verlite train` of {out} starts from the first step\n"
        in said
    ), said
    assert new_run_of(out) is None
    out.mkdir(exist_ok=True)
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    said = line(0)
    assert "no checkpoint saved (trainer.save_freq=0 saves none)" in said, said
    assert "trainer.overwrite=true to move this run's files aside" in said
    assert "continues" not in said
    assert "is not empty" in str(new_run_of(out))
    step_5 = checkpoint(out, 5)
    assert f"trainer.resume=auto continues from {step_5}" in line(5)
    assert new_run_of(out) == step_5


def test_each_checkpoint_saved_tells_the_node_watcher_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The watcher's line, printed after Ray ended the driver, said "continues from the latest
    # checkpoint" whatever the folder held when it died.
    out = tmp_path / "run"
    written: list[str] = []
    monkeypatch.setattr(driver_trainer, "say_after_node_loss", written.append)
    cfg = config(out, **{"trainer.save_freq": 3, "trainer.max_checkpoints": 1})
    trainer: Any = SimpleNamespace(cfg=cfg, saved=[], output_dir=out)
    for step in (3, 6):
        tmp = checkpoint(out, step).rename(out / "checkpoints" / f"step_{step}.tmp")
        Trainer.place_checkpoint(trainer, tmp, 0.1)
    assert written == [
        f"a new `verlite train` with trainer.resume=auto continues from {out / 'checkpoints' / f'step_{step}'}"
        for step in (3, 6)
    ]
    assert new_run_of(out) == out / "checkpoints" / "step_6"


def test_an_incomplete_export_says_what_a_new_run_of_its_folder_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The main job (trainer.save_freq=0) stopped while it wrote hf_actor: `verlite export`
    # said "run it again as it was (trainer.resume=auto) to export it from its last
    # checkpoint", and the new run was refused: there was none.
    from verlite.cli import main

    out = tmp_path / "run"
    (out / POLICY_FOLDER).mkdir(parents=True)
    (out / INCOMPLETE_MARK).touch()
    settings = config(out).model_dump(mode="json")
    (out / "config.json").write_text(json.dumps(settings))

    def said() -> str:
        assert main(["export", str(out)]) == 2
        return capsys.readouterr().err

    assert said().endswith(
        "before it exported its last policy whole; no checkpoint saved (trainer.save_freq=0 "
        f"saves none): a new `verlite train` of {out} starts from the first step, with "
        "trainer.overwrite=true to move this run's files aside\n"
    )
    assert "is not empty" in str(new_run_of(out))
    (out / "config.json").write_text("{torn")  # its save_freq unknown: not guessed
    assert "whole; no checkpoint saved: a new `verlite train` of" in said()
    last = checkpoint(out, settings["trainer"]["total_steps"])
    assert said().endswith(
        f"whole; a new `verlite train` with trainer.resume=auto continues from {last}\n"
    )
    assert new_run_of(out) == last  # to export alone


def test_a_stop_whose_folder_cannot_be_read_still_stops_as_it_was_told(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The hint is read from the folder while the run stops: a folder that cannot be read is
    said so, and the stop (SIGTERM's exit) is not replaced by the error."""
    out = tmp_path / "run"
    inputs = SimpleNamespace(resume_from=None, folder=SimpleNamespace(release=lambda: None))

    def stopped(*args: object) -> None:
        raise SystemExit(143)

    def unreadable(folder: object) -> list[Path]:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(driver_run, "_attempt", stopped)
    monkeypatch.setattr(output_folder, "complete_checkpoints", unreadable)
    with pytest.raises(SystemExit) as stop:
        driver_run.run(config(out, **{"trainer.save_freq": 5}), inputs)  # type: ignore[arg-type]
    assert stop.value.code == 143
    said = capsys.readouterr().out
    assert f"stopped: {out} could not be read (PermissionError: Permission denied)" in said, said


def test_the_hint_masks_a_credential_in_the_folders_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The node watcher prints the hint outside the driver's masked streams, and a failure's
    message takes it as it is: the hint is masked when it is made."""
    monkeypatch.setenv("VERLITE_TEST_TOKEN", "s3cr3t-folder-name")
    out = tmp_path / "run-s3cr3t-folder-name"
    hint = output_folder.stopped_run_hint(out, 0)
    assert "s3cr3t-folder-name" not in hint and "run-***" in hint, hint
    failure = RunFailure("the worker process died")
    failure.then(hint)
    assert "s3cr3t" not in str(failure)
