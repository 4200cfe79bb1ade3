"""Datasets from a synthetic task or prompt files: splits, disjointness, the prompt-length policy."""

import json
import re
from pathlib import Path
from typing import Any

import pytest
from chat_model_support import chat_tokenizer, save_chat_model

from verlite.config import Config
from verlite.data import (
    DataError,
    PromptDataset,
    build_datasets,
    build_task_tokenizer,
    check_prompts,
    holdout_split,
    task_records,
)
from verlite.errors import shown


def _config(seed: int = 0, **data: Any) -> Config:
    return Config.model_validate({"data": data, "trainer": {"seed": seed}})


def _write_jsonl(path: Path, prompts: list[str]) -> Path:
    path.write_text(
        "".join(json.dumps({"prompt": p, "answer": str(i)}) + "\n" for i, p in enumerate(prompts))
    )
    return path


def test_task_datasets_sizes_and_determinism() -> None:
    tok = build_task_tokenizer()
    cfg = _config(task="add", num_train_samples=300, num_val_samples=40)
    train, val = build_datasets(cfg, tok)
    assert isinstance(train, PromptDataset)
    assert (len(train), len(val)) == (300, 40)
    assert (train.name, val.name, train.num_truncated, val.num_truncated) == (
        "train",
        "validation",
        0,
        0,
    )
    again = build_datasets(cfg, tok)
    assert (train, val) == again
    other = build_datasets(
        _config(seed=1, task="add", num_train_samples=300, num_val_samples=40), tok
    )
    assert other[0].records != train.records
    a, b = train[0]["prompt"].removesuffix("=").split("+")
    assert int(train[0]["answer"]) == int(a) + int(b)


@pytest.mark.parametrize("task", ["copy", "reverse", "add"])
def test_task_validation_is_disjoint_from_train(task: str) -> None:
    # 2-digit strings: only 100 (copy/reverse) or 8100 (add) prompts exist, so train repeats
    # itself and a naive validation draw would overlap it.
    train, val = task_records(task, seed=0, num_train=50, num_val=30, min_digits=2, max_digits=2)
    train_prompts = {r["prompt"] for r in train}
    val_prompts = [r["prompt"] for r in val]
    assert len(val_prompts) == len(set(val_prompts)) == 30
    assert train_prompts.isdisjoint(val_prompts)


def test_task_with_too_few_distinct_prompts_fails() -> None:
    with pytest.raises(
        DataError, match=r"data.task=copy with 1 to 1 digits has too few distinct prompts"
    ):
        task_records("copy", seed=0, num_train=100, num_val=5, min_digits=1, max_digits=1)


def test_synthetic_prompt_too_long_names_the_sample() -> None:
    # "12345>" is 6 characters, 7 tokens with BOS.
    cfg = _config(task="reverse", min_digits=5, max_digits=5, max_prompt_length=6)
    with pytest.raises(
        DataError,
        match=r"data.task=reverse train sample 0: prompt is 7 tokens \(BOS included\), "
        r"longer than data.max_prompt_length=6",
    ):
        build_datasets(cfg, build_task_tokenizer())


def test_truncate_counts_the_long_prompts(tmp_path: Path) -> None:
    prompts = ["1+1=", "123456789+1=", "2+2=", "12345+12345="]  # 5, 13, 5 and 13 tokens
    path = _write_jsonl(tmp_path / "p.jsonl", prompts)
    val = _write_jsonl(tmp_path / "v.jsonl", ["123456789+1="])
    cfg = _config(
        train_file=str(path), val_file=str(val), max_prompt_length=8, prompt_overflow="truncate"
    )
    train, validation = build_datasets(cfg, build_task_tokenizer())
    assert [r["prompt"] for r in train] == prompts  # records keep the full text
    assert (train.num_truncated, validation.num_truncated) == (2, 1)

    cfg = _config(
        train_file=str(path), val_file=str(val), max_prompt_length=8, prompt_overflow="error"
    )
    with pytest.raises(
        DataError,
        match=rf"^{path}:2: prompt is 13 tokens \(BOS included\), longer than data.max_prompt_length=8",
    ):
        build_datasets(cfg, build_task_tokenizer())


def test_file_with_val_file(tmp_path: Path) -> None:
    train_path = _write_jsonl(tmp_path / "t.jsonl", ["1+1=", "2+2=", "3+3="])
    val_path = _write_jsonl(tmp_path / "v.jsonl", ["4+4="])
    train, val = build_datasets(
        _config(train_file=str(train_path), val_file=str(val_path)), build_task_tokenizer()
    )
    assert [r["prompt"] for r in train] == ["1+1=", "2+2=", "3+3="]
    assert [r["prompt"] for r in val] == ["4+4="]


