"""Prompt files: JSONL and Parquet reading, and every error naming the file and line."""

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from verlite.data import DataError, read_prompt_file
from verlite.errors import MissingExtraError, shown


def _jsonl(path: Path, *lines: str) -> Path:
    path.write_text("".join(f"{line}\n" for line in lines))
    return path


def test_reads_records_and_locations(tmp_path: Path) -> None:
    path = _jsonl(
        tmp_path / "p.jsonl",
        json.dumps({"prompt": "1+1=", "answer": "2", "id": 7}),
        "",
        json.dumps({"prompt": "copy 12=", "answer": "12"}),
    )
    records, where = read_prompt_file(path)
    assert records == [{"prompt": "1+1=", "answer": "2"}, {"prompt": "copy 12=", "answer": "12"}]
    assert where == [f"{path}:1", f"{path}:3"]  # blank lines skipped, line numbers kept


def test_an_integer_answer_is_read_as_its_digits(tmp_path: Path) -> None:
    # AIME-style files store the answer as a number; a big one stays exact.
    path = _jsonl(
        tmp_path / "p.jsonl",
        '{"prompt": "q", "answer": 72}',
        '{"prompt": "r", "answer": -12345678901234567890}',
    )
    assert read_prompt_file(path)[0] == [
        {"prompt": "q", "answer": "72"},
        {"prompt": "r", "answer": "-12345678901234567890"},
    ]


def test_line_numbers_ignore_unicode_line_separators(tmp_path: Path) -> None:
    # U+2028 is valid unescaped inside a JSON string; it must not count as a line break.
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a\u2028b", "answer": "x"}\n{"prompt": 3, "answer": "y"}\n')
    with pytest.raises(
        DataError, match=re.escape(f"{path}:2: field 'prompt' (data.prompt_key) must be a string")
    ):
        read_prompt_file(path)


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (['{"prompt": "a", "answer": "b"}', '{"prompt": "a", '], r":2: malformed JSON"),
        (['{"prompt": "a", "answer": "b"}', '["a", "b"]'], r":2: expected an object .* got list"),
        (['{"answer": "b"}'], r":1: missing field 'prompt'"),
        (['{"prompt": "a"}'], r":1: missing field 'answer'"),
        (
            ['{"prompt": "a", "answer": 42.0}'],
            r":1: field 'answer' \(data.answer_key\) must be a string or an integer, got "
            r"float 42.0; store answers as text or integers$",
        ),
        (
            ['{"prompt": "a", "answer": true}'],
            r":1: field 'answer' \(data.answer_key\) must be a string or an integer, got bool True$",
        ),
        (
            ['{"prompt": 3, "answer": "3"}'],
            r":1: field 'prompt' \(data.prompt_key\) must be a string or a list of chat messages "
            r"\(\[\{\"role\": \"user\", \"content\": \.\.\.\}\]\), got int 3$",
        ),
        (
            ['{"prompt": null, "answer": "1"}'],
            r":1: field 'prompt' \(data.prompt_key\) must be a string or a list .*, got null$",
        ),
        (['{"prompt": [], "answer": "1"}'], r":1: field 'prompt' .* got list \[\]$"),
        # verl's format, its conversations malformed.
        (
            ['{"prompt": ["1+1="], "answer": "2"}'],
            r":1: message 1 of field 'prompt' \(data.prompt_key\) must be an object, got str",
        ),
        (
            ['{"prompt": [{"role": "user", "content": "a"}, {"content": "b"}], "answer": "2"}'],
            r":1: message 2 of field 'prompt' \(data.prompt_key\) needs a non-empty string "
            r"'role', got null$",
        ),
        (
            ['{"prompt": [{"role": "user", "content": ["a"]}], "answer": "2"}'],
            r":1: message 1 .* needs a string 'content', got list \['a'\]$",
        ),
        (
            ['{"prompt": [{"role": "user", "content": "a", "tool_calls": [1]}], "answer": "2"}'],
            r":1: message 1 .* has \['tool_calls'\], which verlite does not render; a message "
            r"holds a role and its content$",
        ),
        (
            [
                '{"prompt": [{"role": "user", "content": "1+1="}, '
                '{"role": "assistant", "content": "2"}], "answer": "2"}'
            ],
            r":1: field 'prompt' \(data.prompt_key\) ends with an assistant turn",
        ),
        (
            [
                '{"prompt": [{"role": "system", "content": ""}, {"role": "user", "content": " "}], '
                '"answer": "2"}'
            ],
            r":1: the prompt is empty \(every message's content is blank\)$",
        ),
        (
            [
                '{"prompt": [{"role": "system", "content": "b"}, {"role": "user", '
                '"content": "a\\ud800"}], "answer": "2"}'
            ],
            r":1: the content of message 2 of field 'prompt' \(data.prompt_key\) holds "
            r"'\\ud800' at character 1, half of a UTF-16 surrogate pair",
        ),
        # The role is written into the template's text too (it raised a TypeError there).
        (
            ['{"prompt": [{"role": "\\ud800", "content": "a"}], "answer": "2"}'],
            r":1: the role of message 1 of field 'prompt' \(data.prompt_key\) holds "
            r"'\\ud800' at character 0, half of a UTF-16 surrogate pair",
        ),
        (
            ['{"prompt": "1+1=", "answer": [{"role": "user", "content": "2"}]}'],
            r":1: field 'answer' \(data.answer_key\) must be a string or an integer, got list "
            r"\[\{'role'",
        ),
        (
            ['{"prompt": "a", "answer": "b"}', '{"prompt": " ", "answer": "1"}'],
            r":2: the prompt is empty",
        ),
        (
            ['{"prompt": "a", "answer": "b"}', '{"prompt": "1", "prompt": "2", "answer": "1"}'],
            r":2: field 'prompt' is set twice",
        ),
        (['{"prompt": "1", "answer": "1", "x": {"k": 1, "k": 2}}'], r":1: field 'k' is set twice"),
        # Valid JSON that json.loads raises a RecursionError or a bare ValueError on.
        (
            ['{"prompt": "1", "answer": "1", "x": ' + "[" * 100_000 + "]" * 100_000 + "}"],
            r":1: JSON nests too deeply to read",
        ),
        (
            ['{"prompt": "1", "answer": "1", "x": ' + "7" * 5000 + "}"],
            r":1: JSON holds an integer of more than 4,300 digits",
        ),
        # Half a surrogate pair: valid JSON, no text (the tokenizer raised a TypeError on it).
        (
            ['{"prompt": "1", "answer": "1"}', '{"prompt": "a\\ud800b", "answer": "1"}'],
            r":2: field 'prompt' holds '\\ud800' at character 1, half of a UTF-16 surrogate",
        ),
    ],
)
def test_errors_name_file_and_line(tmp_path: Path, lines: list[str], message: str) -> None:
    path = _jsonl(tmp_path / "bad.jsonl", *lines)
    with pytest.raises(DataError, match=message) as exc:
        read_prompt_file(path)
    assert str(exc.value).startswith(str(path))


