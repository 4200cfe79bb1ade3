"""Prompt datasets: a synthetic task or prompt files, split into train and validation, each
prompt formatted as the policy reads it (``data.prompt_suffix``, ``data.chat_template``) and
the prompt-length policy (``data.prompt_overflow``) applied once, where errors can name the
prompt."""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Literal, overload

from transformers import PreTrainedTokenizerBase

from verlite.config import Config
from verlite.data.files import (
    DataError,
    PromptRecord,
    SourceRecord,
    conversation_of,
    read_prompt_file,
)
from verlite.data.tasks import TASKS
from verlite.data.templates import check_room, format_prompts
from verlite.data.tokenizer import encode_prompts, special_tokens, unknown_characters
from verlite.errors import shown


@dataclass(frozen=True)
class PromptDataset(Sequence[PromptRecord]):
    """The prompt records of one split.

    ``num_truncated`` counts prompts longer than ``data.max_prompt_length`` that batches keep
    only the last tokens of (``data.prompt_overflow=truncate``), ``num_dropped`` those left
    out (``drop``; None under another policy), for the trainer to log; ``where`` says where
    each record comes from (``file:line``, or the task's sample), for the checks that name one.
    """

    records: tuple[PromptRecord, ...]
    name: str
    where: tuple[str, ...]
    num_truncated: int = 0
    num_dropped: int | None = None

    def __len__(self) -> int:
        return len(self.records)

    def length_metrics(self, prefix: str) -> dict[str, float]:
        """The split's prompt-length counts as metrics under ``prefix``: ``data/truncated_prompts``,
        and ``data/dropped_prompts`` where the policy drops prompts."""
        counts = {"truncated_prompts": self.num_truncated, "dropped_prompts": self.num_dropped}
        return {f"{prefix}data/{k}": float(v) for k, v in counts.items() if v is not None}

    def dropped_line(self, max_prompt_length: int) -> str | None:
        """With ``data.prompt_overflow=drop``, the start-up line that counts the prompts left out
        of this split; None where none were."""
        if not self.num_dropped:
            return None
        total = len(self) + self.num_dropped
        return (
            f"data.prompt_overflow=drop: {self.num_dropped:,} of {total:,} {self.name} prompts are "
            f"longer than data.max_prompt_length={max_prompt_length} tokens and left out"
        )

    def dropped_note(self) -> str:
        """For a message that counts the split's prompts: those ``drop`` left out, or nothing."""
        return (
            f", less {self.num_dropped:,} left out by data.prompt_overflow=drop"
            if self.num_dropped
            else ""
        )

    @cached_property
    def fingerprint(self) -> dict[str, int | str]:
        """The record count and a SHA-256 of the records in order: what a checkpoint's data
        position indexes (a changed prompt file would silently continue another order)."""
        digest = hashlib.sha256()
        for record in self.records:
            # The prompt and answer alone: a record's messages are what its prompt was
            # rendered from, and checkpoints written before records held them still match.
            pair = {"prompt": record["prompt"], "answer": record["answer"]}
            digest.update(json.dumps(pair, sort_keys=True).encode() + b"\n")
        return {"records": len(self.records), "sha256": digest.hexdigest()}

    @overload
    def __getitem__(self, index: int) -> PromptRecord: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[PromptRecord, ...]: ...
    def __getitem__(self, index: int | slice) -> PromptRecord | tuple[PromptRecord, ...]:
        return self.records[index]


def build_datasets(
    cfg: Config, tokenizer: PreTrainedTokenizerBase
) -> tuple[PromptDataset, PromptDataset]:
    """The (train, validation) datasets of ``cfg.data``, generated from ``cfg.trainer.seed``."""
    data, seed = cfg.data, cfg.trainer.seed
    train: Sequence[SourceRecord]
    val: Sequence[SourceRecord]
    if data.task is not None:
        train, val = task_records(
            data.task,
            seed=seed,
            num_train=data.num_train_samples,
            num_val=data.num_val_samples,
            min_digits=data.min_digits,
            max_digits=data.max_digits,
        )
        train_where = [f"data.task={data.task} train sample {i}" for i in range(len(train))]
        val_where = [f"data.task={data.task} validation sample {i}" for i in range(len(val))]
    else:
        assert data.train_file is not None  # DataConfig requires a task or a train file
        fields = {
            "prompt_key": data.prompt_key,
            "answer_key": data.answer_key,
            "answer_rule": data.answer_rule,
        }
        records, where = read_prompt_file(data.train_file, **fields)
        if data.val_file is not None:
            train, train_where = records, where
            val, val_where = read_prompt_file(data.val_file, setting="data.val_file", **fields)
        else:
            train_idx, val_idx = holdout_split(len(records), data.num_val_samples, seed=seed)
            if not train_idx:
                raise DataError(
                    f"data.train_file={shown(data.train_file)}: {len(records)} prompts leave none for training after holding "
                    f"out data.num_val_samples={data.num_val_samples}; lower it or set data.val_file"
                )
            train, train_where = [records[i] for i in train_idx], [where[i] for i in train_idx]
            val, val_where = [records[i] for i in val_idx], [where[i] for i in val_idx]
    return (
        _dataset(train, train_where, "train", tokenizer, cfg),
        _dataset(val, val_where, "validation", tokenizer, cfg),
    )


