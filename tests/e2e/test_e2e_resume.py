"""Resume: 6 steps straight equal 3 steps + resume + 3 steps, with two workers per group; the
checkpoint of step 3 lands at the end of an epoch."""

import json
import shutil
from pathlib import Path

import pytest
from wandb_support import wandb_records, wandb_steps

TWO_WORKERS = [
    "trainer.workers_per_node=2",
    "data.num_train_samples=48",  # epochs of 3 batches
    "data.num_val_samples=8",
    "data.train_batch_size=16",
    "actor.ppo_mini_batch_size=8",
    "critic.ppo_mini_batch_size=16",
    "actor.micro_batch_size_per_worker=4",
    "critic.micro_batch_size_per_worker=4",
    "trainer.val_freq=3",
    "trainer.save_freq=3",
]
GRPO = ["algorithm.adv_estimator=grpo", "rollout.n=4", "actor.use_kl_loss=true"]
# DAPO's dynamic sampling draws past the step's own prompts: the checkpoint saves the loader
# past every draw.
DAPO = [
    "algorithm.adv_estimator=grpo",
    "rollout.n=2",
    "data.num_train_samples=96",  # epochs of 6 batches
    "algorithm.dynamic_sampling.enable=true",
    "algorithm.dynamic_sampling.max_draws=2",
]


@pytest.mark.parametrize(
    "algorithm",
    # The PPO case (the slower: two groups) in make test-cluster, which CI runs.
    [
        pytest.param([], id="ppo_critic", marks=pytest.mark.cluster),
        pytest.param(GRPO, id="grpo"),
        pytest.param(DAPO, id="dapo", marks=pytest.mark.cluster),
    ],
)
def test_resume_gives_identical_metrics(
    tmp_path: Path, algorithm: list[str], train, metrics, verlite_main
) -> None:
    train(tmp_path / "straight", *TWO_WORKERS, "trainer.total_steps=6", *algorithm)
    # The resumed run also logs to W&B (offline): it continues the run it started.
    wandb = "trainer.loggers=[console, jsonl, wandb]"
    train(tmp_path / "resumed", *TWO_WORKERS, "trainer.total_steps=3", *algorithm, wandb)
    state = json.loads((tmp_path / "resumed/checkpoints/step_3/trainer_state.json").read_text())
    # the loader past every batch drawn by step 3 (with dynamic sampling: past its last draw)
    straight = metrics(tmp_path / "straight", stable_only=True)
    drawn = sum(int(r.get("dynamic_sampling/draws", 1)) for r in straight[:3])
    epoch_batches = 6 if algorithm is DAPO else 3
    assert state["loader"] == {
        "epoch": (drawn - 1) // epoch_batches,
        "position": (drawn - 1) % epoch_batches + 1,
        "seed": 0,
    }
    assert drawn > 3 if algorithm is DAPO else drawn == 3  # step 3 ends epoch 0 without
    # a crash during a later save leaves a partial folder behind: resume=auto must skip it
    partial = tmp_path / "resumed" / "checkpoints" / "step_5.tmp"
    shutil.copytree(tmp_path / "resumed" / "checkpoints" / "step_3", partial)
    (partial / "trainer_state.json").unlink()
    train(tmp_path / "resumed", *TWO_WORKERS, "trainer.total_steps=6", *algorithm, wandb)
    resumed = metrics(tmp_path / "resumed", stable_only=True)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    assert resumed == straight
    compared = verlite_main("compare", tmp_path / "straight", tmp_path / "resumed")
    assert compared.returncode == 0 and " are identical to 0 over 6 steps " in compared.stdout
    assert not partial.exists()  # the next save cleaned it up
    assert sorted(p.name for p in (tmp_path / "resumed" / "checkpoints").iterdir()) == [
        "step_3",
        "step_6",
    ]
    assert (tmp_path / "resumed" / "hf_actor" / "model.safetensors").is_file()
    run_id = (tmp_path / "resumed" / "wandb_run_id").read_text().strip()
    logged = {}
    for run_dir in (tmp_path / "resumed" / "wandb").glob("offline-run-*"):
        (run,) = [value for kind, value in wandb_records(run_dir) if kind == "run"]
        assert run.run_id == run_id
        for record in wandb_steps(run_dir):
            logged[record.pop("step")] = record
    assert sorted(logged) == [1, 2, 3, 4, 5, 6]
    assert logged[5]["actor/pg_loss"] == pytest.approx(resumed[4]["actor/pg_loss"])


