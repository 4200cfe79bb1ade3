"""The versions of the packages that shape a run's numbers, as a checkpoint records them, and
what a resume says of them: the versions that changed since, and at a load that reads the
checkpoint as another model's, those versions rather than damage where they changed."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest
from checkpoint_support import fake_checkpoint

import verlite
from verlite.driver.checkpoint import (
    CheckpointError,
    DamagedCheckpointError,
    mismatch_error,
    read_trainer_state,
)
from verlite.package_versions import package_versions, unversioned, version_changes

LOAD = "cannot load .../actor/train_state: its values are another model's (RuntimeError: ...)"
WORKERS = {"actor": 1}


def test_the_versions_are_this_process_packages_peft_with_lora() -> None:
    """Mutation: peft recorded whatever ``lora`` -> fails."""
    pytest.importorskip("peft")
    versions = package_versions(peft=False)
    assert list(versions) == ["verlite", "torch", "transformers", "tokenizers"]
    assert all(importlib.metadata.version(name) == v for name, v in versions.items())
    assert package_versions(peft=True) == {**versions, "peft": importlib.metadata.version("peft")}


def test_a_version_change_is_named_package_by_package() -> None:
    here = package_versions(peft=False)
    assert version_changes(here) == []
    assert version_changes({}) == []  # a checkpoint that recorded none
    # one not installed here (verlite run from its source folder) has no version to compare;
    # a torch no machine has (2.11.0 is the GPU machine's: this failed under it)
    assert version_changes({**here, "torch": "0.0.1", "verlite-no-such-package": "1.0"}) == [
        f"torch 0.0.1 -> {here['torch']}"
    ]


def test_a_version_tells_code_apart_where_recorded_installed_and_not_a_source_folder() -> None:
    """Mutation: a source folder's version taken as telling its code apart -> fails."""
    if not (Path(verlite.__file__).parents[1] / "pyproject.toml").is_file():
        pytest.skip("verlite installed from a wheel: no source folder's install to check")
    here = package_versions(peft=False)
    # torch is installed from a wheel; verlite here from its source folder (make setup's
    # `pip install -e`, or the folder on the path): its version names no commit
    assert unversioned(here, ("torch", "transformers", "verlite"), [here]) == ["verlite"]
    assert unversioned({}, ("torch",), [here]) == ["torch"]  # a checkpoint that recorded none
    # a reader without it (not installed on that worker's node): mutation: the readers'
    # versions not consulted -> fails
    without = {k: v for k, v in here.items() if k != "transformers"}
    assert unversioned(here, ("torch", "transformers"), [here, without]) == ["transformers"]


def test_the_versions_written_are_read_back(tmp_path: Path) -> None:
    versions = package_versions(peft=True)
    step = fake_checkpoint(tmp_path, 3, ["actor"], config={}, versions=versions)
    assert read_trainer_state(step)["versions"] == versions


def _mismatch(
    tmp_path: Path,
    model_path: str | None,
    readers: list[dict[str, str]] | None = None,
    **saved: object,
) -> CheckpointError:
    """The load's error, read by workers of this process's versions unless ``readers``."""
    step = fake_checkpoint(tmp_path, 3, ["actor"], config={}, **saved)
    return mismatch_error(
        LOAD,
        step,
        read_trainer_state(step),
        model_path=model_path,
        workers=WORKERS,
        readers=[package_versions(peft=True)] if readers is None else readers,
    )


@pytest.mark.parametrize("package", ["transformers", "verlite"])
def test_a_load_of_another_models_values_under_other_versions_names_them(
    tmp_path: Path, package: str
) -> None:
    """Not damage alone: the files may be whole, written by another transformers' model
    classes (or verlite's). Mutation: the versions not compared -> the damage line, this
    fails."""
    older = {**package_versions(peft=False), package: "0.0.1"}
    err = _mismatch(tmp_path, "base", versions=older)
    assert not isinstance(err, DamagedCheckpointError)
    assert str(err).startswith(
        f"{LOAD}; it was written under other package versions ({package} 0.0.1 -> "
        f"{importlib.metadata.version(package)}), whose model classes may name its values "
        "otherwise: resume it under those versions; if it reads so there too, its files are "
        "damaged. No earlier checkpoint"
    ), err


def test_a_load_by_workers_of_other_versions_than_the_drivers_names_theirs(
    tmp_path: Path,
) -> None:
    """The workers read the checkpoint, not the driver: one whose transformers is not the one
    recorded (the driver's is) names it, each change once, however many workers have it.
    Mutation: the driver's versions compared instead of the readers' -> the damage line, this
    fails."""
    here = package_versions(peft=False)
    other = {**here, "transformers": "0.0.2"}
    err = _mismatch(tmp_path, None, [here, other, other], versions=here)
    assert not isinstance(err, DamagedCheckpointError)
    assert str(err).startswith(
        f"{LOAD}; it was written under other package versions (transformers "
        f"{here['transformers']} -> 0.0.2), whose model classes"
    ), err


def test_a_load_of_another_models_values_under_another_torch_is_damage(tmp_path: Path) -> None:
    """torch and tokenizers name no model's values: their change is said at start-up, not
    here. Mutation: every package compared at the load -> this fails."""
    older = {**package_versions(peft=False), "torch": "2.0.0", "tokenizers": "0.1.0"}
    err = _mismatch(tmp_path, None, versions=older)
    assert isinstance(err, DamagedCheckpointError)
    # not "these package versions": two of them changed (review). Mutation: said whenever
    # versions were recorded -> this fails
    assert f"{LOAD}; it was written under this config's model settings, so its files" in str(err)


@pytest.mark.parametrize(
    ("model_path", "saved", "cause"),
    [
        (
            "base",
            {"versions": package_versions(peft=False)},
            " (or verlite or model.path's config.json changed since",
        ),
        (None, {"versions": package_versions(peft=False)}, " (or verlite changed since it"),
        ("base", {}, " (or verlite or transformers or model.path's config.json changed since"),
        (None, {}, " (or verlite or transformers changed since it was written). No earlier"),
    ],
    ids=["model.path", "built-in model", "model.path, no versions", "built-in, no versions"],
)
def test_a_load_of_another_models_values_under_the_same_versions_is_damage(
    tmp_path: Path, model_path: str | None, saved: dict[str, object], cause: str
) -> None:
    """The same versions are no cause: the line names what no record of the checkpoint
    covers beside damage (model.path's config.json where the model is read from there;
    transformers where it recorded no versions; verlite, here a source folder's, whose version
    names no commit). Mutation: the versions named as a cause whatever the checkpoint
    recorded -> the recorded cases fail."""
    if not (Path(verlite.__file__).parents[1] / "pyproject.toml").is_file():
        pytest.skip("verlite installed from a wheel: its version tells its code apart")
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
