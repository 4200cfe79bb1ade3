"""The output folder contract: a run never writes over what it did not make, never restarts
over a run it could continue, and never reads and writes the same paths."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from checkpoint_support import fake_checkpoint
from safetensors.torch import save_file

from verlite import policy_folder
from verlite.config import Config, ConfigError, check_paths, load_config
from verlite.driver import output_folder
from verlite.driver.checkpoint import CheckpointError
from verlite.driver.output_folder import LOCK_FILE, FolderLock
from verlite.driver.output_folder import prepare_output_folder as prepare_and_hold
from verlite.driver.preflight import RunInputs
from verlite.driver.trainer import Trainer
from verlite.errors import shown
from verlite.package_versions import package_versions

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "ppo_tiny.yaml"
# The training prompts' fingerprint: fake checkpoints record none, so any passes.
PROMPTS = {"records": 8, "sha256": "0" * 64}


def config(out: Path, *overrides: str) -> Config:
    return load_config(CONFIG, [f"trainer.output_dir={out}", "trainer.total_steps=6", *overrides])


def prepare_output_folder(cfg: Config) -> Path | None:
    """The checkpoint a run in the folder resumes from, the folder let go of again."""
    return resume_and_notes(cfg)[0]


def resume_and_notes(cfg: Config) -> tuple[Path | None, list[str]]:
    """The checkpoint a run in the folder resumes from and the lines it says of the resume,
    the folder let go of again."""
    resume_from, hold, notes = prepare_and_hold(cfg, train_set=PROMPTS)
    hold.release()
    return resume_from, notes


def someones_files(out: Path) -> dict[str, str]:
    files = {"config.json": '{"mine": 1}', "notes.txt": "do not lose me"}
    out.mkdir(parents=True)
    for name, text in files.items():
        (out / name).write_text(text)
    return files


def earlier_run(out: Path, *, checkpoint_step: int | None, saved: Config | None = None) -> None:
    out.mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 1, "a": 1.0}\n')
    (out / "config.json").write_text("{}")
    if checkpoint_step is not None:
        saved_config = (saved or config(out)).model_dump(mode="json")
        fake_checkpoint(out, checkpoint_step, ("actor", "critic"), config=saved_config)


def write_export(out: Path, step: int) -> None:
    """A whole export of step ``step``'s policy in ``out``, as its run writes it."""
    (out / "hf_actor").mkdir()
    policy_folder.record_exported_step(out, step)


def test_a_missing_or_empty_folder_starts_a_fresh_run(tmp_path: Path) -> None:
    assert prepare_output_folder(config(tmp_path / "new" / "run")) is None
    assert (tmp_path / "new" / "run").is_dir()
    (tmp_path / "empty").mkdir()
    assert prepare_output_folder(config(tmp_path / "empty")) is None


def test_someones_files_are_refused_and_left_as_they_are(tmp_path: Path) -> None:
    out = tmp_path / "theirs"
    files = someones_files(out)
    with pytest.raises(ConfigError, match=r"is not empty \(it holds config.json, notes.txt\)"):
        prepare_output_folder(config(out))
    assert {p.name: p.read_text() for p in out.iterdir()} == files


def test_overwrite_moves_the_contents_aside_whole(tmp_path: Path, capsys) -> None:
    out = tmp_path / "theirs"
    files = someones_files(out)
    assert prepare_output_folder(config(out, "trainer.overwrite=true")) is None
    assert [p.name for p in out.iterdir()] == [LOCK_FILE]  # the new run's, and nothing else
    (moved,) = tmp_path.glob("theirs.replaced-*")
    assert {p.name: p.read_text() for p in moved.iterdir()} == files
    assert f"moved the earlier contents of {out} to {moved}" in capsys.readouterr().out


def test_an_earlier_run_without_a_checkpoint_is_refused_not_truncated(tmp_path: Path) -> None:
    out = tmp_path / "run"
    earlier_run(out, checkpoint_step=None)
    with pytest.raises(ConfigError, match=r"not empty \(an earlier run\)"):
        prepare_output_folder(config(out))
    assert (out / "metrics.jsonl").read_text() == '{"step": 1, "a": 1.0}\n'


def test_a_run_with_a_checkpoint_continues(tmp_path: Path) -> None:
    out = tmp_path / "run"
    earlier_run(out, checkpoint_step=3)
    assert prepare_output_folder(config(out)) == out / "checkpoints" / "step_3"
    named = config(out, f"trainer.resume={out / 'checkpoints' / 'step_3'}")
    assert prepare_output_folder(named) == out / "checkpoints" / "step_3"
    assert (out / "metrics.jsonl").is_file()  # nothing moved


