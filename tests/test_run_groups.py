"""The worker groups a Trainer is handed are the ones its config runs with
(``RunGroups.check``): a critic, a rollout and a reward model group each exactly when the
config needs one."""

import pytest

from verlite.config import load_config
from verlite.driver.trainer import RunGroups

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
