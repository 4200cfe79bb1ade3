"""The Python API (``verlite.load_config``, ``verlite.train``, ``verlite.read_metrics``): the
example of docs/python-api.md run as written, whole runs in this process's open Ray session,
and the errors a script gets instead of an exit code."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest

import verlite
from verlite.config import ConfigError
from verlite.errors import UserError

ROOT = Path(__file__).resolve().parents[1]


def documented_example() -> str:
    guide = (ROOT / "docs" / "python-api.md").read_text()
    match = re.search(r"```python\n(.*?)```", guide, re.DOTALL)
    assert match is not None, "docs/python-api.md lost its example"
    return match.group(1)


def test_the_documented_example_runs_as_written(
    local_ray, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    monkeypatch.chdir(tmp_path)  # as a user in a checkout runs it; outputs/ lands here
    exec(compile(documented_example(), "docs/python-api.md", "exec"), {})
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("lr ")]
    assert [line.split(":")[0] for line in lines] == ["lr 0.001", "lr 0.003"]
    assert all(line.endswith("after 3 steps") for line in lines)
    for lr in ("0.001", "0.003"):
        config = json.loads((tmp_path / f"outputs/sweep/lr-{lr}/config.json").read_text())
        assert config["actor"]["optim"]["lr"] == float(lr)
        assert config["critic"]["warmup_steps"] == 0
        # The workers' files land beside the driver's, not in the shared Ray's folder.
        assert (tmp_path / f"outputs/sweep/lr-{lr}/hf_actor/model.safetensors").is_file()


def test_overriding_a_loaded_config_follows_inherited_fields() -> None:
    base = verlite.load_config("configs/ppo_tiny.yaml", {"trainer.total_steps": 7})
    assert base.critic.loss_agg_mode == "token-mean"  # follows the actor's
    changed = verlite.load_config(base, ["actor.loss_agg_mode=seq-mean-token-mean"])
    assert changed.critic.loss_agg_mode == "seq-mean-token-mean"
    assert changed.trainer.total_steps == 7
    assert base.trainer.total_steps == 7  # the loaded config is left as it was
    # A copy changed in Python is overridden from what it is now, not from its source.
    trainer = base.trainer.model_copy(update={"total_steps": 77})
    copied = verlite.load_config(base.model_copy(update={"trainer": trainer}), {"trainer.seed": 3})
    assert (copied.trainer.total_steps, copied.trainer.seed) == (77, 3)
    mapping = verlite.load_config({"data": {"task": "copy"}}, {"actor.optim.lr": 0.01})
    assert mapping.actor.optim.lr == 0.01


def test_read_metrics_as_a_list_or_a_frame(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 1, "critic/score/mean": 0.5}\n{"step": 2, "critic/score/mean": 0.25}\n'
    )
    steps = verlite.read_metrics(tmp_path)
    assert steps == [{"step": 1, "critic/score/mean": 0.5}, {"step": 2, "critic/score/mean": 0.25}]
    frame = verlite.read_metrics(tmp_path / "metrics.jsonl", as_frame=True)
    assert list(frame.index) == [1, 2] and list(frame["critic/score/mean"]) == [0.5, 0.25]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"trainer.totl_steps": 3}, "unknown key 'trainer.totl_steps'; did you mean"),
        ({"trainer.total_steps": "x"}, "trainer.total_steps='x': Input should be a valid integer"),
        ({"trainer..steps": 3}, "malformed override key 'trainer..steps'"),
        ("trainer.total_steps=3", "overrides='trainer.total_steps=3' is one string"),
        (["trainer.total_steps"], "malformed override 'trainer.total_steps'"),
        (
            ["trainer.total_steps=2", 3],
            "overrides[1]=3: expected a dotted.key=value string, got an int",
        ),
        ([b"trainer.seed=1"], "overrides[0]=b'trainer.seed=1': expected a dotted.key=value string"),
        (None, "overrides=None is a NoneType; give a list of dotted.key=value strings"),
        (3, "overrides=3 is an int; give a list of dotted.key=value strings"),
        (b"a=1", "overrides=b'a=1' is a bytes; give a list"),
        (
            {"trainer.output_dir": "out\0"},
            "trainer.output_dir='out\\x00': a path cannot hold a NUL",
        ),
    ],
)
def test_bad_overrides_raise_one_line(overrides: object, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        verlite.load_config("configs/ppo_tiny.yaml", overrides)  # type: ignore[arg-type]
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_a_moved_key_given_to_train_is_refused_naming_its_new_place(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        verlite.train(
            "configs/grpo_tiny.yaml",
            {"trainer.max_staleness": 1, "trainer.output_dir": str(tmp_path / "run")},
        )
    assert str(info.value) == (
        "trainer.max_staleness moved to rollout.max_staleness; set rollout.max_staleness instead"
    )
    assert not (tmp_path / "run").exists()  # refused before anything started


def test_read_metrics_of_something_that_is_no_path_is_one_line() -> None:
    with pytest.raises(UserError, match=r"^run=3: expected a run folder or its metrics.jsonl"):
        verlite.read_metrics(3)  # type: ignore[call-overload]


def test_a_section_given_as_a_mapping_merges_into_the_files_section() -> None:
    cfg = verlite.load_config(
        "configs/ppo_tiny.yaml", {"trainer": {"total_steps": 2}, "actor": {"optim": {"lr": 0.1}}}
    )
    file = verlite.load_config("configs/ppo_tiny.yaml")
    assert cfg.trainer == file.trainer.model_copy(update={"total_steps": 2})
    assert cfg.actor.optim == file.actor.optim.model_copy(update={"lr": 0.1})
    assert cfg.actor.entropy_coeff == file.actor.entropy_coeff
    # a dotted key inside a section's mapping names a field below it
    dotted = verlite.load_config("configs/ppo_tiny.yaml", {"actor": {"optim.lr": 0.1}})
    assert dotted.actor == cfg.actor


def test_a_cluster_address_in_a_process_with_ray_open_is_refused(local_ray) -> None:
    with pytest.raises(UserError, match=r"^trainer.ray_address='127.0.0.1:1': this process is"):
        verlite.train("configs/ppo_tiny.yaml", {"trainer.ray_address": "127.0.0.1:1"})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"trainer.cpus_per_worker": 5},
            "the workers ask for 5 CPUs (actor+critic 1x5: trainer.cpus_per_worker=5), the open",
        ),
        (
            {"trainer.nnodes": 2},
            "trainer.nnodes=2, but the Ray session this process has open has 1",
        ),
    ],
)
def test_a_job_too_big_for_the_open_ray_session_is_refused_before_placing(
    local_ray, overrides: dict[str, int], message: str
) -> None:
    fits = {"actor.micro_batch_size_per_worker": 8, "critic.micro_batch_size_per_worker": 8}
    with pytest.raises(UserError) as info:
        verlite.train("configs/ppo_tiny.yaml", {**fits, **overrides})
    assert str(info.value).startswith(message)


def test_read_metrics_as_frame_without_pandas_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "critic/score/mean": 0.5}\n')
    monkeypatch.setitem(sys.modules, "pandas", None)
    with pytest.raises(UserError, match=r"pip install 'pandas>=2' \(verlite's 'pandas' extra\)"):
        verlite.read_metrics(tmp_path, as_frame=True)