def test_a_resume_may_change_settings_but_not_the_data_it_counts_in(tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    earlier_run(out, checkpoint_step=3)
    with pytest.raises(CheckpointError, match=r"data\.train_batch_size=64 there, 32 here"):
        prepare_output_folder(
            config(out, "data.train_batch_size=32", "actor.ppo_mini_batch_size=16")
        )
    changed = config(out, "actor.optim.lr=0.0005", "algorithm.adv_estimator=grpo", "rollout.n=2")
    resume_from, (said,) = resume_and_notes(changed)
    assert resume_from == out / "checkpoints" / "step_3"
    assert said.startswith(
        f"resuming {resume_from} with changed settings: actor.optim.lr: 0.001 -> 0.0005; "
        "algorithm.adv_estimator: 'gae' -> 'grpo'"
    )
    assert "rollout.n: 1 -> 2" in said and "total_steps" not in said
    # a run extended: a cosine schedule decays to the new end, so the change is named too
    _, (said,) = resume_and_notes(config(out, "trainer.total_steps=8"))
    assert said.endswith("with changed settings: trainer.total_steps: 6 -> 8")
    assert resume_and_notes(config(out)) == (resume_from, [])  # nothing changed: no line
    assert capsys.readouterr().out == ""  # the run says them once every check passed


def test_a_resume_under_other_package_versions_says_so_in_a_line_of_its_own(
    tmp_path: Path,
) -> None:
    """A checkpoint records the versions of the packages that shape the numbers: a resume
    under others names each changed one and that its metrics may differ from an
    uninterrupted run's, beside the line of its changed settings; it is no refusal. A
    checkpoint from before they were recorded resumes saying nothing of them. Mutations: no
    versions returned by check_resumable -> no line; the versions read as
    ``state["versions"]`` -> the older checkpoint fails."""
    out = tmp_path / "run"
    earlier_run(out, checkpoint_step=3)
    resume_from = out / "checkpoints" / "step_3"
    assert resume_and_notes(config(out)) == (resume_from, [])  # recorded none: nothing said
    here = package_versions(peft=False)
    assert {"verlite", "torch", "transformers"} <= here.keys()
    state_file = resume_from / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state_file.write_text(json.dumps({**state, "versions": here}))
    assert resume_and_notes(config(out)) == (resume_from, [])  # the same versions
    older = {**here, "torch": "0.0.1", "transformers": "0.0.2"}
    state_file.write_text(json.dumps({**state, "versions": older}))
    _, notes = resume_and_notes(config(out, "actor.optim.lr=0.0005"))
    assert notes == [
        f"resuming {resume_from} with changed settings: actor.optim.lr: 0.001 -> 0.0005",
        f"resuming {resume_from} under other package versions than it was written with: "
        f"torch 0.0.1 -> {here['torch']}, transformers 0.0.2 -> {here['transformers']}; its "
        "metrics may then differ from an uninterrupted run's",
    ]


def test_a_resume_refused_under_the_hold_says_nothing_of_the_resume(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What resuming changes is said by a run that starts: a run refused once it holds the
    folder (a check made under the hold: here its export linked to a file) says one line,
    its refusal, not a resume that never happens. Mutation: the resume line printed as
    the checkpoint is checked, before the hold (as it was)."""
    out = tmp_path / "run"
    earlier_run(out, checkpoint_step=3)
    (tmp_path / "a-file").write_text("")
    (out / "hf_actor").symlink_to(tmp_path / "a-file")
    for overrides in (("actor.optim.lr=0.0005",), ("trainer.total_steps=3",)):  # export alone
        with pytest.raises(ConfigError, match="which is not a folder"):
            prepare_output_folder(config(out, *overrides))
        assert capsys.readouterr().out == ""


def test_a_run_that_starts_says_what_its_resume_changes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``RunInputs.load``, every check passed and the folder held, prints the resume's line
    with the other start-up lines. Mutation: the folder's lines not printed there."""
    out = tmp_path / "run"
    earlier_run(out, checkpoint_step=3)
    RunInputs.load(config(out, "actor.optim.lr=0.0005")).folder.release()
    said = capsys.readouterr().out.splitlines()
    assert f"resuming {out / 'checkpoints' / 'step_3'} with changed settings: " in said[-1]


def test_a_finished_run_is_not_resumed_into_doing_nothing(tmp_path: Path) -> None:
    out = tmp_path / "run"
    earlier_run(out, checkpoint_step=6)
    (out / "hf_actor").mkdir()  # its export, written as it ended
    with pytest.raises(CheckpointError, match=r"already reached trainer\.total_steps=6"):
        prepare_output_folder(config(out))
    # nor a run that never exports
    shutil.rmtree(out / "hf_actor")
    with pytest.raises(CheckpointError, match=r"already reached trainer\.total_steps=6"):
        prepare_output_folder(config(out, "trainer.export=false"))


def test_a_checkpoints_folder_linked_elsewhere_is_the_runs_own(tmp_path: Path) -> None:
    """``checkpoints/`` a link to a scratch disk: the folder's run continues from its latest
    checkpoint, and once finished is refused in one line as its own."""
    out = tmp_path / "run"
    earlier_run(out, checkpoint_step=3)
    scratch = tmp_path / "scratch"
    (out / "checkpoints").rename(scratch)
    (out / "checkpoints").symlink_to(scratch)
    assert prepare_output_folder(config(out)) == out / "checkpoints" / "step_3"
    assert (out / "metrics.jsonl").is_file()  # continued, nothing moved
    fake_checkpoint(out, 6, ("actor", "critic"), config=config(out).model_dump(mode="json"))
    write_export(out, 6)
    with pytest.raises(
        CheckpointError, match=r"the run in .* already reached trainer\.total_steps=6"
    ):
        prepare_output_folder(config(out))
    assert "the run is complete" in output_folder.stopped_run_hint(out, config(out).trainer)
    # Named from another folder, its checkpoint is complete as its run exported it.
    step_6 = out / "checkpoints" / "step_6"
    export = shown(str(out / "hf_actor"))
    with pytest.raises(
        CheckpointError, match=rf"its run exported its policy \({re.escape(export)}\)"
    ):
        prepare_output_folder(config(tmp_path / "empty", f"trainer.resume={step_6}"))


def test_a_linked_folder_with_linked_checkpoints_continues_its_checkpoint_by_any_name(
    tmp_path: Path,
) -> None:
    """``trainer.output_dir`` a link, its ``checkpoints/`` a link to a scratch disk: a
    checkpoint named through the folder's link (or where it lies) resolved to the scratch
    disk, neither named under nor lying in the real folder, so it was taken for another
    folder's: refused as "not empty", and with trainer.overwrite=true the run's own files,
    the checkpoint among them, were moved aside before it resumed from it."""
    real, scratch, link = tmp_path / "real", tmp_path / "scratch", tmp_path / "link"
    earlier_run(real, checkpoint_step=2)
    (real / "checkpoints").rename(scratch)
    (real / "checkpoints").symlink_to(scratch)
    link.symlink_to(real)
    for name in (link / "checkpoints", real / "checkpoints", scratch):
        for overwrite in ("false", "true"):
            resume = f"trainer.resume={name / 'step_2'}"
            cfg = config(link, resume, f"trainer.overwrite={overwrite}")
            assert prepare_output_folder(cfg) == name / "step_2"
            assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real", "scratch"]
            assert (name / "step_2" / "trainer_state.json").is_file()


def test_another_runs_checkpoint_further_down_a_linked_checkpoints_folder_is_not_the_folders(
    tmp_path: Path,
) -> None:
    """``checkpoints/`` linked to a scratch disk's folder that also holds other runs' folders:
    a checkpoint of one of them lies under the link's target, but is no ``step_N`` of this
    folder's. It was taken for the folder's own, and resumed there keeping this folder's files
    (another run's records); now it is another folder's checkpoint: refused in a busy folder."""
    scratch, real = tmp_path / "scratch", tmp_path / "real"
    earlier_run(scratch / "other", checkpoint_step=4)
    earlier_run(real, checkpoint_step=None)
    (real / "checkpoints").symlink_to(scratch)
    resume = f"trainer.resume={scratch / 'other' / 'checkpoints' / 'step_4'}"
    with pytest.raises(
        ConfigError, match=r"is not empty .* holds no checkpoint this run continues"
    ):
        prepare_output_folder(config(real, resume))
    assert (real / "metrics.jsonl").read_text() == '{"step": 1, "a": 1.0}\n'


def test_a_finished_checkpoint_of_another_folder_is_refused_naming_it(tmp_path: Path) -> None:
    """trainer.resume naming another folder's checkpoint at trainer.total_steps whose own run
    exported it (or with trainer.export=false): the refusal names the checkpoint and its
    run's export. The refusal said "the run in <this folder> already reached
    trainer.total_steps", of a folder no run of that checkpoint trained in."""
    earlier = tmp_path / "earlier"
    earlier_run(earlier, checkpoint_step=6)
    checkpoint = earlier / "checkpoints" / "step_6"
    write_export(earlier, 6)  # its run's export, written as it ended
    (tmp_path / "empty").mkdir()
    for extra, why in (
        ([], f"and its run exported its policy ({shown(str(earlier / 'hf_actor'))})"),
        (["trainer.export=false"], "and trainer.export=false"),
    ):
        with pytest.raises(CheckpointError) as refused:
            prepare_output_folder(
                config(tmp_path / "empty", f"trainer.resume={checkpoint}", *extra)
            )
        assert str(refused.value) == (
            f"trainer.resume={shown(str(checkpoint))}: that checkpoint is at trainer.total_steps=6 {why}, "
            "so this run would train and export nothing; raise trainer.total_steps to train "
            "further from it, or name another checkpoint in trainer.resume"
        )


def test_another_folders_checkpoint_its_run_did_not_export_is_resumed_to_export(
    tmp_path: Path,
) -> None:
    """Whether another folder's checkpoint at trainer.total_steps was exported is its own
    run's to say, not this folder's: an export here (another run's) refused it as complete;
    an export in its folder of a later step's policy (the run ended after it, or continued
    past it) is not its. Each resumes from it to export (this folder's files moved aside)."""
    exported = tmp_path / "exported"
    (exported / "hf_actor").mkdir(parents=True)  # another run's export
    ended_later = tmp_path / "ended_later"  # total_steps=8: its export is step 8's
    earlier_run(ended_later, checkpoint_step=6, saved=config(ended_later, "trainer.total_steps=8"))
    write_export(ended_later, 8)
    continued = tmp_path / "continued"  # a step_8 after it: its export is step 8's
    earlier_run(continued, checkpoint_step=6)
    fake_checkpoint(
        continued, 8, ("actor", "critic"), config=config(continued).model_dump(mode="json")
    )
    write_export(continued, 8)
    plain = tmp_path / "plain"  # exported nothing
    earlier_run(plain, checkpoint_step=6)
    for run in (plain, ended_later, continued):
        checkpoint = run / "checkpoints" / "step_6"
        resume = f"trainer.resume={checkpoint}"
        with pytest.raises(ConfigError, match=r"is not empty"):
            prepare_output_folder(config(exported, resume))
        out = tmp_path / f"into_{run.name}"
        out.mkdir()
        (out / "hf_actor").mkdir()
        assert prepare_output_folder(config(out, resume, "trainer.overwrite=true")) == checkpoint
        assert not (out / "hf_actor").exists()  # moved aside, with the rest


def export_as_the_trainer_does(out: Path, cfg: Config) -> None:
    """``Trainer.export_policy`` of a run of ``cfg`` in ``out``, its workers' part faked."""
    trainer = SimpleNamespace(
        cfg=cfg,
        output_dir=out,
        # save_pretrained makes its folder as os.makedirs(exist_ok=True) does
        actor=SimpleNamespace(call=lambda method, folder: Path(folder).mkdir(exist_ok=True)),
        tokenizer=SimpleNamespace(save_pretrained=lambda folder: None),
    )
    Trainer.export_policy(trainer)  # type: ignore[arg-type]


@pytest.mark.parametrize("target", ["earlier-export", "nowhere", "empty"])
def test_an_export_over_a_link_is_written_through_it(tmp_path: Path, target: str) -> None:
    """``hf_actor`` linked to a larger disk (an earlier export moved there, a folder not made
    yet, an empty one) is written through, as a linked output folder or ``checkpoints/`` is:
    the link stays and the policy lies where it leads. It was replaced by a real folder in
    the output folder, on the disk the link was made to spare."""
    out, theirs = tmp_path / "run", tmp_path / "disk" / target
    out.mkdir()
    if target == "earlier-export":
        (tmp_path / "earlier").mkdir()
        export_as_the_trainer_does(tmp_path / "earlier", config(tmp_path / "earlier"))
        (tmp_path / "earlier" / "hf_actor" / "stale.bin").write_text("an earlier file")
        theirs.parent.mkdir()
        (tmp_path / "earlier" / "hf_actor").rename(theirs)
    elif target == "empty":
        theirs.mkdir(parents=True)
    (out / "hf_actor").symlink_to(theirs)
    export_as_the_trainer_does(out, config(out))
    assert (out / "hf_actor").is_symlink() and (out / "hf_actor").resolve() == theirs
    assert policy_folder.exported_step(out) == 6
    assert [p.name for p in theirs.iterdir()] == [policy_folder.STEP_RECORD]


def test_a_linked_export_folder_holding_someones_files_is_refused_before_the_run(
    tmp_path: Path,
) -> None:
    """The export empties the folder ``hf_actor`` links to: one holding files that are no
    policy export (someone's, linked by mistake) is refused as the run takes its folder, and
    left as it is."""
    out = tmp_path / "run"
    earlier_run(out, checkpoint_step=4)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "model.safetensors").write_text("their weights")
    (out / "hf_actor").symlink_to(theirs)
    link, target = shown(str(out / "hf_actor")), shown(str(theirs))
    with pytest.raises(
        ConfigError,
        match=re.escape(
            f"{link} links to {target}, which holds files that are not a policy export"
        ),
    ):
        prepare_output_folder(config(out))
    assert [p.name for p in theirs.iterdir()] == ["model.safetensors"]
    (out / "hf_actor").unlink()
    (out / "hf_actor").symlink_to(tmp_path / "a-file")
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ConfigError, match="which is not a folder"):
        prepare_output_folder(config(out))
    assert prepare_output_folder(config(out, "trainer.export=false")) is not None


