"""Prompt files in the forms practitioners have them: the fields read (data.prompt_key,
data.answer_key) and the answer taken by a rule (data.answer_rule), with every row that
gives no answer an error naming its file and row."""

import json
import re
import typing
from pathlib import Path

import pytest
from chat_model_support import PROBLEMS, chat_tokenizer, write_gsm8k_parquet, write_math_jsonl

from verlite.config import DataConfig, load_config
from verlite.data import DataError, build_datasets, read_prompt_file
from verlite.data.answers import ANSWER_RULES, gsm8k_answer, last_boxed


def test_every_configurable_rule_exists() -> None:
    allowed = typing.get_args(DataConfig.model_fields["answer_rule"].annotation)
    assert set(allowed) == set(ANSWER_RULES)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("72", None),
        ("So 8 * 9 = 72.\n#### 72", "72"),
        ("#### 1,234,567 ", "1234567"),
        ("a #### 3\nb #### -4.5", "-4.5"),  # the last mark
        ("#### ", None),
        ("####", None),
    ],
)
def test_gsm8k_answer(text: str, expected: str | None) -> None:
    assert gsm8k_answer(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("$x = \\boxed{72}$", "72"),
        ("\\boxed{\\frac{1}{2}} so", "\\frac{1}{2}"),  # nested braces balanced
        ("first \\boxed{1}, then \\boxed{ {2}^{3} }", "{2}^{3}"),  # the last, stripped
        ("\\boxed{\\text{(A)}}", "\\text{(A)}"),
        ("no box here: 72", None),
        ("\\boxed{\\frac{1}{2}", None),  # never closed
        ("\\boxed{1} and \\boxed{2", None),  # the last one is not closed
        ("\\boxed{ }", None),
        ("\\boxed 7", None),
    ],
)
def test_last_boxed(text: str, expected: str | None) -> None:
    assert last_boxed(text) == expected


def test_gsm8k_parquet_by_its_own_fields(tmp_path: Path) -> None:
    path = write_gsm8k_parquet(tmp_path / "gsm8k.parquet")
    records, where = read_prompt_file(path, prompt_key="question", answer_rule="gsm8k")
    assert [r["prompt"] for r in records] == [q for q, _, _ in PROBLEMS]
    assert records[0]["answer"] == "72" and records[2]["answer"] == "1234"  # "#### 1,234"
    assert where[1] == f"{path} row 2"


def test_math_jsonl_by_its_own_fields(tmp_path: Path) -> None:
    path = write_math_jsonl(tmp_path / "math.jsonl")
    records, _ = read_prompt_file(
        path, prompt_key="problem", answer_key="solution", answer_rule="boxed"
    )
    assert records[0] == {"prompt": PROBLEMS[0][0], "answer": "72"}


def test_the_default_fields_read_the_whole_answer(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "answer": " #### 2 "}) + "\n")
    assert read_prompt_file(path)[0] == [{"prompt": "1+1=", "answer": " #### 2 "}]


def test_a_missing_field_names_its_setting_and_the_rows_fields(tmp_path: Path) -> None:
    path = write_gsm8k_parquet(tmp_path / "gsm8k.parquet")
    with pytest.raises(
        DataError,
        match=re.escape(
            f"{path}: missing column 'prompt' (data.prompt_key); the file has ['answer', 'question']"
        ),
    ):
        read_prompt_file(path)
    with pytest.raises(DataError, match=re.escape("missing column 'solution' (data.answer_key)")):
        read_prompt_file(path, prompt_key="question", answer_key="solution")


@pytest.mark.parametrize(
    ("rule", "answer", "wanted"),
    [
        ("gsm8k", "He has 72 apples.", "text after a last '####'"),
        ("boxed", "$\\boxed{72$", "a closed, non-empty \\boxed{...}"),
    ],
)
def test_a_row_the_rule_finds_no_answer_in_is_named(
    tmp_path: Path, rule: str, answer: str, wanted: str
) -> None:
    path = tmp_path / "p.jsonl"
    good = json.dumps({"question": "q", "answer": "#### 1 \\boxed{1}"})
    path.write_text(f"{good}\n{good}\n{json.dumps({'question': 'q', 'answer': answer})}\n")
    with pytest.raises(DataError) as exc:
        read_prompt_file(path, prompt_key="question", answer_rule=rule)
    assert str(exc.value) == (
        f"{path}:3: data.answer_rule={rule} finds no answer in field 'answer' (it needs "
        f"{wanted}): {answer!r}"
    )


def test_a_long_multi_line_answer_is_quoted_on_one_line(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "q", "answer": "step\n" * 500}) + "\n")
    with pytest.raises(DataError) as exc:
        read_prompt_file(path, answer_rule="gsm8k")
    # Bounded whatever the folder's name (pytest's tmp_path is longer under xdist).
    assert "\n" not in str(exc.value) and len(str(exc.value)) < len(str(path)) + 200


def test_the_datasets_read_the_configured_fields(tmp_path: Path) -> None:
    path = write_math_jsonl(tmp_path / "math.jsonl")
    cfg = load_config(
        "configs/ppo_tiny.yaml",
        [
            "data.task=null",
            f"data.train_file={path}",
            f"data.val_file={path}",
            "data.prompt_key=problem",
            "data.answer_key=solution",
            "data.answer_rule=boxed",
            "data.max_prompt_length=128",
        ],
    )
    train, val = build_datasets(cfg, chat_tokenizer())
    expected = [str(a + b) for a, b in [(12, 60), (7, 8), (1200, 34), (5, 5)]]
    assert [r["answer"] for r in train][:4] == expected
    assert len(val) == len(PROBLEMS)


@pytest.mark.parametrize(
    "override", ["data.prompt_key=question", "data.answer_key=solution", "data.answer_rule=gsm8k"]
)
def test_the_row_fields_are_refused_with_a_synthetic_task(override: str) -> None:
    name, value = override.split("=")
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"{name}='{value}' reads the rows of prompt files, but data.task=copy generates its prompts"
        ),
    ):
        load_config("configs/ppo_tiny.yaml", [override])
