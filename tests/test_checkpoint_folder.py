"""The checkpoint folder as saves leave it (``driver/checkpoint.py``): what is kept, what a
resume finds."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from checkpoint_support import fake_checkpoint

from verlite import checkpoint_files
from verlite.driver.checkpoint import (
    begin_checkpoint,
    commit_checkpoint,
    complete_checkpoints,
    resume_checkpoint,
    seal_checkpoint,
)
from verlite.errors import UserError


def _save(out: Path, step: int, *, keep: int) -> Path:
    tmp = begin_checkpoint(out, step)
    (tmp / "actor").mkdir()
    seal_checkpoint(tmp, {"step": step, "loader": {}, "kl_coef": 0.0})
    return commit_checkpoint(tmp, keep=keep)


def test_saves_keep_the_latest_ones(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, keep=2)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_3", "step_4"]


def test_saves_through_links_remove_links_never_what_they_point_to(tmp_path: Path) -> None:
    """The output folder a link, its ``checkpoints/`` a link to a scratch disk, and in it links
    to someone's folders by the names a save removes: a checkpoint pruned, a partial save of a
    crashed run, the save's own ``step_N.tmp`` (and one leading nowhere). Each link goes;
    what it points to stays whole.
    A linked checkpoint ended the run at its pruning ("Cannot call rmtree on a symbolic link",
    after the new checkpoint was in place), as did a linked ``step_N.tmp`` at the save."""
    real, scratch, out = tmp_path / "real", tmp_path / "scratch", tmp_path / "out"
    real.mkdir()
    scratch.mkdir()
    out.symlink_to(real)
    (real / "checkpoints").symlink_to(scratch)
    theirs = {}
    for name in ("checkpoint", "partial", "tmp"):
        folder = tmp_path / f"someones_{name}"
        fake_checkpoint(folder, 1, ["actor"])
        theirs[folder] = sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))
    (scratch / "step_1").symlink_to(tmp_path / "someones_checkpoint" / "checkpoints" / "step_1")
    (scratch / "step_0.tmp").symlink_to(tmp_path / "someones_partial")
    (scratch / "step_2.tmp").symlink_to(tmp_path / "someones_tmp")
    assert [p.name for p in complete_checkpoints(out)] == ["step_1"]
    _save(out, 2, keep=1)
    assert sorted(p.name for p in scratch.iterdir()) == ["step_2"]
    (scratch / "step_3.tmp").symlink_to(tmp_path / "nowhere")
    _save(out, 3, keep=1)
    assert sorted(p.name for p in scratch.iterdir()) == ["step_3"]
    assert (real / "checkpoints").is_symlink() and out.is_symlink()
    for folder, files in theirs.items():
        assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) == files


def test_a_save_replaces_a_link_by_its_name_that_leads_nowhere(tmp_path: Path) -> None:
    """A ``step_N`` link whose folder is gone (a scratch disk cleaned): no checkpoint, so the
    run resumes before it and saves step N again. The save's rename over the link failed
    ("Not a directory") and ended the run; the link goes as a live one does."""
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "step_2").symlink_to(tmp_path / "cleaned")
    assert complete_checkpoints(tmp_path) == []
    final = _save(tmp_path, 2, keep=2)
    assert not final.is_symlink() and complete_checkpoints(tmp_path) == [final]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_2"]


def test_a_run_resumed_from_an_earlier_step_keeps_its_own_checkpoints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The folder holds step_3 and step_6; a run resumed from step_3 (``trainer.resume`` its
    path) saves step_4. Pruning by step number deleted the checkpoint just written (with
    ``max_checkpoints=1``) and kept step_6, whose records the resumed run's
    ``metrics.jsonl`` dropped: ``trainer.resume=auto`` then continued the abandoned run."""
    for step in (3, 6):
        fake_checkpoint(tmp_path, step, ["actor"])
    saved = _save(tmp_path, 4, keep=1)
    assert saved.is_dir()
    said = capsys.readouterr().out
    assert (
        said == "removed the checkpoints of the run this one resumed before, past step 4: step_6\n"
    )
    assert complete_checkpoints(tmp_path) == [saved]
    assert resume_checkpoint(tmp_path, "auto") == saved