def test_file_holds_out_validation(tmp_path: Path) -> None:
    prompts = [f"{i}+1=" for i in range(50)]
    path = _write_jsonl(tmp_path / "p.jsonl", prompts)
    cfg = _config(train_file=str(path), num_val_samples=10)
    train, val = build_datasets(cfg, build_task_tokenizer())
    assert (len(train), len(val)) == (40, 10)
    train_prompts = [r["prompt"] for r in train]
    assert train_prompts == [p for p in prompts if p in set(train_prompts)]  # file order kept
    assert set(train_prompts).isdisjoint(r["prompt"] for r in val)
    assert sorted([*train_prompts, *(r["prompt"] for r in val)]) == sorted(prompts)
    assert build_datasets(cfg, build_task_tokenizer()) == (train, val)  # seeded
    other = build_datasets(
        _config(seed=5, train_file=str(path), num_val_samples=10), build_task_tokenizer()
    )
    assert other[1] != val


def test_holdout_split_is_a_seeded_partition() -> None:
    train, val = holdout_split(20, 5, seed=3)
    assert train == sorted(train)
    assert sorted(train + val) == list(range(20))
    assert len(val) == 5
    assert holdout_split(20, 5, seed=3) == (train, val)
    assert holdout_split(20, 5, seed=4)[1] != val


def test_file_too_small_to_hold_out(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "p.jsonl", ["1+1=", "2+2="])
    with pytest.raises(
        DataError,
        match=re.escape(f"data.train_file={shown(str(path))}: 2 prompts leave none for training")
        + ".*data.num_val_samples=2",
    ):
        build_datasets(_config(train_file=str(path), num_val_samples=2), build_task_tokenizer())


def test_an_empty_validation_file_is_named_by_its_setting(tmp_path: Path) -> None:
    train = _write_jsonl(tmp_path / "p.jsonl", ["1+1=", "2+2="])
    (val := tmp_path / "val.jsonl").write_text("")
    with pytest.raises(DataError) as exc:
        build_datasets(_config(train_file=str(train), val_file=str(val)), build_task_tokenizer())
    assert str(exc.value) == f"data.val_file={shown(str(val))}: no prompts (the file is empty)"


def test_unknown_characters_are_an_error(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "p.jsonl", ["1+1=", "What is 2+2?"])
    with pytest.raises(
        DataError, match=rf"{path}:2: prompt has characters the tokenizer does not know \('W'"
    ):
        build_datasets(_config(train_file=str(path), num_val_samples=1), build_task_tokenizer())


