"""What a stopped or failed run says a new run of its output folder does
(``output_folder.stopped_run_hint``): a Ctrl-C or SIGTERM, every run failure (a worker that
died or raised, a lost node, a diverged run, a reward service that stays down) and the
watcher's line when Ray ends the driver with its node. Each is checked against what the
folder's contract then does (``prepare_output_folder``), with and without a checkpoint."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from checkpoint_support import fake_checkpoint

from verlite import load_config
from verlite.config import Config
from verlite.controller import WorkerGroupError, node_watch, session
from verlite.controller.session import NODE_GONE
from verlite.driver import output_folder
from verlite.driver import run as driver_run
from verlite.driver import trainer as driver_trainer
from verlite.driver.output_folder import prepare_output_folder
from verlite.driver.trainer import Trainer, divergence
from verlite.envs.session import EnvironmentBroken
from verlite.errors import RunFailure, UserError
from verlite.policy_folder import INCOMPLETE_MARK, POLICY_FOLDER, record_exported_step
from verlite.rewards.remote import RemoteRewardError
from verlite.rewards.scoring import RewardError

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
        resume_from, hold, _ = prepare_output_folder(config(out, **fields), train_set=PROMPTS)
    except UserError as exc:
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
    # Bad input the run meets as it trains: a user error (exit 2), with the hint all the same.
    "reward value": lambda: RewardError(
        "reward function reward_fn returned 'yes' on response 3 ('The answer is 4'): "
        "a reward is a number in [0, 1]"
    ),
    "environment contract": lambda: EnvironmentBroken(
        "environment calculator, prompt 2: step() returned a reward of nan"
    ),
}


class Watcher:
    """The node watcher as the driver's session sees it: the JSON lines written to its
    standard input, and what it would say of them if the node were lost now."""

    def __init__(self) -> None:
        self.stdin = io.BytesIO()

    def told(self) -> list[Any]:
        return [json.loads(line) for line in self.stdin.getvalue().splitlines()]

    def says(self) -> str:
        return node_watch.what_a_new_run_does(self.told()[-1])


@pytest.fixture
def watcher(monkeypatch: pytest.MonkeyPatch) -> Watcher:
    watching = Watcher()
    monkeypatch.setattr(session, "_watcher", watching)
    return watching


@pytest.mark.parametrize("name", list(FAILURES))
def test_a_failed_run_says_what_a_new_run_of_its_folder_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, watcher: Watcher, name: str
) -> None:
    # Each of these promised "trainer.resume=auto continues from the last (latest)
    # checkpoint" whatever the folder held; the main job (trainer.save_freq=0) holds none,
    # and a new run of its folder is refused. A user error met mid-run (a reward function's
    # value, an environment's broken contract) ended without saying it at all.
    out = tmp_path / "run"
    inputs = SimpleNamespace(resume_from=None, folder=SimpleNamespace(release=lambda: None))
    if name == "node lost":
        gone = NODE_GONE.format(gone="raylet (exit code -9)")
        monkeypatch.setattr(driver_run, "lost_embedded_node", lambda: gone)

    def failed(*args: object) -> None:
        # The run wrote its records; the checkpoint was written before, when one is there.
        out.mkdir(exist_ok=True)
        (out / "metrics.jsonl").write_text('{"step": 1}\n')
        raise FAILURES[name]()

    monkeypatch.setattr(driver_run, "_attempt", failed)
    raised = UserError if isinstance(FAILURES[name](), UserError) else RunFailure

    def message(**fields: Any) -> str:
        with pytest.raises(raised) as info:  # a user error stays one (exit 2)
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
    assert watcher.told() == [
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


def test_a_complete_run_stopped_says_a_new_run_of_it_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Stopped as its workers shut down, after the last checkpoint and the export, the run
    # said "trainer.resume=auto continues from step_N": the new run was refused (it already
    # reached trainer.total_steps).
    out = tmp_path / "run"
    inputs = SimpleNamespace(resume_from=None, folder=SimpleNamespace(release=lambda: None))
    cfg = config(out, **{"trainer.save_freq": 2})
    total = cfg.trainer.total_steps

    def finished(*args: object) -> None:
        checkpoint(out, total)
        (out / POLICY_FOLDER).mkdir()
        raise KeyboardInterrupt

    monkeypatch.setattr(driver_run, "_attempt", finished)
    with pytest.raises(KeyboardInterrupt):
        driver_run.run(cfg, inputs)  # type: ignore[arg-type]
    last = out / "checkpoints" / f"step_{total}"
    said = capsys.readouterr().out
    assert (
        f"stopped: the run is complete ({last} is at trainer.total_steps={total}, its policy "
        "exported): a new `verlite train` of the same config is refused; a larger "
        "trainer.total_steps continues it, trainer.resume=disable with trainer.overwrite=true "
        "starts it over (its files moved aside)\n"
    ) in said, said
    # What it says, measured: refused as it is, and what each change does.
    assert "already reached trainer.total_steps" in str(new_run_of(out, **{"trainer.save_freq": 2}))
    assert "already reached" in str(new_run_of(out, **{"trainer.overwrite": True}))
    assert new_run_of(out, **{"trainer.total_steps": total + 2}) == last
    fresh = {"trainer.resume": "disable", "trainer.overwrite": True}
    assert new_run_of(out, **fresh) is None
    assert not last.exists()  # moved aside with the rest


def test_a_run_resumed_from_another_folders_checkpoint_says_it_resumes_from_it_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, watcher: Watcher
) -> None:
    # trainer.resume=<a checkpoint of another folder>: the hint said "starts from the first
    # step", though the same config resumes from that checkpoint again (once
    # trainer.overwrite=true moves this run's files aside: its folder is refused as it is).
    other = checkpoint(tmp_path / "other", 2)
    out = tmp_path / "run"
    fields = {"trainer.resume": str(other), "trainer.save_freq": 2}
    inputs = SimpleNamespace(resume_from=other, folder=SimpleNamespace(release=lambda: None))
    own: list[int] = []

    def failed(*args: object) -> None:
        out.mkdir(exist_ok=True)
        (out / "metrics.jsonl").write_text('{"step": 3}\n')
        for step in own:
            checkpoint(out, step)
        raise worker_failure(lost=False, cause="ValueError: a rank raised")

    monkeypatch.setattr(driver_run, "_attempt", failed)

    def message() -> str:
        with pytest.raises(RunFailure) as info:
            driver_run.run(config(out, **fields), inputs)  # type: ignore[arg-type]
        return str(info.value)

    said = message()
    assert watcher.says() == f"a new `verlite train` of {out} resumes from {other} again"
    assert said.endswith(
        f"; a new `verlite train` of {out} resumes from {other} again, with "
        "trainer.overwrite=true to move this run's files aside"
    ), said
    assert "is not empty" in str(new_run_of(out, **fields))
    assert new_run_of(out, **fields, **{"trainer.overwrite": True}) == other

    own.append(4)  # a checkpoint of its own: trainer.resume=auto continues it
    said = message()
    step_4 = out / "checkpoints" / "step_4"
    assert said.endswith(
        f"; a new `verlite train` of {out} resumes from {other} again, with "
        f"trainer.overwrite=true to move this run's files aside; with trainer.resume=auto it "
        f"continues from {step_4}"
    ), said
    assert new_run_of(out, **{"trainer.save_freq": 2}) == step_4


def test_another_folders_finished_checkpoint_is_complete_as_its_own_run_exported_it(
    tmp_path: Path,
) -> None:
    """trainer.resume=<another folder's checkpoint at trainer.total_steps>: whether it is
    complete was judged by this folder's export, which is another run's. An export here with
    none by the checkpoint's run said "the run is complete ..., its policy exported" (the
    same config resumes from it to export, this folder's files moved aside); its run's export,
    with none here, said it resumes to export."""
    total = config(tmp_path).trainer.total_steps
    other = checkpoint(tmp_path / "other", total)
    out = tmp_path / "run"
    (out / POLICY_FOLDER).mkdir(parents=True)  # another run's export
    fields = {"trainer.resume": str(other)}
    trainer = config(out, **fields).trainer
    assert output_folder.stopped_run_hint(out, trainer) == (
        f"a new `verlite train` of {out} resumes from {other} again to export its policy, "
        "with trainer.overwrite=true to move this run's files aside"
    )
    assert new_run_of(out, **fields, **{"trainer.overwrite": True}) == other
    (tmp_path / "other" / POLICY_FOLDER).mkdir()  # the checkpoint's run exported it
    record_exported_step(tmp_path / "other", total)
    assert output_folder.stopped_run_hint(out, trainer) == (
        f"the run is complete ({other} is at trainer.total_steps={total}, its policy exported "
        f"in {tmp_path / 'other' / POLICY_FOLDER}): a new `verlite train` of the same config is "
        "refused; a larger trainer.total_steps continues it, trainer.resume=disable with "
        "trainer.overwrite=true starts it over (its files moved aside)"
    )
    assert "its run exported its policy" in str(new_run_of(out, **fields))


def test_a_run_resumed_from_an_earlier_checkpoint_of_its_folder_says_it_goes_back_to_it(
    tmp_path: Path,
) -> None:
    # trainer.resume=<its own step_2>, stopped after saving step_4: the hint said
    # "trainer.resume=auto continues from step_4", but the same config resumes step_2 again
    # (and its first save removes step_4); once step_2 is pruned, it is refused.
    out = tmp_path / "run"
    step_2, step_4 = checkpoint(out, 2), checkpoint(out, 4)
    trainer = config(out, **{"trainer.resume": str(step_2)}).trainer
    assert output_folder.stopped_run_hint(out, trainer) == (
        f"a new `verlite train` with its trainer.resume continues from {step_2}; with "
        f"trainer.resume=auto it continues from {step_4}"
    )
    assert new_run_of(out, **{"trainer.resume": str(step_2)}) == step_2
    assert new_run_of(out) == step_4
    shutil.rmtree(step_2)  # pruned (trainer.max_checkpoints)
    said = output_folder.stopped_run_hint(out, trainer)
    refusal = str(new_run_of(out, **{"trainer.resume": str(step_2)}))
    assert "no such folder" in refusal
    assert said == (
        f"a new `verlite train` of the same config is refused: {refusal}; with "
        f"trainer.resume=auto it continues from {step_4}"
    ), said


def test_each_checkpoint_saved_tells_the_node_watcher_again(
    tmp_path: Path, watcher: Watcher
) -> None:
    # The watcher's line, printed after Ray ended the driver, said "continues from the latest
    # checkpoint" whatever the folder held when it died.
    out = tmp_path / "run"
    cfg = config(out, **{"trainer.save_freq": 3, "trainer.max_checkpoints": 1})
    trainer: Any = SimpleNamespace(cfg=cfg, saved=[], output_dir=out)
    for step in (3, 6):
        tmp = checkpoint(out, step).rename(out / "checkpoints" / f"step_{step}.tmp")
        Trainer.place_checkpoint(trainer, tmp, 0.1)
        assert watcher.says() == (
            f"a new `verlite train` with trainer.resume=auto continues from {out / 'checkpoints' / f'step_{step}'}"
        )
    assert new_run_of(out) == out / "checkpoints" / "step_6"


class NodeLost(BaseException):
    """Ray ending the driver at once (its QuickExit): nothing after it runs."""


def test_a_node_lost_as_the_run_writes_its_first_file_says_the_folder_needs_overwrite(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, watcher: Watcher
) -> None:
    """Lost after the placement report (the run's first file) was written but before the
    driver told the watcher, it said a new run starts from the first step: refused, the
    folder holds the report."""
    out = tmp_path / "run"
    cfg = config(out, **{"trainer.save_freq": 0})
    inputs: Any = SimpleNamespace(
        resume_from=None, tokenizer=None, folder=SimpleNamespace(release=lambda: None)
    )
    groups = SimpleNamespace(all=[])
    monkeypatch.setattr(driver_run, "start_groups", lambda *args: contextlib.nullcontext(groups))

    def report(groups: object, folder: str | Path) -> str:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / "workers.json").write_text("[]\n")
        raise NodeLost

    monkeypatch.setattr(driver_run, "write_placement_report", report)
    with pytest.raises(NodeLost):
        driver_run.run(cfg, inputs)
    assert watcher.says().endswith(
        f"a new `verlite train` of {out} starts from the first step, with "
        "trainer.overwrite=true to move this run's files aside"
    ), watcher.says()
    assert "is not empty" in str(new_run_of(out))


def test_a_node_lost_as_the_run_changes_its_folder_is_said_as_the_folder_then_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, watcher: Watcher
) -> None:
    """A node lost after a checkpoint was renamed into place but before the driver told the
    watcher named the checkpoint before it (the one trainer.max_checkpoints=1 had just
    removed); lost after the export was made whole, it said the run continues from its last
    checkpoint, where a new run is refused: it is complete. The watcher now reads the folder
    when it speaks, against what the driver told it before the change."""
    out = tmp_path / "run"
    cfg = config(out, **{"trainer.save_freq": 3, "trainer.max_checkpoints": 1})
    trainer: Any = SimpleNamespace(cfg=cfg, saved=[], output_dir=out)
    step_3 = checkpoint(out, 3)
    Trainer.place_checkpoint(trainer, checkpoint(out, 3).rename(f"{step_3}.tmp"), 0.1)
    placed = driver_trainer.commit_checkpoint

    def lost_after(tmp: Path, *, keep: int) -> Path:
        placed(tmp, keep=keep)
        raise NodeLost

    monkeypatch.setattr(driver_trainer, "commit_checkpoint", lost_after)
    last = checkpoint(out, cfg.trainer.total_steps)
    with pytest.raises(NodeLost):
        Trainer.place_checkpoint(trainer, last.rename(f"{last}.tmp"), 0.1)
    assert not step_3.exists()
    assert watcher.says() == (
        f"a new `verlite train` with trainer.resume=auto continues from {last} to export its policy"
    )
    assert new_run_of(out) == last

    # The export made whole (its mark gone), and the node lost before another word.
    removed = Path.unlink

    def unlink(path: Path, missing_ok: bool = False) -> None:
        removed(path, missing_ok)
        if path.name == INCOMPLETE_MARK:
            raise NodeLost

    monkeypatch.setattr(Path, "unlink", unlink)
    trainer.actor = SimpleNamespace(call=lambda method, folder: Path(folder).mkdir())
    trainer.tokenizer = SimpleNamespace(save_pretrained=lambda folder: None)
    with pytest.raises(NodeLost):
        Trainer.export_policy(trainer)
    assert watcher.says().startswith(f"the run is complete ({last} is at trainer.total_steps=")
    assert "already reached" in str(new_run_of(out))


def test_a_node_lost_as_a_run_resumed_from_its_earlier_checkpoint_saves_is_said_right(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, watcher: Watcher
) -> None:
    """A run resumed from its folder's step_2 (trainer.resume=<step_2>) saves step_4 again,
    over the step_4 of the run it resumed, whose step_6 the save then removes. Lost before
    the rename, the watcher said the folder as it would be after it (step_4's mark was there
    already): "with trainer.resume=auto it continues from step_4", while step_6 was still
    there. It says the folder as it is, before and after."""
    out = tmp_path / "run"
    step_2, step_4, step_6 = checkpoint(out, 2), checkpoint(out, 4), checkpoint(out, 6)
    fields = {"trainer.resume": str(step_2), "trainer.save_freq": 2}
    trainer: Any = SimpleNamespace(cfg=config(out, **fields), saved=[], output_dir=out)
    placed = driver_trainer.commit_checkpoint
    renamed = False

    def lost(tmp: Path, *, keep: int) -> Path:
        if renamed:
            placed(tmp, keep=keep)
        raise NodeLost

    monkeypatch.setattr(driver_trainer, "commit_checkpoint", lost)
    for renamed in (False, True):
        tmp = out / "checkpoints" / "step_4.tmp"
        shutil.copytree(step_4, tmp)
        with pytest.raises(NodeLost):
            Trainer.place_checkpoint(trainer, tmp, 0.1)
        assert step_6.exists() != renamed and new_run_of(out) == (step_4 if renamed else step_6)
        said, hint = watcher.says(), output_folder.stopped_run_hint(out, trainer.cfg.trainer)
        assert said == hint, said
        shutil.rmtree(tmp, ignore_errors=True)


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
    # Its settings unknown, whether the checkpoint is its last step is not guessed.
    assert said().endswith(
        f"whole; a new `verlite train` with trainer.resume=auto continues from {last}\n"
    )
    (out / "config.json").write_text(json.dumps(settings))
    assert said().endswith(
        f"whole; a new `verlite train` with trainer.resume=auto continues from {last} to "
        "export its policy\n"
    )
    assert new_run_of(out) == last  # to export alone


def test_an_incomplete_exports_hint_names_the_checkpoint_a_relative_resume_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A run started in tmp_path with trainer.resume=other/checkpoints/step_2 (relative: of
    # the folder `verlite train` ran in) recorded that value in its config.json as given, and
    # `verlite export` run elsewhere read it from its own folder: "a new `verlite train` of
    # the same config is refused: trainer.resume='other/...': not a complete checkpoint".
    # The run records the checkpoint it resolved (driver.trainer.run_record).
    from verlite.cli import main

    monkeypatch.chdir(tmp_path)
    other = checkpoint(Path("other"), 2)
    out = tmp_path / "run"
    (out / POLICY_FOLDER).mkdir(parents=True)
    (out / INCOMPLETE_MARK).touch()
    cfg = config(out, **{"trainer.resume": str(other)})
    (out / "config.json").write_text(json.dumps(driver_trainer.run_record(cfg)))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main(["export", str(out)]) == 2
    assert capsys.readouterr().err.endswith(
        f"whole; a new `verlite train` of {out} resumes from {tmp_path / other} again, with "
        "trainer.overwrite=true to move this run's files aside\n"
    )


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
    hint = output_folder.stopped_run_hint(out, config(out).trainer)
    assert "s3cr3t-folder-name" not in hint and "run-***" in hint, hint
    failure = RunFailure("the worker process died")
    failure.then(hint)
    assert "s3cr3t" not in str(failure)
