"""A damaged checkpoint is bad input (exit 2), in one line naming the checkpoint and its
damaged file and saying what to resume instead: refused before Ray where its DCP index and
the files' sizes show the damage, at the workers' load where only loading finds it; what is
not damage (a random state no rank of the resume reads, a checkpoint of another model than
the config's) is not called so. One run's checkpoints (steps 1 and 2) are written once, and
copied for each case."""

import json
import pickle
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from verlite.config import load_config
from verlite.driver.checkpoint import DamagedCheckpointError, check_resumable
from verlite.driver.preflight import RunInputs
from verlite.package_versions import package_versions

# A whole run and runs started over its copies (one starts Ray): make test-cluster, which CI runs.
pytestmark = pytest.mark.cluster

CONFIG = "configs/ppo_tiny.yaml"
RUN = ("trainer.save_freq=1", "trainer.val_freq=0", "trainer.export=false")


@pytest.fixture(scope="module")
def written(train_for_module, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("damaged") / "run"
    train_for_module(out, *RUN, "trainer.total_steps=2")
    return out


def _cut(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _shard(step: Path, role: str) -> Path:
    return step / role / "train_state" / "__0_0.distcp"


DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    ".metadata cut short": (
        lambda step: _cut(step / "critic" / "train_state" / ".metadata"),
        r"critic/train_state/\.metadata is cut short or damaged \(UnpicklingError: pickle data "
        r"was truncated\)",
    ),
    "shard cut short": (
        lambda step: _cut(_shard(step, "critic")),
        r"critic/train_state/__0_0\.distcp is cut short \(\d+ bytes; its index needs \d+\)",
    ),
    "shard missing": (
        lambda step: _shard(step, "actor").unlink(),
        r"actor/train_state/__0_0\.distcp is missing",
    ),
}


def _damaged(written: Path, tmp_path: Path, damage: Callable[[Path], None], *steps: int) -> Path:
    out = tmp_path / "run"
    shutil.copytree(written, out)
    for step in steps:
        damage(out / "checkpoints" / f"step_{step}")
    return out


def _train(verlite_main, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    overrides = [f"trainer.output_dir={out}", "critic.warmup_steps=0", *RUN, *extra]
    return verlite_main("train", "--config", CONFIG, *overrides, "trainer.total_steps=3")


def _one_line(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("verlite: error: ") and done.stderr.count("\n") == 1
    assert "Traceback" not in done.stderr
    return done.stderr


@pytest.mark.parametrize("kind", DAMAGE)
def test_a_damaged_checkpoint_is_refused_before_ray_naming_an_earlier_one(
    written: Path, tmp_path: Path, verlite_main, kind: str
) -> None:
    damage, named = DAMAGE[kind]
    out = _damaged(written, tmp_path, damage, 2)
    done = _train(verlite_main, out)
    err = _one_line(done)
    assert done.stdout == "", done.stdout  # refused before any worker started
    assert f"cannot resume from {out / 'checkpoints' / 'step_2'}: " in err
    assert re.search(named, err), err
    step_1 = out / "checkpoints" / "step_1"
    assert f". Resume from an earlier one with trainer.resume={step_1}, or start afresh " in err
    # What it says works: the earlier checkpoint passes every check made before Ray.
    cfg = load_config(CONFIG, [f"trainer.output_dir={out}", f"trainer.resume={step_1}"])
    inputs = RunInputs.load(cfg)
    inputs.folder.release()
    assert inputs.resume_from == step_1


def test_a_run_whose_checkpoints_are_all_damaged_is_told_to_start_afresh(
    written: Path, tmp_path: Path, verlite_main
) -> None:
    damage, named = DAMAGE["shard missing"]
    out = _damaged(written, tmp_path, damage, 1, 2)
    err = _one_line(_train(verlite_main, out))
    assert re.search(named, err), err
    assert err.endswith(
        ". No earlier checkpoint of its run is whole: start afresh with trainer.resume=disable "
        "and trainer.overwrite=true (which moves the output folder's files aside)\n"
    ), err


def test_a_shard_damaged_in_place_is_refused_at_its_load(
    written: Path, tmp_path: Path, verlite_main
) -> None:
    """Its size whole, the damage shows only as the worker reads it: the run stops there, bad
    input all the same, and says to resume the earlier checkpoint, not this one again."""

    def overwrite_start(step: Path) -> None:
        with _shard(step, "critic").open("r+b") as shard:
            shard.write(bytes(64))

    out = _damaged(written, tmp_path, overwrite_start, 2)
    err = _one_line(_train(verlite_main, out))
    folder = out / "checkpoints" / "step_2" / "critic" / "train_state"
    assert f"cannot load {folder}: UnpicklingError: Weights only load failed: " in err, err
    assert "(worker group 'critic': rank 0 on node " in err
    step_1 = out / "checkpoints" / "step_1"
    assert f". Resume from an earlier one with trainer.resume={step_1}, or start afresh " in err
    assert "again" not in err and "continues from" not in err


def test_a_random_state_a_resume_never_reads_does_not_block_it(
    written: Path, tmp_path: Path
) -> None:
    """Each rank restores its own random state (TrainingWorker.load_checkpoint): a resume by
    fewer workers than the save's never reads the other ranks' files, so their damage is no
    reason to refuse it; a resume by as many workers is refused, naming the file."""

    def second_rank_cut(step: Path) -> None:  # as a save by two critic workers left it
        shutil.copy(step / "critic" / "rng_rank0.pt", step / "critic" / "rng_rank1.pt")
        _cut(step / "critic" / "rng_rank1.pt")

    out = _damaged(written, tmp_path, second_rank_cut, 2)
    step_2 = out / "checkpoints" / "step_2"
    cfg = load_config(CONFIG, [f"trainer.output_dir={out}", "trainer.total_steps=3", *RUN])
    inputs = RunInputs.load(cfg)  # every check before Ray: one critic worker resumes it
    inputs.folder.release()
    assert inputs.resume_from == step_2
    with pytest.raises(DamagedCheckpointError, match=r"critic/rng_rank1\.pt is cut short or"):
        check_resumable(
            step_2,
            config=cfg.model_dump(mode="json"),
            workers={"actor": 1, "critic": 2},
            total_steps=3,
            train_set=inputs.train_set.fingerprint,
        )


def test_a_checkpoint_of_another_model_than_the_configs_is_not_called_damaged(
    written: Path, tmp_path: Path, verlite_main
) -> None:
    """Bad input a worker finds at the load that is not damage keeps its own message: a
    checkpoint recording only its model settings (as older versions wrote them) resumed with
    adapters it never had loads none of their values; no earlier checkpoint would mend it."""

    def model_settings_only(step: Path) -> None:
        state = json.loads((step / "trainer_state.json").read_text())
        state["model"] = state.pop("config")["model"]
        (step / "trainer_state.json").write_text(json.dumps(state))

    out = _damaged(written, tmp_path, model_settings_only, 2)
    err = _one_line(_train(verlite_main, out, "actor.lora.rank=4"))
    folder = out / "checkpoints" / "step_2" / "actor" / "train_state"
    assert f"cannot load {folder}: its values are another model's (RuntimeError: Missing " in err
    assert "resume it with the model, adapter and role settings it was trained with" in err
    assert "damaged" not in err and "Resume from an earlier one" not in err, err


@pytest.mark.parametrize("versions", ["as written", "another transformers"])
def test_a_checkpoint_of_this_configs_model_that_reads_as_anothers_is_damaged(
    written: Path, tmp_path: Path, verlite_main, versions: str
) -> None:
    """A checkpoint that recorded its whole config, every setting that shapes the model as
    the resuming run's (start-up compares them), and the packages' versions as this process
    has them, whose index names a value the model lacks (a key's bytes altered: 35 of 400
    random single-byte changes of an index read so) is damaged, with the earlier checkpoint to
    resume: not "another model", whose settings advice would send the user to look for
    settings that never changed (verlite, here a source folder's, whose version names no
    commit, is named as a possible cause). Under another transformers than it recorded, that
    version is named first: its model classes may name their values otherwise. Mutations: a mismatch
    taken as another model's whatever the checkpoint recorded -> no hint, this fails; no
    versions written -> the first assertion fails; the versions not compared at the load ->
    the damage line under another transformers, this fails."""
    here = package_versions(peft=False)
    step_2 = written / "checkpoints" / "step_2"
    assert json.loads((step_2 / "trainer_state.json").read_text())["versions"] == here

    def key_renamed(step: Path) -> None:
        index = step / "actor" / "train_state" / ".metadata"
        metadata = pickle.loads(index.read_bytes())  # the run's own file, written above
        name = next(key for key in metadata.state_dict_metadata if key.startswith("model."))
        metadata.state_dict_metadata[name + "_"] = metadata.state_dict_metadata.pop(name)
        index.write_bytes(pickle.dumps(metadata))
        if versions == "another transformers":
            state = json.loads((step / "trainer_state.json").read_text())
            state["versions"]["transformers"] = "0.0.2"
            (step / "trainer_state.json").write_text(json.dumps(state))

    out = _damaged(written, tmp_path, key_renamed, 2)
    done = _train(verlite_main, out)
    err = _one_line(done)
    folder = out / "checkpoints" / "step_2" / "actor" / "train_state"
    assert f"cannot load {folder}: its values are another model's (RuntimeError: Missing " in err
    if versions == "another transformers":
        assert (
            f"; it was written under other package versions (transformers 0.0.2 -> "
            f"{here['transformers']}), whose model classes may name its values otherwise: "
            "resume it under those versions; if it reads so there too, its files are damaged. "
            "Resume from an earlier one"
        ) in err
        # said at start-up too, before the load
        assert "under other package versions than it was written with: transformers" in done.stdout
        return
    assert (
        "it was written under this config's model settings and these package versions, so its "
        "files are damaged (or verlite changed since it was written). "
    ) in err
    step_1 = out / "checkpoints" / "step_1"
    assert f". Resume from an earlier one with trainer.resume={step_1}, or start afresh " in err