def test_a_checkpoint_whose_run_went_on_without_saving_is_resumed_to_export(
    tmp_path: Path,
) -> None:
    """A run that exported step 6, then continued to step 8 with trainer.save_freq=0: its
    latest checkpoint is still step_6, and its export step 8's policy. Named from another
    folder, step_6 was refused as "its run exported its policy (<its hf_actor>)", pointing
    at step 8's policy; no run could export step 6's. The export now records its step."""
    first = tmp_path / "first"
    earlier_run(first, checkpoint_step=6)
    export_as_the_trainer_does(first, config(first))
    step_6 = first / "checkpoints" / "step_6"
    resume = f"trainer.resume={step_6}"
    with pytest.raises(CheckpointError, match=r"its run exported its policy"):
        prepare_output_folder(config(tmp_path / "second", resume))
    continued = config(first, "trainer.total_steps=8", "trainer.save_freq=0")
    assert prepare_output_folder(continued) == step_6
    export_as_the_trainer_does(first, continued)  # steps 7 and 8 trained, no checkpoint
    assert sorted(p.name for p in (first / "checkpoints").iterdir()) == ["step_6"]
    assert policy_folder.exported_step(first) == 8
    assert prepare_output_folder(config(tmp_path / "second", resume)) == step_6


def test_an_export_that_does_not_say_its_step_is_not_taken_for_a_checkpoints(
    tmp_path: Path,
) -> None:
    # Written before exports recorded their step (or the record damaged): which step it
    # holds is not known, so another folder's run resumes the checkpoint to export it.
    first = tmp_path / "first"
    earlier_run(first, checkpoint_step=6)
    (first / "hf_actor").mkdir()
    step_6 = first / "checkpoints" / "step_6"
    for record in (None, "{", '{"step": "6"}', '{"step": true}'):
        if record is not None:
            (first / "hf_actor" / policy_folder.STEP_RECORD).write_text(record)
        assert policy_folder.exported_step(first) is None
        assert (
            prepare_output_folder(config(tmp_path / "second", f"trainer.resume={step_6}")) == step_6
        )


