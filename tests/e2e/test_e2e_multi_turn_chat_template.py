"""A multi-turn run through a chat template, through `verlite train` (its code in this process,
on the shared Ray; test_e2e_multi_turn.py runs the command in a process and a Ray of its own):
a tiny random Qwen2 saved with ``save_pretrained`` beside a tokenizer whose template has
Qwen2.5's tool turns, ``data.chat_template=true`` and an environment
(tests/user_code/chat_tool_env.py) whose every observation is written as the template's tool
turn after the policy's."""

from pathlib import Path

from chat_model_support import save_chat_model
from chat_tool_env import OBSERVATION
from tool_template_support import QWEN_TOOL_TEMPLATE

from verlite.config import load_config
from verlite.data.templates import turn_format


def test_a_chat_model_trains_on_trajectories_written_in_its_template(
    tmp_path: Path, local_ray, verlite_main, metrics
) -> None:
    tokenizer = save_chat_model(tmp_path / "model", QWEN_TOOL_TEMPLATE)
    overrides = [
        f"model.path={tmp_path / 'model'}",
        "data.chat_template=true",
        "data.max_prompt_length=32",
        "data.train_batch_size=4",
        "data.num_val_samples=4",
        "rollout.n=4",
        "rollout.multi_turn.env=chat_tool_env:Talkative",
        "rollout.multi_turn.max_total_length=160",
        "actor.ppo_mini_batch_size=16",
        "actor.micro_batch_size_per_worker=16",
        "trainer.total_steps=2",
        "trainer.val_freq=2",
        "trainer.cpus_per_worker=0.5",
        "trainer.loggers=[jsonl]",
        f"trainer.output_dir={tmp_path / 'run'}",
    ]
    proc = verlite_main("train", "--config", "configs/tool_tiny.yaml", *overrides)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2]
    # Each observation the run appended is the template's: the end of the assistant's turn
    # (no turn ended with it: its <|im_end|> is the EOS, which ends the trajectory), the tool
    # turn around the observation and the next generation prompt.
    turns = turn_format(load_config("configs/tool_tiny.yaml", overrides), tokenizer)
    assert turns is not None
    per_call = len(turns.end_ids) + len(
        tokenizer.encode(turns.observation_text(OBSERVATION), add_special_tokens=False)
    )
    assert per_call > 10 * len(tokenizer.encode(OBSERVATION, add_special_tokens=False))
    for record in records:
        assert record["multiturn/tool_calls/mean"] > 0
        assert record["multiturn/tool_errors"] == 0
        assert (
            abs(
                record["multiturn/observation_tokens/mean"]
                - per_call * record["multiturn/tool_calls/mean"]
            )
            < 1e-6
        )
    assert "actor/pg_loss" in records[-1]
    assert any(key.startswith("val") for key in records[-1])
