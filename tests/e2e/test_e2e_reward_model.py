"""A whole run scored by a reward model (``reward.model.path``) and the rule-based reward
together (``reward.combine``), on the shared Ray: the reward group is placed with the others,
each step's score, and validation's, is the weighted sum of the sources' scores it logs. And
`verlite train` of a chat policy scored by a reward model that reads its own chat template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from chat_model_support import chat_gsm8k_overrides, save_chat_model, write_gsm8k_parquet
from reward_model_support import chat_reward_tokenizer, save_tiny_reward_model

from verlite.config import load_config
from verlite.driver.preflight import RunInputs
from verlite.driver.run import run

WEIGHTS = {"fn": 0.25, "model": 0.75}


@pytest.fixture(scope="module")
def scored_run(tmp_path_factory: pytest.TempPathFactory, shared_ray) -> Path:
    shared_ray.ensure()
    root = tmp_path_factory.mktemp("rm_run")
    rm = save_tiny_reward_model(root / "rm")
    out = root / "run"
    cfg = load_config(
        "configs/grpo_tiny.yaml",
        [
            f"trainer.output_dir={out}",
            "trainer.cpus_per_worker=0.5",
            "data.train_batch_size=4",
            "actor.ppo_mini_batch_size=32",
            "trainer.total_steps=1",
            "trainer.val_freq=1",
            "data.num_val_samples=8",
            "trainer.loggers=[jsonl]",
            f"reward.model.path={rm}",
            "reward.model.micro_batch_size_per_worker=8",
            f"reward.combine={json.dumps(WEIGHTS)}",
        ],
    )
    run(cfg, RunInputs.load(cfg))
    return out


def test_each_step_and_validation_score_the_weighted_sum_of_the_sources(
    scored_run: Path,
) -> None:
    records = [json.loads(line) for line in (scored_run / "metrics.jsonl").read_text().splitlines()]
    (record,) = records
    for prefix, score in (("", "critic/score/mean"), ("val/", "val/score/mean")):
        fn, model = (record[f"{prefix}reward/{s}/mean"] for s in ("fn", "model"))
        assert 0.0 < model < 1.0 and 0.0 <= fn <= 1.0
        assert record[score] == pytest.approx(
            WEIGHTS["fn"] * fn + WEIGHTS["model"] * model, abs=1e-6
        )
    assert record["reward/model/truncated"] == 0
    # The reward-model ranks' peak memory (the process's peak RSS on CPU), for the step's
    # scoring and for validation's.
    assert record["perf/max_memory_allocated_gb/reward_model"] > 0
    assert record["val/perf/max_memory_allocated_gb/reward_model"] > 0
    placement = json.loads((scored_run / "workers.json").read_text())
    assert sorted(w["role"] for w in placement) == ["actor", "reward"]


def test_verlite_train_scores_a_chat_policy_with_a_reward_model_in_its_own_template(
    tmp_path: Path, cli
) -> None:
    """A chat policy trained through its template (a system prompt, a suffix) on a GSM8K
    file, scored by a reward model whose tokenizer has a chat template of its own (auto: it
    reads the conversations in it, start-up says so), for two steps and a validation: each
    step's prompts' conversations reach the reward workers beside the batch. (That the text
    is the template's: tests/workers/test_reward_model_worker.py.) Mutation: the scorer
    sending no conversations: the run fails at the first scoring."""
    save_chat_model(tmp_path / "policy")
    rm = save_tiny_reward_model(
        tmp_path / "rm", tokenizer=chat_reward_tokenizer(), max_positions=256
    )
    parquet = write_gsm8k_parquet(tmp_path / "gsm8k.parquet")
    out = tmp_path / "run"
    proc = cli(
        "train",
        "--config",
        "configs/grpo_tiny.yaml",
        f"trainer.output_dir={out}",
        *chat_gsm8k_overrides(
            tmp_path / "policy",
            parquet,
            system="You are a careful tutor.",
            suffix="Answer with a number.",
        ),
        "data.train_batch_size=4",
        "rollout.max_response_length=8",
        "rollout.n=2",
        "actor.ppo_mini_batch_size=8",
        "actor.micro_batch_size_per_worker=8",
        "trainer.total_steps=2",
        "trainer.val_freq=2",
        "trainer.loggers=[jsonl]",
        f"reward.model.path={rm}",
    )
    assert proc.returncode == 0, proc.stderr
    assert "reward.model.chat_template=auto: the reward model's tokenizer has a chat" in proc.stdout
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert 0.0 < record["reward/model/mean"] < 1.0
        # The score is the reward model's alone (combine {model: 1}), a float32 mean.
        assert record["critic/score/mean"] == pytest.approx(record["reward/model/mean"], abs=1e-6)
        assert record["reward/model/truncated"] == 0
    assert 0.0 < records[-1]["val/reward/model/mean"] < 1.0
