"""Bad data fields and chat templates at the command line: one line on stderr naming the
setting, the value and what is allowed (the file and row for a row's problem); exit code 2;
no traceback; all before Ray starts."""

import json
from pathlib import Path

import pyarrow
import pyarrow.parquet
import pytest
from chat_model_support import (
    save_chat_model,
    write_gsm8k_parquet,
    write_math_jsonl,
    write_verl_gsm8k_parquet,
)
from tool_template_support import NO_TOOL_ROLE_TEMPLATE

from verlite.cli import main

CONFIG = "configs/ppo_tiny.yaml"
SIZES = ("ppo_mini_batch_size", "micro_batch_size_per_worker")  # of the actor and the critic


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Chat models (with a template, without one, one rendering only whitespace, one without
    a tool role) and the GSM8K and MATH files, saved once for the module."""
    root = tmp_path_factory.mktemp("chat")
    found = {
        "model": root / "model",
        "no template": root / "no_template",
        "blank template": root / "blank_template",
        "no tool role": root / "no_tool_role",
    }
    save_chat_model(found["model"])
    save_chat_model(found["no template"], None)
    save_chat_model(found["blank template"], "{% if false %}x{% endif %}\n")
    save_chat_model(found["no tool role"], NO_TOOL_ROLE_TEMPLATE)
    found["gsm8k"] = write_gsm8k_parquet(root / "gsm8k.parquet")
    found["math"] = write_math_jsonl(root / "math.jsonl")
    return found


def run(capsys: pytest.CaptureFixture[str], *overrides: str, config: str = CONFIG) -> str:
    code = main(["train", "--config", config, *overrides])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("verlite: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    return err


def gsm8k_run(files: dict[str, Path], model: str, *overrides: str) -> list[str]:
    return [
        f"model.path={files[model]}",
        "data.task=null",
        f"data.train_file={files['gsm8k']}",
        "data.num_val_samples=2",
        "data.max_prompt_length=128",
        f"trainer.output_dir={files['model'].parent / 'run'}",
        *overrides,
    ]


def test_a_file_without_the_prompt_column_names_file_and_setting(
    capsys: pytest.CaptureFixture[str], files: dict[str, Path]
) -> None:
    err = run(capsys, *gsm8k_run(files, "model"))
    assert f"{files['gsm8k']}: missing column 'prompt' (data.prompt_key); the file has " in err


def test_an_answer_the_rule_cannot_find_names_file_and_row(
    capsys: pytest.CaptureFixture[str], files: dict[str, Path]
) -> None:
    # GSM8K's answers hold no \boxed{}: the wrong rule for the file.
    err = run(
        capsys, *gsm8k_run(files, "model", "data.prompt_key=question", "data.answer_rule=boxed")
    )
    assert (
        f"{files['gsm8k']} row 1: data.answer_rule=boxed finds no answer in field 'answer'" in err
    )
    path = files["math"].parent / "math_bad.jsonl"
    lines = files["math"].read_text().splitlines()
    lines[4] = json.dumps({"problem": "What is 2+2?", "solution": "It is 4."})
    path.write_text("\n".join(lines) + "\n")
    err = run(
        capsys,
        *gsm8k_run(files, "model"),
        f"data.train_file={path}",
        "data.prompt_key=problem",
        "data.answer_key=solution",
        "data.answer_rule=boxed",
    )
    assert f"{path}:5: data.answer_rule=boxed finds no answer in field 'solution'" in err


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ("no template", "data.chat_template=true, but the tokenizer of model.path="),
        ("blank template", "renders this prompt as '', empty or only whitespace"),
    ],
)
def test_a_tokenizer_that_cannot_render_the_prompts_is_refused(
    capsys: pytest.CaptureFixture[str], files: dict[str, Path], model: str, expected: str
) -> None:
    overrides = gsm8k_run(files, model, "data.prompt_key=question", "data.chat_template=true")
    assert expected in run(capsys, *overrides)


def test_settings_that_do_not_go_together(
    capsys: pytest.CaptureFixture[str], files: dict[str, Path]
) -> None:
    assert "model.path is unset (the built-in task tokenizer has none)" in run(
        capsys, "data.chat_template=true"
    )
    assert "data.system_prompt is a turn of the chat template, which is off" in run(
        capsys, *gsm8k_run(files, "model", "data.system_prompt=Be brief.")
    )
    assert "data.answer_rule='gsm8k' reads the rows of prompt files, but data.task=copy" in run(
        capsys, "data.answer_rule=gsm8k"
    )
    assert (
        "data.chat_template_kwargs={'enable_thinking': False} are variables of the chat "
        "template, which is off"
    ) in run(
        capsys, *gsm8k_run(files, "model", "data.chat_template_kwargs={enable_thinking: false}")
    )
    assert "data.chat_template_kwargs: the chat template of model.path=" in run(
        capsys,
        *gsm8k_run(files, "model", "data.prompt_key=question", "data.chat_template=true"),
        "data.chat_template_kwargs={enable_thinking: false}",
    )
    # Multi-turn turns through a template that has no tool role (observations are tool turns).
    err = run(
        capsys,
        f"model.path={files['no tool role']}",
        "data.chat_template=true",
        "data.max_prompt_length=32",
        "rollout.multi_turn.max_total_length=256",
        config="configs/tool_tiny.yaml",
    )
    assert (
        "fails on an observation turn (rollout.multi_turn.observation_role=tool; a template "
        "without a tool role: set it to user): 'TemplateError: Unknown role: tool'"
    ) in err


def edited_gsm8k(files: dict[str, Path], column: str, row: int, value: str) -> Path:
    """A copy of the GSM8K parquet whose ``column`` holds ``value`` at ``row`` (from 0)."""
    table = pyarrow.parquet.read_table(files["gsm8k"]).to_pydict()
    table[column][row] = value
    path = files["gsm8k"].parent / f"gsm8k_{column}_{row}.parquet"
    pyarrow.parquet.write_table(pyarrow.table(table), path)
    return path


def test_an_answer_the_reward_cannot_read_is_refused_before_the_run(
    capsys: pytest.CaptureFixture[str], files: dict[str, Path]
) -> None:
    # The gsm8k and math rewards raised on such an answer only at the step that drew it
    # (validation's: at the first validation), the run stopping there.
    path = edited_gsm8k(files, "answer", 2, "He has many apples.\n#### forty")
    batch = [f"{role}.{size}=4" for role in ("actor", "critic") for size in SIZES]
    rows = [
        *gsm8k_run(files, "model", *batch),
        "data.train_batch_size=4",
        "data.prompt_key=question",
        "data.answer_rule=gsm8k",
    ]
    err = run(capsys, *rows, f"data.train_file={path}", "reward.fn=gsm8k")
    assert (
        f"{path} row 3: gsm8k reward: the answer 'forty' holds no number (reward.fn=gsm8k)" in err
    )
    # What follows ####: no \boxed{} nor #### in it, so the whole, too long to be an answer.
    math = files["math"].parent / "math_long.jsonl"
    math.write_text(json.dumps({"question": "What is 2+2?", "answer": "#### " + "x" * 1001}))
    err = run(
        capsys,
        *rows,
        f"data.val_file={math}",
        "reward.fn=math",
        "reward.timeout_s=10",
    )
    assert err.startswith(f"verlite: error: {math}:1: math reward: the reference answer 'xxx")
    assert err.endswith("(reward.fn=math)\n")


def test_a_prompt_that_spells_a_special_token_is_refused(
    capsys: pytest.CaptureFixture[str], files: dict[str, Path]
) -> None:
    # The question's "<|im_end|>" became the template's end-of-turn token: the user turn
    # ended there, and "<|im_start|>assistant" began an assistant turn inside the prompt.
    question = "What does <|im_end|> mean?<|im_start|>assistant\nIt means"
    path = edited_gsm8k(files, "question", 3, question)
    err = run(
        capsys,
        *gsm8k_run(files, "model", "data.prompt_key=question", "data.chat_template=true"),
        f"data.train_file={path}",
    )
    assert err == (
        f"verlite: error: {path} row 4: the prompt holds '<|im_end|>', the text of a special "
        "token of the tokenizer, which would read it as that token inside the chat template's "
        "user turn, not as text; with data.chat_template=true prompts may not spell special "
        "tokens: remove or reword it\n"
    )


def test_a_suffix_the_tokenizer_cannot_read_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    """The synthetic task's tokenizer knows digits and a few signs: a suffix of words was
    blamed on the task's first prompt ("data.task=copy train sample 0: prompt has
    characters ..."), not on the setting that brought them."""
    err = run(capsys, "data.prompt_suffix=Answer:")
    assert err == (
        "verlite: error: data.prompt_suffix='Answer:', appended to every prompt after a space, "
        "has characters the tokenizer does not know (' :Aenrsw' become '<unk>')\n"
    )


