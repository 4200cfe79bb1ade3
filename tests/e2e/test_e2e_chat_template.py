"""A local instruct model and a GSM8K parquet as a practitioner has them: a run through the
chat template (data.chat_template), the file's own fields and GSM8K's answer rule, scored by
the gsm8k reward; and the same problems as verl's preprocessing writes them (a conversation, the
answer in reward_model.ground_truth)."""

from pathlib import Path

import pytest
from chat_model_support import (
    PROBLEMS,
    save_chat_model,
    save_end_of_turn_model,
    write_gsm8k_parquet,
    write_verl_gsm8k_parquet,
)

# Four prompts a step, in one mini-batch of the actor's and the critic's, scored by gsm8k.
SMALL_STEP = (
    "data.train_batch_size=4",
    "reward.fn=gsm8k",
    "actor.ppo_mini_batch_size=4",
    "actor.micro_batch_size_per_worker=4",
    "critic.ppo_mini_batch_size=4",
    "critic.micro_batch_size_per_worker=4",
)


def on_file(model: Path, path: Path) -> tuple[str, ...]:
    """The overrides of a run of ``model`` on the prompt file ``path`` (validation: the same)."""
    return (
        f"model.path={model}",
        "data.task=null",
        f"data.train_file={path}",
        f"data.val_file={path}",
    )


def test_a_gsm8k_parquet_trains_a_chat_model_through_its_template(
    tmp_path: Path, train, metrics
) -> None:
    save_chat_model(tmp_path / "model")
    path = write_gsm8k_parquet(tmp_path / "gsm8k.parquet")
    train(
        tmp_path / "run",
        *on_file(tmp_path / "model", path),
        "data.prompt_key=question",
        "data.answer_rule=gsm8k",
        "data.chat_template=true",
        "data.system_prompt=You are a careful tutor.",
        "data.prompt_suffix=Put the final answer after ####.",
        "data.max_prompt_length=128",
        *SMALL_STEP,
        "trainer.total_steps=2",
        "trainer.val_freq=2",
    )
    records = metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2]
    assert all(0 <= r["critic/score/mean"] <= 1 for r in records)
    assert "actor/pg_loss" in records[-1]
    assert any(key.startswith("val") for key in records[-1])
    # Responses without a number after a "####" score 0 and are counted, training's and
    # validation's: a step's own (4 responses), validation's of each held-out prompt once.
    assert all(r["reward/gsm8k/no_answer"] in range(4 + 1) for r in records)
    assert records[-1]["val/reward/gsm8k/no_answer"] in range(len(PROBLEMS) + 1)


def test_a_verl_format_parquet_trains_as_verl_wrote_it(tmp_path: Path, train, metrics) -> None:
    """verl's preprocessed GSM8K as it is: the prompt a conversation (a system turn and the
    user's), the answer in reward_model.ground_truth."""
    save_chat_model(tmp_path / "model")
    path = write_verl_gsm8k_parquet(tmp_path / "verl.parquet", system="You are a careful tutor.")
    train(
        tmp_path / "run",
        *on_file(tmp_path / "model", path),
        "data.answer_key=reward_model.ground_truth",
        "data.chat_template=true",
        "data.max_prompt_length=256",
        *SMALL_STEP,
        "trainer.total_steps=1",
        "trainer.val_freq=1",
    )
    [record] = metrics(tmp_path / "run")
    assert 0 <= record["critic/score/mean"] <= 1 and "actor/pg_loss" in record
    assert record["val/reward/gsm8k/no_answer"] in range(len(PROBLEMS) + 1)


def test_a_models_own_end_of_turn_ends_its_responses(
    tmp_path: Path, train, metrics, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gemma-2-it's tokenizer's EOS is <eos>, and its turns end with <end_of_turn>, which its
    generation_config.json names as an end of generation too (Phi-3's <|end|> likewise):
    a response ends there, as Hugging Face generate and vLLM end it, and a reward reads its
    text without it, as without EOS. The model here writes <end_of_turn> first: every
    response is that one token, the empty text. Mutations: the sampler's stop tokens
    rollout.stop_token_ids alone (each response ran to rollout.max_response_length);
    the scorer's response text ended by EOS alone (the reward read '<end_of_turn>')."""
    save_end_of_turn_model(tmp_path / "model")
    (tmp_path / "emptyreward.py").write_text(
        "def score(response, answer, prompt):\n    return float(response == '')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    train(
        tmp_path / "run",
        *on_file(tmp_path / "model", write_gsm8k_parquet(tmp_path / "gsm8k.parquet")),
        "data.prompt_key=question",
        "data.answer_rule=gsm8k",
        "data.chat_template=true",
        "data.max_prompt_length=128",
        *SMALL_STEP,
        "reward.fn=emptyreward:score",
        "rollout.max_response_length=8",
        "trainer.total_steps=1",
        "trainer.val_freq=1",
    )
    [record] = metrics(tmp_path / "run")
    assert record["response_length/max"] == 1
    assert record["critic/score/mean"] == 1 and record["val/score/mean"] == 1
