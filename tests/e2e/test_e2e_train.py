"""`verlite train` end to end: a subprocess on an embedded local Ray, as a user runs it."""

from pathlib import Path

import pytest

from verlite.config import load_config

STEP_KEYS = {
    "step",
    "critic/score/mean",
    "critic/score/max",
    "critic/score/min",
    "critic/rewards/mean",
    "critic/advantages/mean",
    "critic/returns/mean",
    "response_length/mean",
    "response_length/max",
    "response_length/clip_ratio",
    "actor/pg_loss",
    "actor/entropy",
    "actor/pg_clipfrac",
    "actor/ppo_kl",
    "actor/grad_norm",
    "actor/lr",
    "rollout/logprob_abs_diff",
    "rollout/logprob_max_diff",
    "timing_s/rollout",
    "timing_s/reward",
    "timing_s/adv",
    "timing_s/update_actor",
    "timing_s/train",
    "timing_s/step",
    "perf/throughput",
    "perf/max_memory_allocated_gb/actor",
}
CRITIC_KEYS = {
    "critic/values/mean",
    "critic/vf_explained_var",
    "critic/vf_loss",
    "critic/vf_clipfrac",
    "critic/vpred_mean",
    "critic/grad_norm",
    "timing_s/values",
    "timing_s/update_critic",
    "perf/max_memory_allocated_gb/critic",
}
# The main job's samples (without its critic warm-up) score ~0.05 at first; within
# LEARN_STEPS steps they learn the response length (half the reward): some 5 consecutive
# steps score more than LEARN_MARGIN above the first ten. (Later the entropy bonus briefly unsettles the end of the response
# before the digits are learnt, so the last steps of a short run are not the measure.)
LEARN_STEPS = 50
LEARN_MARGIN = 0.3
SMALL = [
    "data.num_val_samples=8",
    "trainer.val_freq=2",
    "actor.micro_batch_size_per_worker=4",
    "critic.micro_batch_size_per_worker=4",
]


def run(train, metrics, tmp_path: Path, *overrides: str) -> list[dict]:
    train(tmp_path / "run", *SMALL, *overrides)
    return metrics(tmp_path / "run")


@pytest.mark.parametrize(
    "overrides",
    [
        ["algorithm.adv_estimator=grpo", "rollout.n=4", "actor.use_kl_loss=true"],
        [
            "algorithm.adv_estimator=grpo",
            "rollout.n=4",
            "algorithm.norm_adv_by_std=false",
            "actor.loss_agg_mode=seq-mean-token-sum-norm",
        ],
        ["algorithm.adv_estimator=rloo", "rollout.n=4", "actor.policy_loss=gspo"],
        [
            "algorithm.adv_estimator=reinforce_plus_plus",
            "algorithm.use_kl_in_reward=true",
            "algorithm.kl_ctrl.type=adaptive",
        ],
        [
            "algorithm.adv_estimator=reinforce_plus_plus_baseline",
            "rollout.n=2",
            "actor.entropy_coeff=0.01",
            "actor.ppo_epochs=2",
        ],
        [
            "critic.warmup_steps=1",
            "actor.use_dynamic_bsz=true",
            "actor.max_token_len_per_worker=64",
            "actor.strategy=fsdp",
        ],
    ],
    ids=[
        "grpo+kl_loss",
        "dr_grpo",
        "rloo+gspo",
        "reinforce++ kl_in_reward",
        "reinforce++_baseline",
        "ppo warmup fsdp dynamic",
    ],
)
def test_each_algorithm_runs(tmp_path: Path, overrides: list[str], train, metrics) -> None:
    records = run(
        train,
        metrics,
        tmp_path,
        "trainer.total_steps=2",
        "data.train_batch_size=8",
        "actor.ppo_mini_batch_size=8",
        "critic.ppo_mini_batch_size=8",
        *overrides,
    )
    assert [r["step"] for r in records] == [1, 2]
    cfg = load_config(
        "configs/ppo_tiny.yaml",
        [
            *SMALL,
            *overrides,
            "data.train_batch_size=8",
            "actor.ppo_mini_batch_size=8",
            "critic.ppo_mini_batch_size=8",
        ],
    )
    for record in records:
        assert all(isinstance(v, float | int) for v in record.values())
        assert ("critic/vf_loss" in record) == cfg.use_critic
    if cfg.actor.use_kl_loss:
        assert "actor/kl_loss" in records[-1]
    if cfg.algorithm.use_kl_in_reward:
        assert "actor/reward_kl_penalty_coeff" in records[-1]
    if cfg.critic.warmup_steps and cfg.use_critic:
        assert "actor/pg_loss" not in records[0] and "actor/pg_loss" in records[1]
    # Every step's split and the actor's peak memory, the critic's warm-up steps' too.
    for record in records:
        for key in ("timing_s/gen", "timing_s/log_probs", "perf/max_memory_allocated_gb/actor"):
            assert key in record, (record["step"], key)
        # validation (every second step here) is in the step's time, not in its training's
        assert (
            record["timing_s/train"] + record.get("timing_s/validation", 0.0)
            <= (record["timing_s/step"])
        )