@pytest.mark.parametrize("interrupted", [False, True])
def test_a_run_that_stopped_before_its_export_was_whole_resumes_to_export(
    tmp_path: Path, interrupted: bool
) -> None:
    """Killed after its last checkpoint, before or while it exported: the trained policy was
    in the checkpoint only, and a resume was refused ("already reached total_steps"), so no
    command could export it. Now the run resumes from that checkpoint to export alone."""
    out = tmp_path / "run"
    earlier_run(out, checkpoint_step=6)
    if interrupted:  # a part of the export written, the mark of an export under way beside it
        (out / "hf_actor").mkdir()
        (out / "hf_actor" / "config.json").write_text("{}")
        (out / policy_folder.INCOMPLETE_MARK).write_text("")
    resume_from, (said,) = resume_and_notes(config(out))
    assert resume_from == out / "checkpoints" / "step_6"
    assert "reached trainer.total_steps=6 but its policy export (hf_actor) is " in said


def test_a_continued_run_stopped_before_its_export_resumes_to_export(tmp_path: Path) -> None:
    """A run continued past its end (trainer.total_steps raised) trains beside its earlier,
    whole export: killed after its new last checkpoint, before it exported, the folder's
    hf_actor was the earlier step's policy, taken for the run's (verlite export showed it) and
    the run again refused ("already reached"). From the continued run's start hf_actor is
    marked as not its policy, and a run again resumes to export."""
    out = tmp_path / "run"
    earlier_run(out, checkpoint_step=4, saved=config(out, "trainer.total_steps=4"))
    (out / "hf_actor").mkdir()  # step 4's export, whole
    assert prepare_output_folder(config(out)) == out / "checkpoints" / "step_4"
    assert not policy_folder.policy_exported(out)
    fake_checkpoint(out, 6, ("actor", "critic"), config=config(out).model_dump(mode="json"))
    resume_from, (said,) = resume_and_notes(config(out))
    assert resume_from == out / "checkpoints" / "step_6"
    assert "reached trainer.total_steps=6 but its policy export (hf_actor) is " in said