def task_records(
    task: str, *, seed: int, num_train: int, num_val: int, min_digits: int, max_digits: int
) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """Training and validation records of a synthetic task.

    The two splits come from separate seeded streams, and validation keeps only prompts that
    are in neither the training set nor earlier in validation, so it measures generalization.
    """
    generate = TASKS[task].generate
    train_rng = random.Random(f"verlite:{task}:train:{seed}")
    train = [_pair(*generate(train_rng, min_digits, max_digits)) for _ in range(num_train)]
    seen = {r["prompt"] for r in train}
    val_rng = random.Random(f"verlite:{task}:validation:{seed}")
    val: list[PromptRecord] = []
    attempts = max(1000, 100 * num_val)  # a narrow digit range can run out of unseen prompts
    while len(val) < num_val:
        if attempts == 0:
            raise DataError(
                f"data.task={task} with {min_digits} to {max_digits} digits has too few distinct prompts "
                f"to hold out data.num_val_samples={num_val} unseen in data.num_train_samples={num_train}; "
                "widen data.min_digits..data.max_digits or lower the sample counts"
            )
        attempts -= 1
        prompt, answer = generate(val_rng, min_digits, max_digits)
        if prompt not in seen:
            seen.add(prompt)
            val.append(_pair(prompt, answer))
    return train, val


def holdout_split(num_records: int, num_val: int, *, seed: int) -> tuple[list[int], list[int]]:
    """Indices of (train, validation): validation is the last ``num_val`` of a seeded shuffle;
    train keeps the file order."""
    order = list(range(num_records))
    random.Random(f"verlite:holdout:{seed}").shuffle(order)
    cut = max(num_records - num_val, 0)
    return sorted(order[:cut]), order[cut:]


def check_prompts(
    records: Sequence[PromptRecord],
    where: Sequence[str],
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_prompt_length: int,
    overflow: Literal["truncate", "error", "drop"],
    bos: bool = True,
) -> list[int]:
    """Apply the prompt-length policy; return the indices of the prompts longer than
    ``max_prompt_length``, which batches truncate (``overflow="truncate"``: they keep the last
    tokens, where the question ends) or the dataset leaves out (``"drop"``).

    A prompt is measured as it is batched (BOS included unless ``bos`` is false: see
    :func:`encode_prompts`). ``overflow="error"`` raises on the first one longer than
    ``max_prompt_length``. Prompts with characters the tokenizer maps to its unknown token
    are errors either way: the model could not read them.
    """
    over = []
    added = int(bos and tokenizer.bos_token_id is not None)  # the BOS encode_prompts adds
    unk = tokenizer.unk_token_id
    for index, (location, record, ids) in enumerate(
        zip(
            where,
            records,
            encode_prompts(tokenizer, [r["prompt"] for r in records], bos=bos),
            strict=True,
        )
    ):
        if not ids:
            raise DataError(f"{location}: prompt is empty (and the tokenizer adds no BOS)")
        # More unknown tokens than the text spells out (a chat template writing the unknown
        # token's text as its BOS). The BOS added here is not the prompt's: GPT-2's and
        # GPT-NeoX's tokenizers have one token for BOS, EOS and unknown.
        if unk is not None and ids[added:].count(unk) > record["prompt"].count(tokenizer.unk_token):
            # Each distinct character once: a long prompt has few (one call each took 2.9 s
            # for 200,000 characters).
            unknown = unknown_characters(tokenizer, record["prompt"])
            raise DataError(
                f"{location}: prompt has characters the tokenizer does not know "
                f"({shown(unknown, 80)} become {tokenizer.unk_token!r})"
            )
        if len(ids) <= max_prompt_length:
            continue
        if overflow == "error":
            with_bos = " (BOS included)" if bos and tokenizer.bos_token_id is not None else ""
            raise DataError(
                f"{location}: prompt is {len(ids)} tokens{with_bos}, longer than "
                f"data.max_prompt_length={max_prompt_length}; raise it or set "
                "data.prompt_overflow=truncate or drop"
            )
        over.append(index)
    return over