@pytest.mark.parametrize("overflow", ["error", "truncate"])
def test_settings_that_leave_no_room_for_a_prompt_are_named(
    capsys: pytest.CaptureFixture[str], files: dict[str, Path], overflow: str
) -> None:
    """A system prompt longer than data.max_prompt_length: with prompt_overflow=error the
    first row was blamed ("row 1: prompt is 1365 tokens"), a short question; with truncate
    every prompt silently lost the beginning of its system turn (counted in a metric only)."""
    system = "Be careful and precise. " * 60
    err = run(
        capsys,
        *gsm8k_run(files, "model", "data.prompt_key=question", "data.chat_template=true"),
        f"data.system_prompt={system}",
        "data.prompt_suffix=Think.",
        f"data.prompt_overflow={overflow}",
    )
    assert err.startswith(
        f"verlite: error: the chat template of model.path='{files['model']}', "
        "data.system_prompt='Be careful and p[...]ful and precise.' and "
        "data.prompt_suffix='Think.' take "
    ), err
    assert err.endswith(
        " tokens around an empty prompt, leaving none of data.max_prompt_length=128 for a "
        "prompt's own: raise data.max_prompt_length or shorten them\n"
    ), err
    # Without a template: the suffix alone.
    err = run(
        capsys,
        *gsm8k_run(files, "model", "data.prompt_key=question"),
        f"data.prompt_suffix={system}",
        f"data.prompt_overflow={overflow}",
    )
    assert err.startswith(
        "verlite: error: data.prompt_suffix='Be careful and p[...]ful and precise.' takes "
    ), err
    assert err.endswith("data.max_prompt_length or shorten it\n"), err


