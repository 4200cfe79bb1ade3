"""The checkpoint folder as saves leave it (``driver/checkpoint.py``): what is kept, what a
resume finds."""

from pathlib import Path

from checkpoint_support import fake_checkpoint

from verlite.driver.checkpoint import (
    begin_checkpoint,
    commit_checkpoint,
    complete_checkpoints,
    resume_checkpoint,
)


def _save(out: Path, step: int, *, keep: int) -> Path:
    tmp = begin_checkpoint(out, step)
    (tmp / "actor").mkdir()
    return commit_checkpoint(tmp, {"step": step, "loader": {}, "kl_coef": 0.0}, keep=keep)


def test_saves_keep_the_latest_ones(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, keep=2)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_3", "step_4"]


def test_a_run_resumed_from_an_earlier_step_keeps_its_own_checkpoints(tmp_path: Path) -> None:
    """The folder holds step_3 and step_6; a run resumed from step_3 (``trainer.resume`` its
    path) saves step_4. Pruning by step number deleted the checkpoint just written (with
    ``max_checkpoints=1``) and kept step_6, whose records the resumed run's
    ``metrics.jsonl`` dropped: ``trainer.resume=auto`` then continued the abandoned run."""
    for step in (3, 6):
        fake_checkpoint(tmp_path, step, ["actor"])
    saved = _save(tmp_path, 4, keep=1)
    assert saved.is_dir()
    assert complete_checkpoints(tmp_path) == [saved]
    assert resume_checkpoint(tmp_path, "auto") == saved