def test_missing_file_and_unknown_format(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"cannot read prompt file .*nope.jsonl': No such file"):
        read_prompt_file(tmp_path / "nope.jsonl")
    (tmp_path / "p.csv").write_text("prompt,answer\n")
    with pytest.raises(DataError) as exc:
        read_prompt_file(tmp_path / "p.csv")
    assert str(exc.value) == (
        f"data.train_file={shown(str(tmp_path / 'p.csv'))}: unknown prompt file format '.csv'; "
        "give a .jsonl or .parquet file"
    )


@pytest.mark.parametrize("lines", [[], ["", "  "]])
def test_a_file_without_prompts_is_named_by_its_setting(tmp_path: Path, lines: list[str]) -> None:
    path = _jsonl(tmp_path / "empty.jsonl", *lines)
    with pytest.raises(DataError) as exc:
        read_prompt_file(path, setting="data.val_file")
    assert str(exc.value) == f"data.val_file={shown(str(path))}: no prompts (the file is empty)"


def test_a_byte_order_mark_and_windows_line_ends_are_no_content(tmp_path: Path) -> None:
    # The mark made line 1 malformed JSON ("Unexpected UTF-8 BOM (decode using utf-8-sig)").
    path = tmp_path / "p.jsonl"
    path.write_bytes(
        b'\xef\xbb\xbf{"prompt": "1+1=", "answer": "2"}\r\n\r\n{"prompt": "3=", "answer": "3"}\r\n'
    )
    records, where = read_prompt_file(path)
    assert records == [{"prompt": "1+1=", "answer": "2"}, {"prompt": "3=", "answer": "3"}]
    assert where == [f"{path}:1", f"{path}:3"]