def test_resume_disable_over_a_run_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "run"
    earlier_run(out, checkpoint_step=3)
    with pytest.raises(ConfigError, match=r"a run with checkpoints, and trainer\.resume=disable"):
        prepare_output_folder(config(out, "trainer.resume=disable"))


def test_a_checkpoint_of_another_folder_starts_only_in_an_empty_one(tmp_path: Path) -> None:
    source = tmp_path / "source"
    earlier_run(source, checkpoint_step=3)
    step = source / "checkpoints" / "step_3"
    assert prepare_output_folder(config(tmp_path / "fork", f"trainer.resume={step}")) == step
    someones_files(tmp_path / "busy")
    with pytest.raises(ConfigError, match="holds no checkpoint this run continues"):
        prepare_output_folder(config(tmp_path / "busy", f"trainer.resume={step}"))


def test_a_checkpoint_of_other_prompts_is_refused_before_anything_is_moved(
    tmp_path: Path,
) -> None:
    # Its data position counts in another order of prompts: refused with the other checks
    # of the resume point, before trainer.overwrite=true moves the folder's contents aside.
    source = tmp_path / "source"
    earlier_run(source, checkpoint_step=3)
    step = source / "checkpoints" / "step_3"
    state_file = step / "trainer_state.json"
    state_file.write_text(json.dumps({**json.loads(state_file.read_text()), "train_set": PROMPTS}))
    files = someones_files(tmp_path / "busy")
    overrides = (f"trainer.resume={step}", "trainer.overwrite=true")
    other = {"records": 8, "sha256": "1" * 64}
    with pytest.raises(CheckpointError, match="the training prompts differ from those it"):
        prepare_and_hold(config(tmp_path / "busy", *overrides), train_set=other)
    assert {p.name: p.read_text() for p in (tmp_path / "busy").iterdir()} == files
    assert prepare_output_folder(config(tmp_path / "busy", *overrides)) == step  # its own prompts


