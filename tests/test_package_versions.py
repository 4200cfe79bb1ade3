"""The versions of the packages that shape a run's numbers, as a checkpoint records them, and
what a resume says of them: the versions that changed since, and at a load that reads the
checkpoint as another model's, those versions rather than damage where they changed."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest
from checkpoint_support import fake_checkpoint

from verlite.driver.checkpoint import (
    CheckpointError,
    DamagedCheckpointError,
    mismatch_error,
    read_trainer_state,
)
from verlite.package_versions import package_versions, version_changes

LOAD = "cannot load .../actor/train_state: its values are another model's (RuntimeError: ...)"
WORKERS = {"actor": 1}


def test_the_versions_are_this_process_packages_peft_with_lora() -> None:
    """Mutation: peft recorded whatever ``lora`` -> fails."""
    pytest.importorskip("peft")
    versions = package_versions(lora=False)
    assert list(versions) == ["verlite", "torch", "transformers", "tokenizers"]
    assert all(importlib.metadata.version(name) == v for name, v in versions.items())
    assert package_versions(lora=True) == {**versions, "peft": importlib.metadata.version("peft")}


def test_a_version_change_is_named_package_by_package() -> None:
    here = package_versions(lora=False)
    assert version_changes(here) == []
    assert version_changes({}) == []  # a checkpoint that recorded none
    assert version_changes({**here, "torch": "2.11.0", "verlite-no-such-package": "1.0"}) == [
        f"torch 2.11.0 -> {here['torch']}",
        "verlite-no-such-package 1.0 -> (not installed)",
    ]


def test_the_versions_written_are_read_back(tmp_path: Path) -> None:
    versions = package_versions(lora=True)
    step = fake_checkpoint(tmp_path, 3, ["actor"], config={}, versions=versions)
    assert read_trainer_state(step)["versions"] == versions


def _mismatch(tmp_path: Path, model_path: str | None, **saved: object) -> CheckpointError:
    step = fake_checkpoint(tmp_path, 3, ["actor"], config={}, **saved)
    return mismatch_error(
        LOAD, step, read_trainer_state(step), model_path=model_path, workers=WORKERS
    )


def test_a_load_of_another_models_values_under_other_versions_names_them(tmp_path: Path) -> None:
    """Not damage: the files may be whole, written by another transformers' model classes.
    Mutation: the versions not compared -> the damage line, this fails."""
    older = {**package_versions(lora=False), "transformers": "5.24.0"}
    err = _mismatch(tmp_path, "base", versions=older)
    assert not isinstance(err, DamagedCheckpointError)
    assert str(err) == (
        f"{LOAD}; it was written under other package versions (transformers 5.24.0 -> "
        f"{importlib.metadata.version('transformers')}): resume it under the versions it was "
        "written with"
    )


@pytest.mark.parametrize(
    ("model_path", "saved", "cause"),
    [
        ("base", {"versions": package_versions(lora=False)}, " (or model.path's config.json"),
        (None, {"versions": package_versions(lora=False)}, ". No earlier"),
        ("base", {}, " (or verlite or transformers or model.path's config.json changed since"),
        (None, {}, " (or verlite or transformers changed since it was written). No earlier"),
    ],
    ids=["model.path", "built-in model", "model.path, no versions", "built-in, no versions"],
)
def test_a_load_of_another_models_values_under_the_same_versions_is_damage(
    tmp_path: Path, model_path: str | None, saved: dict[str, object], cause: str
) -> None:
    """The same versions are no cause: the line names what no record of the checkpoint
    covers beside damage (model.path's config.json where the model is read from there; the
    versions where it recorded none). Mutation: the versions named as a cause whatever the
    checkpoint recorded -> the recorded cases fail."""
    err = _mismatch(tmp_path, model_path, **saved)
    assert isinstance(err, DamagedCheckpointError)
    recorded = " and these package versions" if saved else ""
    assert str(err).startswith(
        f"{LOAD}; it was written under this config's model settings{recorded}, so its files are "
        f"damaged{cause}"
    ), err
    assert str(err).endswith(
        "No earlier checkpoint of its run is whole: start afresh with "
        "trainer.resume=disable and trainer.overwrite=true (which moves "
        "the output folder's files aside)"
    )