def test_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"prompt": "\xff", "answer": "1"}\n')
    with pytest.raises(
        DataError,
        match=r"prompt file .*p.jsonl' is not UTF-8 text \(byte 0xff at offset 12, line 1\)",
    ):
        read_prompt_file(path)


def test_parquet_without_pyarrow_names_the_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # makes `import pyarrow` fail
    path = tmp_path / "p.parquet"
    path.write_bytes(b"")
    # verlite's extra and its pin, as every optional package's message names them
    with pytest.raises(
        MissingExtraError,
        match=r"p.parquet: reading Parquet files needs the 'pyarrow' package, which cannot be "
        r"imported \(.*\); install it with: pip install 'pyarrow>=14' \(verlite's 'parquet' extra\)",
    ):
        read_prompt_file(path)


def test_parquet(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["1+1=", "2+2="], "answer": ["2", "4"]}), path)
    records, where = read_prompt_file(path)
    assert records == [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]
    assert where == [f"{path} row 1", f"{path} row 2"]
    # An integer column (AIME's answers) is read as its digits; floats (an int column with a
    # missing value) are refused: 72.0 is not "72" to exact_match.
    pq.write_table(pa.table({"prompt": ["1+1=", "9*8="], "answer": [2, 72]}), path)
    assert read_prompt_file(path)[0] == [
        {"prompt": "1+1=", "answer": "2"},
        {"prompt": "9*8=", "answer": "72"},
    ]
    pq.write_table(
        pa.table({"prompt": ["1+1=", "9*8="], "answer": [2, None]}).cast(
            pa.schema([("prompt", pa.string()), ("answer", pa.float64())])
        ),
        path,
    )
    with pytest.raises(
        DataError,
        match=r"row 1: field 'answer' \(data.answer_key\) must be a string or an integer, got "
        r"float 2.0; store answers as text or integers$",
    ):
        read_prompt_file(path)
    path.write_bytes(b"not parquet")
    with pytest.raises(DataError, match=r"p.parquet: cannot read Parquet file"):
        read_prompt_file(path)


def test_errors_are_one_line_of_bounded_length(tmp_path: Path) -> None:
    # A column named twice: Arrow's message lists the schema, a line per column. A value
    # of the wrong type: quoted whole, a megabyte of it made the message.
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "p.parquet"
    columns = [pa.array(["1+1="]), pa.array(["2"]), pa.array(["3+3="])]
    pq.write_table(pa.Table.from_arrays(columns, names=["prompt", "answer", "prompt"]), path)
    with pytest.raises(DataError, match=r"p.parquet: cannot read Parquet file: .*prompt") as exc:
        read_prompt_file(path)
    assert "\n" not in str(exc.value)
    jsonl = _jsonl(tmp_path / "p.jsonl", json.dumps({"prompt": "1", "answer": list(range(10**5))}))
    with pytest.raises(
        DataError,
        match=r":1: field 'answer' \(data.answer_key\) must be a string or an integer, got list "
        r"\[0, 1,",
    ) as exc:
        read_prompt_file(jsonl)
    assert len(str(exc.value)) < len(str(jsonl)) + 170


def _parquet(path: Path, columns: dict[str, list[Any]]) -> Path:
    pa = pytest.importorskip("pyarrow")
    pytest.importorskip("pyarrow.parquet").write_table(pa.table(columns), path)
    return path