def test_a_file_or_an_unwritable_place_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a folder"):
        prepare_output_folder(config(tmp_path / "file"))
    # a folder inside the file: NotADirectoryError from the lock's check, a traceback
    with pytest.raises(ConfigError) as caught:
        prepare_output_folder(config(tmp_path / "file" / "run" / "one"))
    assert str(caught.value) == (
        f"trainer.output_dir={str(tmp_path / 'file' / 'run' / 'one')!r} lies inside "
        f"{str(tmp_path / 'file')!r}, which is a file, not a folder"
    )
    with pytest.raises(ConfigError, match="cannot be written"):
        prepare_output_folder(config(Path("/proc/verlite-run")))
    with pytest.raises(ConfigError, match=r"\[\.\.\.\].*: File name too long"):
        prepare_output_folder(config(tmp_path / ("a" * 5000)))


@pytest.mark.parametrize(
    ("inputs", "output"),
    [
        ("model.path={model}", "{model}"),
        ("model.path={model}", "{model}/run"),
        ("model.path={model}", "{tmp}"),
        ("data.train_file={model}/train.jsonl", "{model}"),
        ("trainer.resume={tmp}/other/checkpoints/step_3", "{tmp}/other/checkpoints/step_3/x"),
    ],
)
def test_an_output_folder_overlapping_an_input_is_refused(
    tmp_path: Path, inputs: str, output: str
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    save_file({"w": torch.zeros(1)}, model / "model.safetensors")
    (model / "train.jsonl").write_text('{"prompt": "1", "answer": "1"}\n')
    (tmp_path / "other" / "checkpoints" / "step_3").mkdir(parents=True)
    fill = {"model": model, "tmp": tmp_path}
    overrides = [inputs.format(**fill), f"trainer.output_dir={output.format(**fill)}"]
    if inputs.startswith("data."):
        overrides.append("data.task=null")
    with pytest.raises(ConfigError, match=r"overlaps .* the run would write where it reads"):
        check_paths(load_config(CONFIG, overrides))


def test_a_checkpoint_of_the_output_folder_itself_may_be_resumed(tmp_path: Path) -> None:
    out = tmp_path / "run"
    step = out / "checkpoints" / "step_3"
    step.mkdir(parents=True)
    check_paths(load_config(CONFIG, [f"trainer.output_dir={out}", f"trainer.resume={step}"]))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "cannot be read as JSON"),
        ('{"hidden_size": 8}', "names no model_type"),
        ('{"model_type": "llama"}', r"holds no weights \(none of model.safetensors, "),
    ],
)
def test_a_corrupt_or_weightless_model_folder_is_one_line(
    tmp_path: Path, text: str, message: str
) -> None:
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ConfigError, match=message):
        check_paths(load_config(CONFIG, [f"model.path={tmp_path}"]))


def test_a_folder_in_use_is_refused_until_its_run_lets_go(tmp_path: Path) -> None:
    out = tmp_path / "run"
    _, hold, _ = prepare_and_hold(config(out), train_set=PROMPTS)
    for overrides in ((), ("trainer.overwrite=true",)):  # nor moved aside under a running run
        with pytest.raises(ConfigError, match=r"is in use by another run \(pid \d+ on "):
            prepare_output_folder(config(out, *overrides))
    assert (out / LOCK_FILE).is_file() and not list(tmp_path.glob("run.replaced-*"))
    hold.release()
    assert prepare_output_folder(config(out)) is None  # a fresh run: the lock file is not contents


