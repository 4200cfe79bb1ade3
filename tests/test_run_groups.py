"""The worker groups a Trainer is handed are the ones its config runs with
(``RunGroups.check``): a critic, a rollout and a reward model group each exactly when the
config needs one; ``start_groups`` starts them side by side."""

import sys
from typing import Any

import pytest
import ray

from verlite.config import load_config
from verlite.controller import Worker, WorkerGroup
from verlite.data import load_tokenizer
from verlite.driver import run as driver_run
from verlite.driver.trainer import RunGroups

# Ray workers cannot import this module: its worker class travels by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

GROUP = object()  # the check only asks which groups are there


@pytest.mark.parametrize(
    ("config", "overrides", "groups", "refused"),
    [
        ("ppo_tiny", [], {"critic": GROUP}, None),
        (
            "ppo_tiny",
            [],
            {},
            "algorithm.adv_estimator=gae needs a critic group; the trainer was handed none",
        ),
        ("grpo_tiny", [], {"critic": GROUP}, "needs no critic group; the trainer was handed one"),
        ("grpo_tiny", ["rollout.placement=split"], {"rollout": GROUP}, None),
        ("grpo_tiny", ["rollout.placement=split"], {}, "rollout.placement=split needs a rollout"),
        ("grpo_tiny", [], {"rollout": GROUP}, "rollout.placement=colocated needs no rollout"),
        (
            "grpo_tiny",
            [],
            {"reward_model": GROUP},
            "reward.model.path=None needs no reward model group",
        ),
    ],
)
def test_the_groups_are_those_the_config_runs_with(
    config: str, overrides: list[str], groups: dict, refused: str | None
) -> None:
    cfg = load_config(f"configs/{config}.yaml", overrides)
    handed = RunGroups(
        actor=GROUP,
        critic=groups.get("critic"),
        rollout=groups.get("rollout"),
        reward_model=groups.get("reward_model"),
    )
    if refused is None:
        handed.check(cfg)
        return
    with pytest.raises(ValueError, match=refused):
        handed.check(cfg)


class Idle(Worker):
    """A worker with nothing to load, for the order in which groups start."""

    def init_model(self) -> None:
        pass


def test_a_runs_groups_start_side_by_side(local_ray, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every group's workers are started before any group is waited for: their starts (a
    real worker imports torch and transformers, seconds) overlap; one group after another,
    they added up."""
    events = []
    construct, join = WorkerGroup.__init__, WorkerGroup.join

    def constructed(group: WorkerGroup, name: str, *args: Any, **kwargs: Any) -> None:
        construct(group, name, *args, **kwargs)
        events.append(f"started {name}")

    def joined(group: WorkerGroup) -> None:
        events.append(f"waited for {group.name}")
        join(group)

    monkeypatch.setattr(WorkerGroup, "__init__", constructed)
    monkeypatch.setattr(WorkerGroup, "join", joined)
    for name in ("ActorWorker", "CriticWorker"):
        monkeypatch.setattr(driver_run, name, Idle)
    cfg = load_config("configs/ppo_tiny.yaml", ["trainer.cpus_per_worker=0.5"])
    with driver_run.start_groups(cfg, load_tokenizer(None, task=cfg.data.task)) as groups:
        assert groups.critic is not None and groups.critic.call("node_info")
    assert events == ["started actor", "started critic", "waited for actor", "waited for critic"]