@pytest.fixture
def columns_read(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The columns of each table ``pyarrow.parquet.read_table`` reads, as it reads them."""
    pq = pytest.importorskip("pyarrow.parquet")
    read: list[list[str]] = []
    read_table = pq.read_table

    def recording(*args: object, **kwargs: object) -> object:
        result = read_table(*args, **kwargs)
        read.append(result.column_names)
        return result

    monkeypatch.setattr(pq, "read_table", recording)
    return read


def test_parquet_reads_only_the_configured_columns(
    tmp_path: Path, columns_read: list[list[str]]
) -> None:
    # A dataset's parquet with a column the run never uses (an image per row, 4 MiB in all):
    # the table read holds the prompt and answer columns alone, the records unchanged.
    images = [bytes([i]) * 2**20 for i in range(4)]
    table = {"question": ["1+1=", "2+2=", "3+3=", "4+4="], "image": images}
    path = _parquet(tmp_path / "p.parquet", {**table, "answer": ["2", "4", "6", "8"]})
    records, where = read_prompt_file(path, prompt_key="question")
    assert columns_read == [["question", "answer"]]
    assert records == [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(1, 5)]
    assert where == [f"{path} row {i}" for i in range(1, 5)]
    with pytest.raises(DataError) as exc:
        read_prompt_file(path, answer_key="solution")
    assert str(exc.value) == (
        f"{path}: missing column 'prompt' (data.prompt_key); the file has "
        "['answer', 'image', 'question']"
    )


def test_a_conversation_prompt_is_read_as_its_messages(tmp_path: Path) -> None:
    # verl's files store the prompt as chat messages; the chat template renders them later.
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1="}]
    path = _jsonl(tmp_path / "p.jsonl", json.dumps({"prompt": messages, "answer": "2"}))
    assert read_prompt_file(path)[0] == [{"prompt": tuple(messages), "answer": "2"}]


def verl_gsm8k_rows(n: int) -> dict[str, list[object]]:
    """Rows as verl's GSM8K preprocessing writes them: a conversation, and the answer inside
    ``reward_model``."""
    return {
        "data_source": ["openai/gsm8k"] * n,
        "prompt": [[{"role": "user", "content": f"{i}+{i}="}] for i in range(n)],
        "ability": ["math"] * n,
        "reward_model": [{"style": "rule", "ground_truth": str(2 * i)} for i in range(n)],
        "extra_info": [{"split": "train", "index": i} for i in range(n)],
    }


def test_a_dotted_answer_key_reads_a_field_inside_a_field(
    tmp_path: Path, columns_read: list[list[str]]
) -> None:
    path = _parquet(tmp_path / "verl.parquet", verl_gsm8k_rows(3))
    records, _ = read_prompt_file(path, answer_key="reward_model.ground_truth")
    assert columns_read == [["prompt", "reward_model"]]  # the columns the two keys are in, alone
    assert records == [
        {"prompt": ({"role": "user", "content": f"{i}+{i}="},), "answer": str(2 * i)}
        for i in range(3)
    ]
    # The same rows as JSONL; a field whose own name has a dot is read by that name.
    rows = [
        dict(zip(verl_gsm8k_rows(3), row, strict=True))
        for row in zip(*verl_gsm8k_rows(3).values(), strict=True)
    ]
    rows[1]["reward_model.ground_truth"] = "99"
    jsonl = _jsonl(tmp_path / "verl.jsonl", *map(json.dumps, rows))
    answers = [
        r["answer"] for r in read_prompt_file(jsonl, answer_key="reward_model.ground_truth")[0]
    ]
    assert answers == ["0", "99", "4"]


@pytest.mark.parametrize(
    ("key", "message"),
    [
        (
            "reward_model.answer",
            "missing field 'reward_model.answer' (data.answer_key); its field 'reward_model' "
            "has ['ground_truth', 'style']",
        ),
        (
            "reward_model.ground_truth.value",
            "missing field 'reward_model.ground_truth.value' (data.answer_key); its field "
            "'reward_model.ground_truth' has no fields (str '0')",
        ),
        (
            "solution.text",
            "missing field 'solution.text' (data.answer_key); the row has ['ability', "
            "'data_source', 'extra_info', 'prompt', 'reward_model']",
        ),
    ],
)
def test_a_dotted_key_that_finds_no_field_says_where_it_stopped(
    tmp_path: Path, key: str, message: str
) -> None:
    rows = verl_gsm8k_rows(1)
    path = _jsonl(tmp_path / "p.jsonl", json.dumps({k: v[0] for k, v in rows.items()}))
    with pytest.raises(DataError) as exc:
        read_prompt_file(path, answer_key=key)
    assert str(exc.value) == f"{path}:1: {message}"


def test_a_dotted_prompt_key_reads_a_field_inside_a_field(tmp_path: Path) -> None:
    # Both keys inside one struct column: it is read once, each key's field taken from it.
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "nested.parquet"
    rows = [{"question": "1+1=", "answer": 2}, {"question": "2+2=", "answer": 4}]
    pq.write_table(pa.table({"extra_info": rows}), path)
    records, _ = read_prompt_file(
        path, prompt_key="extra_info.question", answer_key="extra_info.answer"
    )
    assert records == [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]