def test_a_killed_runs_hold_ends_with_its_process(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from verlite.driver.output_folder import "
            "FolderLock; hold = FolderLock.take(Path(sys.argv[1])); print('held', flush=True); "
            "time.sleep(60)",
            str(out),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdout.readline() == "held\n"
    with pytest.raises(ConfigError, match=f"pid {holder.pid} on"):
        FolderLock.take(out)
    holder.kill()
    holder.wait()
    FolderLock.take(out).release()


def test_files_that_appear_before_the_hold_is_taken_are_judged_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run that started in the folder after the checks and has ended since leaves its files:
    under the hold they are refused (or moved aside), not written over."""
    out = tmp_path / "run"
    make_folder = output_folder._make_writable_folder

    def another_run_came_and_went(folder: Path) -> None:
        make_folder(folder)
        (folder / "metrics.jsonl").write_text('{"step": 1}\n')

    monkeypatch.setattr(output_folder, "_make_writable_folder", another_run_came_and_went)
    with pytest.raises(ConfigError, match="is not empty"):
        prepare_output_folder(config(out))
    assert prepare_output_folder(config(out, "trainer.overwrite=true")) is None
    assert [p.name for p in out.iterdir()] == [LOCK_FILE]
    (moved,) = tmp_path.glob("run.replaced-*")
    assert [p.name for p in moved.iterdir()] == ["metrics.jsonl"]


def test_a_lock_file_that_is_a_link_is_neither_followed_nor_taken_for_a_lock(
    tmp_path: Path,
) -> None:
    """A link named .verlite-lock is someone's: its target is never truncated, and a folder
    holding only such a link is not empty."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    for target in (victim, tmp_path / "missing"):  # a dangling link must not create its target
        out = tmp_path / f"run-{target.name}"
        out.mkdir()
        (out / LOCK_FILE).symlink_to(target)
        with pytest.raises(ConfigError, match=r"is not empty \(it holds \.verlite-lock\)"):
            prepare_output_folder(config(out))
        with pytest.raises(ConfigError, match=r"\.verlite-lock' is a symbolic link, not a lock"):
            prepare_output_folder(config(out, "trainer.overwrite=true"))
        with pytest.raises(ConfigError, match="is a symbolic link, not a lock file"):
            FolderLock.take(out)
        assert (out / LOCK_FILE).is_symlink() and not list(tmp_path.glob("run-*.replaced-*"))
    assert victim.read_text() == "precious" and not (tmp_path / "missing").exists()


def files_under(folder: Path) -> dict[str, str]:
    files = (p for p in folder.rglob("*") if p.is_file() and p.name != LOCK_FILE)
    return {str(p.relative_to(folder)): p.read_text() for p in files}


def theirs_with_a_subfolder(real: Path) -> dict[str, str]:
    files = someones_files(real)
    (real / "sub").mkdir()
    (real / "sub" / "deep.txt").write_text("deep")
    return {**files, "sub/deep.txt": "deep"}


@pytest.mark.parametrize(
    ("spelled", "cwd"),
    [
        ("{tmp}/links/link", "{tmp}"),  # through a symbolic link
        ("links/link/", "{tmp}"),  # relative, with a trailing slash
        ("{tmp}/links/../real", "{tmp}"),
        ("{real}/sub/..", "{tmp}"),
        (".", "{real}"),  # the current folder
        ("..", "{real}/sub"),
    ],
)
def test_an_unusual_path_to_the_folder_moves_it_aside_beside_the_real_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spelled: str, cwd: str
) -> None:
    real = tmp_path / "real"
    files = theirs_with_a_subfolder(real)
    (tmp_path / "links").mkdir()
    (tmp_path / "links" / "link").symlink_to(real)
    monkeypatch.chdir(cwd.format(tmp=tmp_path, real=real))
    out = spelled.format(tmp=tmp_path, real=real)
    assert prepare_output_folder(config(Path(out), "trainer.overwrite=true")) is None
    assert [p.name for p in real.iterdir()] == [LOCK_FILE]
    (moved,) = [p for p in tmp_path.rglob("*.replaced-*")]
    assert moved.parent == tmp_path and moved.name.startswith("real.replaced-")
    assert files_under(moved) == files
    assert (tmp_path / "links" / "link").resolve() == real  # the link itself is not touched


def test_a_link_loop_or_the_root_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    with pytest.raises(ConfigError, match=r"trainer.output_dir='.*/a/run' is a symbolic link loop"):
        prepare_output_folder(config(tmp_path / "a" / "run"))
    with pytest.raises(ConfigError, match="is the file system's root"):
        prepare_output_folder(config(Path("/")))