def check_special_token_text(
    records: Sequence[SourceRecord], where: Sequence[str], tokenizer: PreTrainedTokenizerBase
) -> None:
    """Refuse a prompt that spells a special token of ``tokenizer`` (``<|im_end|>``,
    ``<|im_start|>``, ``<eos>``) where the chat template makes it a turn's content: the
    tokenizer reads that text as the token itself, which silently ends the turn or starts
    another (a question that holds ``<|im_end|>`` leaves the user turn there). Tokenizing
    with special tokens split instead would split the template's own tokens too (it is
    rendered into the same text), and the prompt text that rewards, exports and the length
    policy receive would no longer be what the model reads. Checked on the prompt field as
    the file has it (each message's role and content, of a conversation), before the suffix
    and the template. Without a template the prompt is the model's input as written, markup a
    user rendered ahead included."""
    pattern = _special_token_pattern(tokenizer)
    if pattern is None:
        return
    for location, record in zip(where, records, strict=True):
        for message in conversation_of(record["prompt"]):
            # The template writes a message's role into its text as well as its content.
            for text, place in (
                (message["content"], f"{message['role']} turn"),
                (message["role"], f"role {shown(message['role'], 40)}"),
            ):
                found = pattern.search(text)
                if found is not None:
                    raise DataError(
                        f"{location}: the prompt holds {found.group()!r}, the text of a special "
                        f"token of the tokenizer, which would read it as that token inside the "
                        f"chat template's {place}, not as text; with data.chat_template=true "
                        "prompts may not spell special tokens: remove or reword it"
                    )


def _special_token_pattern(tokenizer: PreTrainedTokenizerBase) -> re.Pattern[str] | None:
    """The texts the tokenizer reads as a special token that the same text split into
    ordinary tokens is not (a pad token set to an ordinary token, such as ``!``, is text),
    longest first; None when there are none."""
    texts = set(tokenizer.all_special_tokens) | set(special_tokens(tokenizer))
    controls = [
        text
        for text in texts
        if text
        and tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        != tokenizer(text, add_special_tokens=False)["input_ids"]
    ]
    if not controls:
        return None
    return re.compile("|".join(map(re.escape, sorted(controls, key=len, reverse=True))))


def _pair(prompt: str, answer: str) -> PromptRecord:
    return PromptRecord(prompt=prompt, answer=answer)


def _dataset(
    records: Sequence[SourceRecord],
    where: Sequence[str],
    name: str,
    tokenizer: PreTrainedTokenizerBase,
    cfg: Config,
) -> PromptDataset:
    data = cfg.data
    if data.chat_template:
        check_special_token_text(records, where, tokenizer)
    formatted = format_prompts(records, where, tokenizer, data, model_path=cfg.model.path)
    check_room(tokenizer, data, model_path=cfg.model.path, bos=cfg.prompt_bos)
    over = check_prompts(
        formatted,
        where,
        tokenizer,
        max_prompt_length=data.max_prompt_length,
        overflow=data.prompt_overflow,
        bos=cfg.prompt_bos,
    )
    if data.prompt_overflow != "drop":
        return PromptDataset(
            tuple(formatted), name=name, num_truncated=len(over), where=tuple(where)
        )
    if len(over) == len(formatted):
        raise DataError(
            f"every {name} prompt ({len(over)}) is longer than data.max_prompt_length="
            f"{data.max_prompt_length} tokens, and data.prompt_overflow=drop leaves them all out; "
            "raise data.max_prompt_length"
        )
    dropped = set(over)
    kept = [i for i in range(len(formatted)) if i not in dropped]
    return PromptDataset(
        tuple(formatted[i] for i in kept),
        name=name,
        num_dropped=len(over),
        where=tuple(where[i] for i in kept),
    )