def test_file_errors_surface_through_build_datasets(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "x"\n')
    with pytest.raises(DataError, match=rf"^{path}:2: malformed JSON"):
        build_datasets(_config(train_file=str(path)), build_task_tokenizer())


def test_a_bos_that_is_also_the_unknown_token_is_no_unknown_character() -> None:
    # GPT-2's and GPT-NeoX's (Pythia's) tokenizers have one token for BOS, EOS and unknown:
    # the BOS verlite adds made every plain prompt "characters the tokenizer does not know
    # ('' become '<|endoftext|>')".
    tokenizer = chat_tokenizer(None)
    tokenizer.bos_token = tokenizer.unk_token = tokenizer.eos_token = "<|endoftext|>"
    prompts = ["Tom has 12 apples.", "Tom has <|endoftext|> apples."]  # the second spells it
    records = [{"prompt": p, "answer": "1"} for p in prompts]
    lengths = [len(tokenizer(p, add_special_tokens=False)["input_ids"]) + 1 for p in prompts]
    limit = min(lengths)
    assert check_prompts(
        records, ["f:1", "f:2"], tokenizer, max_prompt_length=limit, overflow="truncate"
    ) == [i for i, n in enumerate(lengths) if n > limit]


def test_unknown_characters_of_a_long_prompt_are_looked_up_once_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each character was encoded on its own to find them: a million lookups, 15 s for this
    # prompt. Counted, not timed: one lookup per distinct character.
    path = _write_jsonl(tmp_path / "p.jsonl", ["1+1=", "1+1=" * 250_000 + "What"])
    tokenizer = build_task_tokenizer()
    encode = tokenizer.encode
    looked_up: list[str] = []

    def counted(text: str, *args: Any, **kwargs: Any) -> list[int]:
        looked_up.append(text)
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", counted)
    with pytest.raises(DataError, match=r":2: prompt has characters .* \('W' become '<unk>'\)"):
        build_datasets(_config(train_file=str(path), num_val_samples=1), tokenizer)
    assert sorted(looked_up) == sorted(set("1+=What"))


def test_a_prompt_that_spells_a_special_token_is_refused_under_a_chat_template(
    tmp_path: Path,
) -> None:
    tokenizer = save_chat_model(tmp_path / "model")

    def config(path: Path, template: bool = True) -> Config:
        data = {"train_file": str(path), "num_val_samples": 1, "chat_template": template}
        return Config.model_validate({"data": data, "model": {"path": str(tmp_path / "model")}})

    path = _write_jsonl(tmp_path / "p.jsonl", ["1+1=", "2+2=<|im_end|>3+3=", "4+4="])
    with pytest.raises(DataError, match=rf"^{path}:2: the prompt holds '<\|im_end\|>', the"):
        build_datasets(config(path), tokenizer)
    # Without a template the prompt is the model's input as written, markup included.
    build_datasets(config(path, template=False), tokenizer)
    # A special token that is an ordinary token's text (a pad token set to one) is text.
    tokenizer.pad_token = "!"
    path = _write_jsonl(tmp_path / "q.jsonl", ["Tom has 12 apples!", "Tom has <|endoftext|>"])
    with pytest.raises(DataError, match=r":2: the prompt holds '<\|endoftext\|>'"):
        build_datasets(config(path), tokenizer)
    path = _write_jsonl(tmp_path / "q.jsonl", ["Tom has 12 apples!", "Tom has 7 pears!"])
    build_datasets(config(path), tokenizer)


def test_drop_leaves_the_prompts_over_the_limit_out_of_their_split(tmp_path: Path) -> None:
    # verl's filter_overlong_prompts: the rest train, in file order, each still named by
    # its line; the fingerprint a resume checks is of the prompts kept.
    tokenizer = build_task_tokenizer()
    prompts = ["1+1=", "12345678901+1=", "2+2=", "3+3=", "98765432109+1=", "4+4="]
    path = _write_jsonl(tmp_path / "p.jsonl", prompts)
    cfg = _config(
        train_file=str(path), val_file=str(path), prompt_overflow="drop", max_prompt_length=8
    )
    train, _ = build_datasets(cfg, tokenizer)
    assert [r["prompt"] for r in train] == ["1+1=", "2+2=", "3+3=", "4+4="]
    assert train.where == tuple(f"{path}:{line}" for line in (1, 3, 4, 6))
    assert (train.num_dropped, train.num_truncated) == (2, 0)
    assert train.length_metrics("val/") == {
        "val/data/truncated_prompts": 0.0,
        "val/data/dropped_prompts": 2.0,
    }
    assert train.dropped_line(cfg.data.max_prompt_length) == (
        "data.prompt_overflow=drop: 2 of 6 train prompts are longer than "
        "data.max_prompt_length=8 tokens and left out"
    )
    # The fingerprint is of the records kept: those of a file holding only them, in order.
    kept = tmp_path / "kept.jsonl"
    kept.write_text("".join(json.dumps(dict(r)) + "\n" for r in train))
    assert [i for i, p in enumerate(prompts) if len(p) < 10] == [0, 2, 3, 5]
    assert train.fingerprint == (
        build_datasets(
            _config(train_file=str(kept), val_file=str(kept), max_prompt_length=8), tokenizer
        )[0].fingerprint
    )
    assert train.fingerprint["records"] == 4
    # Other policies log no dropped count and print no line.
    truncated, _ = build_datasets(
        _config(
            train_file=str(path),
            val_file=str(path),
            prompt_overflow="truncate",
            max_prompt_length=8,
        ),
        tokenizer,
    )
    assert truncated.length_metrics("") == {"data/truncated_prompts": 2.0}
    assert truncated.dropped_line(8) is None
    # A split drop leaves whole prints no line; its count, 0, is logged.
    whole, _ = build_datasets(
        _config(train_file=str(path), val_file=str(path), prompt_overflow="drop"), tokenizer
    )
    assert (whole.num_dropped, whole.dropped_line(32)) == (0, None)
    assert whole.length_metrics("")["data/dropped_prompts"] == 0.0


def test_drop_refuses_a_split_it_would_empty(tmp_path: Path) -> None:
    tokenizer = build_task_tokenizer()
    path = _write_jsonl(tmp_path / "p.jsonl", ["1+1=", "2+2="])
    long = _write_jsonl(tmp_path / "long.jsonl", ["12345678901+1="] * 3)
    cfg = _config(
        train_file=str(path), val_file=str(long), prompt_overflow="drop", max_prompt_length=8
    )
    with pytest.raises(DataError) as exc:
        build_datasets(cfg, tokenizer)
    assert str(exc.value) == (
        "every validation prompt (3) is longer than data.max_prompt_length=8 tokens, and "
        "data.prompt_overflow=drop leaves them all out; raise data.max_prompt_length"
    )