LOOP = "is a symbolic link loop (a link that leads back to itself); give a path to a real"


def test_a_link_loop_of_the_folder_or_its_checkpoints_is_one_line_before_ray(
    tmp_path: Path,
) -> None:
    """Checked as ``verlite train`` checks before Ray starts (:func:`check_paths`) and as the
    run takes the folder: pathlib's RuntimeError was a traceback."""
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    with pytest.raises(
        ConfigError, match=re.escape(f"trainer.output_dir={shown(str(tmp_path / 'a'))} {LOOP}")
    ):
        check_paths(config(tmp_path / "a"))
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoints").symlink_to(out / "elsewhere")
    (out / "elsewhere").symlink_to(out / "checkpoints")
    step = out / "checkpoints" / "step_1"
    with pytest.raises(ConfigError, match=re.escape(f"trainer.resume={shown(str(step))} {LOOP}")):
        check_paths(config(out, f"trainer.resume={step}"))
    # another folder's checkpoint, resumed into this folder: its checkpoints are followed
    other = fake_checkpoint(tmp_path / "other", 1, ["actor"])
    loop = shown(str(out / "checkpoints"))
    with pytest.raises(
        ConfigError, match=re.escape(f"{loop} (trainer.output_dir's checkpoints) {LOOP}")
    ):
        prepare_output_folder(config(out, f"trainer.resume={other}"))


def test_an_aside_folder_by_that_name_is_never_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(output_folder.time, "strftime", lambda *_: "STAMP")
    out = tmp_path / "theirs"
    files = someones_files(out)
    (tmp_path / "theirs.replaced-STAMP").mkdir()
    (tmp_path / "theirs.replaced-STAMP" / "older.txt").write_text("older")
    (tmp_path / "theirs.replaced-STAMP-2").symlink_to(tmp_path / "nowhere")
    assert prepare_output_folder(config(out, "trainer.overwrite=true")) is None
    assert files_under(tmp_path / "theirs.replaced-STAMP-3") == files
    assert files_under(tmp_path / "theirs.replaced-STAMP") == {"older.txt": "older"}
    assert not (tmp_path / "nowhere").exists()


def test_read_only_entries_are_moved_aside(tmp_path: Path) -> None:
    out = tmp_path / "theirs"
    files = theirs_with_a_subfolder(out)
    (out / "notes.txt").chmod(0o444)
    (out / "sub").chmod(0o555)
    assert prepare_output_folder(config(out, "trainer.overwrite=true")) is None
    (moved,) = tmp_path.glob("theirs.replaced-*")
    assert files_under(moved) == files


@pytest.mark.parametrize("back_fails", [False, True])
def test_a_move_aside_that_fails_part_way_is_undone_or_says_what_is_where(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, back_fails: bool
) -> None:
    """A cross-device (or refused) move of one entry: what was moved before goes back, and
    the line says where anything is that could not."""
    out = tmp_path / "theirs"
    files = theirs_with_a_subfolder(out)
    rename = os.rename

    def across_devices(src: Path, dst: Path) -> None:
        if Path(src).name == "notes.txt" or (back_fails and Path(dst).parent == out):
            raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))
        rename(src, dst)

    monkeypatch.setattr(os, "rename", across_devices)
    with pytest.raises(ConfigError) as err:
        prepare_output_folder(config(out, "trainer.overwrite=true"))
    said = str(err.value)
    assert f"cannot move '{out / 'notes.txt'}' aside to " in said
    assert "Invalid cross-device link" in said and "\n" not in said
    if back_fails:
        (moved,) = tmp_path.glob("theirs.replaced-*")
        assert f"1 entries could not be moved back and are in '{moved}': config.json" in said
        assert files_under(moved) == {"config.json": files["config.json"]}
        monkeypatch.undo()
        os.rename(moved / "config.json", out / "config.json")
    else:
        assert f"nothing was moved ('{out}' is as it was)" in said
        assert not list(tmp_path.glob("theirs.replaced-*"))
    assert files_under(out) == files


def test_a_link_loop_is_one_line_where_resolve_leaves_it_unresolved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From Python 3.13 ``Path.resolve()`` no longer raises for a loop (it leaves the loop's
    links in the path, as ``os.path.realpath`` does): the loop is then found by reading
    through it (ELOOP), not taken for a missing path. Emulated here by a resolve that only
    makes the path absolute."""
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    monkeypatch.setattr(Path, "resolve", lambda self, strict=False: self.absolute())
    with pytest.raises(ConfigError, match=re.escape(LOOP)):
        check_paths(config(tmp_path / "a" / "run"))
    assert check_paths(config(tmp_path / "missing" / "run")) is None  # a new folder is made