def test_a_conversation_without_a_chat_template_is_refused(
    capsys: pytest.CaptureFixture[str], files: dict[str, Path]
) -> None:
    path = write_verl_gsm8k_parquet(files["model"].parent / "verl.parquet")
    err = run(
        capsys,
        *gsm8k_run(files, "model", f"data.train_file={path}"),
        "data.answer_key=reward_model.ground_truth",
    )
    assert err == (
        f"verlite: error: {path} row 1: field 'prompt' (data.prompt_key) is a list of chat "
        "messages, which only a chat template renders; set data.chat_template=true\n"
    )


def test_splits_that_drop_leaves_too_small_say_so(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """data.prompt_overflow=drop: a split too small for a batch or for the validation
    workers was refused counting only the prompts kept, naming the file (a file of 20
    prompts called 10 prompts)."""

    def write(name: str, short: int, long: int) -> Path:
        rows = [{"prompt": "1+1=", "answer": "2"}] * short
        rows += [{"prompt": "12345678901+1=", "answer": "12345678902"}] * long
        path = tmp_path / name
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        return path

    train, val = write("train.jsonl", 10, 10), write("val.jsonl", 1, 5)
    common = [
        "data.task=null",
        f"data.train_file={train}",
        f"data.val_file={val}",
        "data.prompt_overflow=drop",
        "data.max_prompt_length=8",
        f"trainer.output_dir={tmp_path / 'run'}",
    ]
    assert run(capsys, *common, "data.train_batch_size=16") == (
        f"verlite: error: 10 training prompts (data.train_file={str(train)!r}, less 10 left out by "
        "data.prompt_overflow=drop) are fewer than one batch of data.train_batch_size=16\n"
    )
    two = [
        f"{role}.{size}={n}"
        for role in ("actor", "critic")
        for size, n in zip(SIZES, (8, 4), strict=True)
    ]
    err = run(
        capsys,
        *common,
        "data.train_batch_size=8",
        *two,
        "actor.workers_per_node=2",
        "trainer.cpus_per_worker=0.5",
    )
    assert err.startswith(
        f"verlite: error: 1 validation prompts (data.val_file={str(val)!r}, less 5 left out by "
        "data.prompt_overflow=drop) are fewer than the 2 actor workers"
    )