@pytest.mark.cluster  # a whole run and its resume: make test-cluster
def test_a_resume_trains_with_the_settings_it_changed(tmp_path: Path, train, metrics) -> None:
    """A resume reports the settings it changes and trains with them: the optimizer's (its
    saved state held the old peak lr) and a fixed in-reward KL coefficient (the checkpoint's
    was set over it)."""
    small = [
        "algorithm.adv_estimator=grpo",
        "rollout.n=2",
        "algorithm.use_kl_in_reward=true",
        "trainer.save_freq=1",
        "trainer.val_freq=0",
        "trainer.export=false",
    ]
    train(tmp_path, *small, "trainer.total_steps=1")
    changed = ["algorithm.kl_ctrl.kl_coef=0.0125", "actor.optim.lr=0.0003"]
    train(tmp_path, *small, "trainer.total_steps=2", *changed)
    first, resumed = metrics(tmp_path)
    assert first["actor/lr"] != 0.0003 and first["actor/reward_kl_penalty_coeff"] != 0.0125
    assert resumed["actor/lr"] == 0.0003
    assert resumed["actor/reward_kl_penalty_coeff"] == 0.0125


@pytest.mark.cluster  # a whole run and its resume: make test-cluster
def test_checkpoints_in_the_critics_warm_up_change_nothing(tmp_path: Path, train, metrics) -> None:
    """The actor's optimizer has not stepped when a checkpoint of the critic's warm-up is
    written: the zero step DCP gives it to have state to save made the actor's first update
    AdamW's second, so save_freq=1 logged other actor metrics from step 2 on."""
    short = ["critic.warmup_steps=1", "trainer.total_steps=3", "trainer.export=false"]
    train(tmp_path / "never", *short, "trainer.save_freq=0")
    train(tmp_path / "every", *short, "trainer.save_freq=1")
    never = metrics(tmp_path / "never", stable_only=True)
    assert metrics(tmp_path / "every", stable_only=True) == never


@pytest.mark.cluster  # whole runs and their resume: make test-cluster
def test_a_run_stopped_while_it_exported_resumes_to_export_its_policy(
    tmp_path: Path, train, metrics, capsys: pytest.CaptureFixture[str]
) -> None:
    """Killed after its last checkpoint, while it wrote hf_actor: the run again resumes from
    that checkpoint to export alone (it was refused, "already reached trainer.total_steps",
    and no command exported the checkpoint), the export replaces the part written, and the
    record keeps its steps once each. The run done, a run again is refused as before."""
    from transformers import AutoModelForCausalLM

    from verlite.errors import UserError

    run = ["algorithm.adv_estimator=grpo", "rollout.n=2", "trainer.total_steps=2"]
    run += ["trainer.save_freq=2", "trainer.val_freq=0"]
    train(tmp_path, *run)
    whole = (tmp_path / "hf_actor" / "model.safetensors").read_bytes()
    recorded = metrics(tmp_path)
    (tmp_path / "hf_actor" / "model.safetensors").unlink()  # as a kill mid-export leaves it
    (tmp_path / "hf_actor.incomplete").write_text("")
    (tmp_path / "hf_actor_merged").mkdir()  # as verlite export --merge left it
    capsys.readouterr()
    train(tmp_path, *run)
    said = capsys.readouterr().out
    assert "reached trainer.total_steps=2 but its policy export (hf_actor) is incomplete" in said
    assert "replacing " in said and "(an earlier step's or an interrupted export)" in said
    assert "hf_actor_merged holds an earlier policy, merged; run verlite export --merge" in said
    assert not (tmp_path / "hf_actor.incomplete").exists()
    assert (tmp_path / "hf_actor" / "model.safetensors").read_bytes() == whole
    AutoModelForCausalLM.from_pretrained(tmp_path / "hf_actor")
    assert metrics(tmp_path) == recorded
    with pytest.raises(UserError, match=r"already reached trainer\.total_steps=2"):
        train(tmp_path, *run)