def test_train_from_a_hugging_face_directory(tmp_path: Path, train, metrics) -> None:
    from verlite.data import load_tokenizer
    from verlite.models import build_policy

    cfg = load_config("configs/ppo_tiny.yaml")
    tokenizer = load_tokenizer(None, task="copy")
    model = build_policy(cfg.model, vocab_size=len(tokenizer), max_positions=64, seed=3)
    model.save_pretrained(tmp_path / "hf")
    tokenizer.save_pretrained(tmp_path / "hf")
    records = run(
        train,
        metrics,
        tmp_path,
        f"model.path={tmp_path / 'hf'}",
        "trainer.total_steps=2",
        "data.train_batch_size=8",
        "actor.ppo_mini_batch_size=8",
        "critic.ppo_mini_batch_size=8",
    )
    assert len(records) == 2


def test_config_errors_exit_2_before_ray_starts(tmp_path: Path, cli) -> None:
    proc = cli(
        "train", "--config", "configs/ppo_tiny.yaml", "actor.ppo_mini_batch_size=5", timeout=60
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "actor.ppo_mini_batch_size=5" in proc.stderr
    assert "Traceback" not in proc.stderr and "Ray" not in proc.stderr
    proc = cli(
        "train", "--config", "configs/ppo_tiny.yaml", f"model.path={tmp_path / 'nope'}", timeout=60
    )
    assert proc.returncode == 2 and "model.path=" in proc.stderr and "no such file" in proc.stderr


def test_a_short_run_of_the_main_job_learns(tmp_path: Path, train, metrics) -> None:
    """The score of the main job's samples (actor training from step 1) rises within
    LEARN_STEPS steps by a margin that a
    policy pushed the wrong way (the advantage's sign flipped) does not reach: it unlearns
    the response length that the first half of the reward pays for, and the score falls."""
    train(tmp_path / "run", f"trainer.total_steps={LEARN_STEPS}", "trainer.val_freq=0")
    records = metrics(tmp_path / "run")
    scores = [r["critic/score/mean"] for r in records]
    first = sum(scores[:10]) / 10
    best = max(sum(scores[i : i + 5]) / 5 for i in range(len(scores) - 4))
    assert first < 0.2 and best > first + LEARN_MARGIN, (first, best, scores)
    # The trainer's recomputed log-probs are those the tokens were sampled with, to float32
    # rounding, at every step of a policy that changes (same weights, whole distribution).
    for r in records:
        assert r["rollout/logprob_abs_diff"] < 1e-5 and r["rollout/logprob_max_diff"] < 1e-4, r


@pytest.mark.cluster  # 30 s of whole runs: make test-cluster
def test_the_console_holds_the_runs_own_lines_and_no_library_chatter(
    tmp_path: Path, cli, train
) -> None:
    """`verlite train` as a user runs it (its own embedded Ray), over a Hugging Face folder,
    resuming a checkpoint and saving another (the first run is made here, on the shared Ray):
    the console shows the progress and verlite's lines; Hugging Face's progress bars, DCP's
    single-process warning at each save and load and Ray's token-authentication note stay
    off it."""
    from verlite.data import load_tokenizer
    from verlite.models import build_policy

    tokenizer = load_tokenizer(None, task="copy")
    model = build_policy(
        load_config("configs/ppo_tiny.yaml").model,
        vocab_size=len(tokenizer),
        max_positions=64,
        seed=3,
    )
    model.save_pretrained(tmp_path / "hf")
    tokenizer.save_pretrained(tmp_path / "hf")
    out = tmp_path / "run"
    args = [
        "train",
        "--config",
        "configs/ppo_tiny.yaml",
        f"model.path={tmp_path / 'hf'}",
        f"trainer.output_dir={out}",
        "critic.warmup_steps=0",
        "trainer.val_freq=0",
        "trainer.save_freq=1",
        "data.train_batch_size=8",
        "actor.ppo_mini_batch_size=8",
        "critic.ppo_mini_batch_size=8",
        "actor.micro_batch_size_per_worker=8",
        "critic.micro_batch_size_per_worker=8",
    ]
    train(out, *args[3:], "trainer.total_steps=2")
    resumed = cli(*args, "trainer.total_steps=3")
    assert resumed.returncode == 0, resumed.stderr
    console = resumed.stdout + resumed.stderr
    for chatter in (
        "Loading weights",
        "Writing model shards",
        "torch.distributed is disabled",
        "Warning",
        "Token authentication",
        "WARNING",
    ):
        assert chatter not in console, console
    for own in (
        "placed 2 workers in 1 bundle on 1 node",
        f"resumed from {out / 'checkpoints' / 'step_2'} at step 2",
        "step 3/3 |",
        f"saved {out / 'checkpoints' / 'step_3'} in ",
    ):
        assert own in console, console