def test_a_resume_path_that_is_not_there_is_said_to_be_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A path that is no folder at all (a typo) was called 'not a complete checkpoint (no
    trainer_state.json in it)', as if the folder were there, half written; a relative one
    names the folder it was looked for in, as a missing relative input does."""
    with pytest.raises(UserError) as missing:
        resume_checkpoint(tmp_path, str(tmp_path / "checkpoints" / "step_99"))
    assert str(missing.value) == (
        f"trainer.resume={str(tmp_path / 'checkpoints' / 'step_99')!r}: no such folder; give a "
        "checkpoint folder (<trainer.output_dir>/checkpoints/step_N), auto or disable"
    )
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as missing:
        resume_checkpoint(tmp_path, "checkpoints/step_99")
    assert str(missing.value) == (
        "trainer.resume='checkpoints/step_99': no such folder; a relative path is read from "
        f"the current folder, {str(tmp_path)!r}; give a checkpoint folder "
        "(<trainer.output_dir>/checkpoints/step_N), auto or disable"
    )
    (tmp_path / "half").mkdir()  # a folder without the driver's state: incomplete
    with pytest.raises(UserError, match="not a complete checkpoint"):
        resume_checkpoint(tmp_path, str(tmp_path / "half"))
    (tmp_path / "state.json").write_text("{}")  # a file, not a checkpoint folder
    with pytest.raises(UserError) as file:
        resume_checkpoint(tmp_path, str(tmp_path / "state.json"))
    assert str(file.value) == (
        f"trainer.resume={str(tmp_path / 'state.json')!r}: not a folder; give a checkpoint "
        "folder (<trainer.output_dir>/checkpoints/step_N), auto or disable"
    )


def test_a_checkpoint_is_on_disk_before_it_is_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every file the workers wrote, every folder, and then the driver's state are flushed
    before the rename, and the rename after it: a machine that crashes (not only the process)
    leaves no ``step_N`` whose files the disk never received."""
    synced: list[Path] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src: Path, dst: Path) -> None:
        synced.append(Path("renamed"))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    tmp = begin_checkpoint(tmp_path, 1)
    (tmp / "actor" / "model").mkdir(parents=True)
    written = [tmp / "actor" / "model" / "shard.distcp", tmp / "actor" / "rng_rank0.pt"]
    for path in written:
        path.write_bytes(b"x")
    seal_checkpoint(tmp, {"step": 1, "loader": {}, "kl_coef": 0.0})
    commit_checkpoint(tmp, keep=1)
    before = synced[: synced.index(Path("renamed"))]
    assert set(before) == {
        *written,
        tmp,
        tmp / "actor",
        tmp / "actor" / "model",
        tmp / "trainer_state.json",
    }
    assert before[-1] == tmp / "trainer_state.json"
    assert synced[synced.index(Path("renamed")) + 1] == tmp.parent


def test_the_drivers_checkpoint_checks_import_no_training_engine() -> None:
    """The driver checks a checkpoint before any worker starts (``check_resumable``); the
    engine's file names came from ``workers.train_engine``, so those checks imported DCP,
    the models and the workers (2719 modules, not 1233)."""
    code = (
        "import sys, verlite.driver.checkpoint; "
        "print(sorted(m for m in sys.modules if m.startswith(('verlite.workers', "
        "'torch.distributed.checkpoint', 'transformers'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_each_checkpoint_file_name_is_written_once() -> None:
    """``verlite/checkpoint_files.py`` owns the names of a role's checkpoint files: the
    engine, which writes them, and the driver, which checks them, both read them there."""
    names = [
        value
        for key, value in vars(checkpoint_files).items()
        if key.isupper() and isinstance(value, str)
    ]
    source = Path(checkpoint_files.__file__).parent
    for name in names:
        found = [
            path.relative_to(source).as_posix()
            for path in sorted(source.rglob("*.py"))
            if f'"{name}"' in path.read_text()
        ]
        assert found == ["checkpoint_files.py"], (name, found)
