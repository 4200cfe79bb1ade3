"""The memory settings in a whole run on Ray: activation checkpointing for both roles, the
actor's optimizer state and reference offloaded, the critic under FSDP2's CPU offload at one
worker (sharded over a group of its own) — the same run, metric for metric, as without them.
Three steps: the third's losses are the first to follow an update made with moved optimizer
state."""

from pathlib import Path

SHORT = [
    "trainer.total_steps=3",
    "data.train_batch_size=8",
    "actor.ppo_mini_batch_size=8",
    "critic.ppo_mini_batch_size=8",
    "data.num_val_samples=8",
    "actor.use_kl_loss=true",
    "critic.strategy=fsdp",
    "actor.micro_batch_size_per_worker=4",
    "critic.micro_batch_size_per_worker=4",
]
MEMORY = [
    "actor.gradient_checkpointing=true",
    "critic.gradient_checkpointing=true",
    "actor.offload=optimizer",
    "critic.offload=all",
]


def test_a_run_with_the_memory_settings_is_the_same_run(tmp_path: Path, train, metrics) -> None:
    train(tmp_path / "plain", *SHORT)
    train(tmp_path / "memory", *SHORT, *MEMORY)
    plain = metrics(tmp_path / "plain", stable_only=True)
    memory = metrics(tmp_path / "memory", stable_only=True)
    assert [r["step"] for r in plain] == [1, 2, 3]
    assert "actor/kl_loss" in plain[-1] and "critic/vf_loss" in plain[-1]
    assert memory == plain
