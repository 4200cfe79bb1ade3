"""Batches of prompts: a resumable, seeded, endless loader and the collation into token tensors.

Collated prompts are left-padded to ``data.max_prompt_length`` so responses start at the
same column in every row (the layout of ``verlite.step_batch``).
"""

from __future__ import annotations

import random
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import TypedDict, TypeVar

import torch
from tensordict import TensorDict
from transformers import PreTrainedTokenizerBase

from verlite.data.files import DataError, PromptRecord
from verlite.data.tokenizer import encode_prompts, response_text

STATE_KEYS = ("epoch", "position", "seed")


def check_fills_a_batch(num_prompts: int, batch_size: int, *, source: str = "") -> None:
    """The training prompts (``source``: where they come from, for the message) hold at
    least one batch: each epoch drops the remainder."""
    if num_prompts < batch_size:
        raise DataError(
            f"{num_prompts} training prompts{source} are fewer than one batch of "
            f"data.train_batch_size={batch_size}"
        )


class PromptLoader:
    """Endless batches of ``batch_size`` records, epoch after epoch.

    Each epoch visits the records in an order shuffled from ``(seed, epoch)`` (file order
    with ``shuffle=False``) and drops the last ``len(dataset) % batch_size`` of them, so every
    step has the same number of prompts. The state is ``(epoch, position, seed)``, with
    ``position`` the batches already taken in the epoch: a loader that loads a state yields
    exactly the batches the saved one would have.
    """

    def __init__(
        self,
        dataset: Sequence[PromptRecord],
        batch_size: int,
        *,
        seed: int,
        shuffle: bool = True,
    ) -> None:
        check_fills_a_batch(len(dataset), batch_size)
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self._seed = seed
        self._epoch = 0
        self._position = 0
        self._order: tuple[int, list[int]] | None = None  # (epoch, record order) cache

    @property
    def batches_per_epoch(self) -> int:
        return len(self.dataset) // self.batch_size

    @property
    def epoch(self) -> int:
        """The epoch of the batch most recently taken (0 before the first)."""
        return self._epoch

    def __iter__(self) -> Iterator[list[PromptRecord]]:
        return self

    def __next__(self) -> list[PromptRecord]:
        if self._position == self.batches_per_epoch:
            self._epoch += 1
            self._position = 0
        start = self._position * self.batch_size
        self._position += 1
        return [self.dataset[i] for i in self._epoch_order()[start : start + self.batch_size]]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._epoch, "position": self._position, "seed": self._seed}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Continue from a saved state (its seed wins, so the resumed order is the saved run's)."""
        missing = [key for key in STATE_KEYS if key not in state]
        if missing:
            raise ValueError(f"loader state lacks {', '.join(missing)}; got keys {sorted(state)}")
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= self.batches_per_epoch:
            raise ValueError(
                f"loader state epoch={epoch}, position={position} does not fit this dataset "
                f"({self.batches_per_epoch} batches of {self.batch_size} per epoch)"
            )
        self._epoch, self._position, self._seed = epoch, position, int(state["seed"])
        self._order = None

    def _epoch_order(self) -> list[int]:
        if self._order is None or self._order[0] != self._epoch:
            order = list(range(len(self.dataset)))
            if self.shuffle:
                random.Random(f"verlite:loader:{self._seed}:{self._epoch}").shuffle(order)
            self._order = (self._epoch, order)
        return self._order[1]


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Each token's position counted over the real tokens (``attention_mask`` 1) of its row,
    from 0; 0 on pads. The one rule for every sequence verlite builds: prompts collated here,
    multi-turn rows, the audit's batch."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0) * attention_mask


class PromptBatch(TypedDict):
    input_ids: torch.Tensor  # (B, P) long, left-padded with the pad id
    attention_mask: torch.Tensor  # (B, P) long, 1 on real tokens
    position_ids: torch.Tensor  # (B, P) long, 0.. over real tokens, 0 on pads
    prompts: list[str]
    answers: list[str]


def collate_prompts(
    records: Sequence[PromptRecord],
    tokenizer: PreTrainedTokenizerBase,
    max_prompt_length: int,
    *,
    bos: bool = True,
) -> PromptBatch:
    """Token tensors of a batch of prompts, each BOS + prompt (``bos``: see
    :func:`encode_prompts`), left-padded to ``max_prompt_length``.

    A longer prompt keeps its last ``max_prompt_length`` tokens: datasets have already applied
    ``data.prompt_overflow``, so only prompts it allows to be truncated get here.
    """
    if not records:
        raise ValueError("cannot collate an empty batch of prompts")
    pad = tokenizer.pad_token_id
    if pad is None:
        raise ValueError("the tokenizer has no pad token; load it with load_tokenizer()")
    prompts = [r["prompt"] for r in records]
    kept = [ids[-max_prompt_length:] for ids in encode_prompts(tokenizer, prompts, bos=bos)]
    # The padded rows built as lists and made tensors once: a tensor and two writes per row
    # took the driver twice as long (64 prompts: 1.6 ms against 0.8 ms, median, 2 cores).
    pads = [max_prompt_length - len(ids) for ids in kept]
    input_ids = torch.tensor(
        [[pad] * n + ids for n, ids in zip(pads, kept, strict=True)], dtype=torch.long
    )
    attention_mask = torch.tensor(
        [[0] * n + [1] * (max_prompt_length - n) for n in pads], dtype=torch.long
    )
    return PromptBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids(attention_mask),
        prompts=prompts,
        answers=[r["answer"] for r in records],
    )


def prompt_tensordict(
    records: Sequence[PromptRecord],
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_prompt_length: int,
    repeat: int,
    temperature: float,
    bos: bool = True,
) -> TensorDict:
    """The prompts of one rollout in the step batch's layout (``verlite.step_batch``): each
    prompt repeated ``repeat`` times in a row, the copies sharing one ``uid``, and the
    sampling ``temperature`` the log-probs of the responses must use. ``bos``: see
    :func:`encode_prompts`."""
    collated = collate_prompts(records, tokenizer, max_prompt_length, bos=bos)
    td = TensorDict(
        {
            "input_ids": collated["input_ids"],
            "attention_mask": collated["attention_mask"],
            "position_ids": collated["position_ids"],
            "uid": torch.arange(len(records)),
        },
        batch_size=[len(records)],
    )
    td = td.repeat_interleave(repeat, dim=0) if repeat > 1 else td
    td.set_non_tensor("temperature", temperature)
    return td


Record = TypeVar("Record")


def row_records(records: Sequence[Record], uid: torch.Tensor) -> list[Record]:
    """The record each row of a step batch answers. ``records`` are the step's prompts as
    :func:`prompt_tensordict` got them (one per prompt, before the ``rollout.n`` repeats),
    or what a worker needs of each (a reward model's conversations), so a row's ``uid`` is
    its record's index: every consumer of records (the scoring on the driver, the
    environments and the reward model in the workers, on any share of the rows) goes
    through here."""
    return [records[i] for i in uid.tolist()]


def response_texts(
    tokenizer: PreTrainedTokenizerBase, batch: TensorDict, *, stops: Collection[int]
) -> list[str]:
    """What a reward reads of each row of a step batch: its response as
    :func:`~verlite.data.tokenizer.response_text` of its ``response_mask``'s tokens (ended by
    EOS or one of ``stops``, ``models.generation_ends.response_stop_ids``)."""
    lengths = batch["response_mask"].sum(-1).tolist()
    return [
        response_text(tokenizer, row[:n], stops)
        for row, n in zip(batch["responses"].tolist(), lengths, strict=True)
    ]
