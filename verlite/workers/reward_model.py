"""The reward-model worker (role ``reward``): scores its share of a step's responses with a
sequence-classification model (``verlite.models.reward_model``); frozen, no optimizer, no
checkpoint, no collectives.

A row reaches it as the policy's token ids; it reads them as text with the policy's
tokenizer (the prompt without its special tokens, the response as a reward function reads
it, ``data.response_text``, decoded after the prompt: :func:`reward_texts`) and tokenizes
that text again with the reward model's own tokenizer, whose vocabulary may differ. A
reward model that reads its chat template (``reward.model.chat_template``) reads instead the
conversation of the row's prompt, which comes beside the batch, one per prompt, and the
response as the assistant's turn, as its template writes them (:func:`chat_texts`).
Either way the response is the policy's writing: a special token's text in it is read as its
characters (:func:`encode_texts`), so that it cannot end the assistant's turn and write
another one for the reward model to read.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from tensordict import TensorDict

from verlite.config import Config, RewardModelConfig
from verlite.controller import Worker
from verlite.data import (
    continuation_text,
    load_reward_tokenizer,
    load_tokenizer,
    response_texts,
    row_records,
)
from verlite.data.files import Conversation
from verlite.data.templates import common_start, reads_chat_template, reward_chat_text
from verlite.data.tokenizer import encode_written, holds_special_text, with_special_tokens
from verlite.models import model_dtype, worker_device
from verlite.models.generation_ends import response_stop_ids
from verlite.models.hf import HFModel
from verlite.models.precision import autocast, store_for_inference
from verlite.models.reward_model import (
    load_reward_model,
    score_head,
    score_texts,
    token_limit,
)
from verlite.workers.peak_memory import PeakMemory, with_peak

# The step batch's columns a reward-model worker reads (``Trainer`` sends only these): the
# uid finds a row's prompt conversation.
REWARD_INPUT_KEYS = ("input_ids", "attention_mask", "responses", "response_mask", "uid")


class RewardModelWorker(Worker):
    """One rank of the reward group; the model is loaded by ``init_model``."""

    def __init__(self, *, cfg: Config, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.cfg = cfg

    def init_model(self) -> None:
        cfg = self.cfg
        rm = cfg.reward.model
        assert rm.path is not None  # the group exists only with a reward model
        self.device = worker_device(cfg)
        self.peak_memory = PeakMemory(self.device)
        self.policy_tokenizer = load_tokenizer(cfg.model.path, task=cfg.data.task)
        self.stops = response_stop_ids(cfg, self.policy_tokenizer)
        self.tokenizer = load_reward_tokenizer(rm.path)
        model = load_reward_model(rm, model_dtype(cfg.model))
        # The score head stays as loaded: its output is the score (``score_texts``).
        stored = store_for_inference(model, cfg.precision, keep=[score_head(model)])
        # transformers wraps PreTrainedModel.to with functools.wraps, whose type is no method:
        # mypy binds no self and reads the device as the module. It returns the model moved.
        self.model: HFModel = stored.to(self.device)  # type: ignore[arg-type]
        self.max_length = token_limit(rm, self.model.config)
        self.reads_chat_template = reads_chat_template(rm, self.tokenizer)

    def init_distributed(self, master_addr: str, master_port: int) -> None:
        """Reward ranks share no collectives: no process group to join."""

    def score(self, td: TensorDict, conversations: list[Conversation] | None = None) -> TensorDict:
        """Each row's score in [0, 1] (``rm_score``) and whether its text was cut to
        ``reward.model.max_length`` (``rm_truncated``), in the order of the rows, and this
        rank's peak memory over the call (``PEAK_COLUMN``). ``conversations``: the step's
        prompts' (a row's by its uid), sent to a reward model that reads them in its chat
        template."""
        self.peak_memory.begin()
        if self.reads_chat_template:
            assert conversations is not None
            texts = chat_texts(
                self.policy_tokenizer,
                self.tokenizer,
                td,
                conversations,
                rm=self.cfg.reward.model,
                stops=self.stops,
            )
        else:
            texts = reward_texts(self.policy_tokenizer, self.tokenizer, td, stops=self.stops)
        # A template writes the model's special tokens itself (apply_chat_template's own
        # tokenization adds none either): a BOS added again would be read twice.
        inputs = encode_texts(
            self.tokenizer, texts, max_length=self.max_length, special=not self.reads_chat_template
        )
        micro = self.cfg.reward.model.micro_batch_size_per_worker
        with autocast(self.cfg.precision, self.device):
            parts = [
                score_texts(self.model, inputs.ids[start : start + micro], self.device).cpu()
                for start in range(0, len(inputs.ids), micro)
            ]
        rows = len(inputs.ids)
        scored = TensorDict(
            {
                "rm_score": torch.cat(parts) if parts else torch.zeros(0),
                "rm_truncated": torch.tensor(inputs.truncated, dtype=torch.bool),
            },
            batch_size=[rows],
        )
        return with_peak(scored, self.peak_memory)


class RewardText(NamedTuple):
    """A row as the reward model reads it: its ``text``, and where the policy's response is
    in it (start, stop) when the response holds a special token's text of the reward
    model's tokenizer (None when it holds none)."""

    text: str
    response: tuple[int, int] | None


def reward_texts(
    policy_tokenizer: Any, tokenizer: Any, td: TensorDict, *, stops: Collection[int]
) -> list[RewardText]:
    """Each row's prompt and response as text, read with the ``policy_tokenizer`` (a Hugging
    Face tokenizer, ``data.load_tokenizer``'s): the prompt without its special tokens, then
    the response as it continues the prompt's text (``data.continuation_text``: the space
    before its first word kept; ended by EOS or one of ``stops``,
    ``models.generation_ends.response_stop_ids``); ``tokenizer``: the reward model's."""
    width = td["responses"].shape[1]
    # Each batch read on the host once, not a row at a time (on a GPU every read waits).
    prompts = td["input_ids"][:, :-width].tolist()
    real = td["attention_mask"][:, :-width].tolist()
    lengths = td["response_mask"].sum(-1).tolist()
    parts = []
    for prompt, keep, response, n in zip(
        prompts, real, td["responses"].tolist(), lengths, strict=True
    ):
        ids = [token for token, kept in zip(prompt, keep, strict=True) if kept]
        parts.append(
            (
                policy_tokenizer.decode(ids, skip_special_tokens=True),
                continuation_text(policy_tokenizer, ids, response[:n], stops),
            )
        )
    written = holds_special_text(tokenizer, [response for _, response in parts])
    return [
        RewardText(prompt + response, (len(prompt), len(prompt + response)) if held else None)
        for (prompt, response), held in zip(parts, written, strict=True)
    ]


# The response a conversation is rendered with to find where a row's response is in its
# rendering (:func:`chat_texts`): a character no template writes or trims.
_STAND_IN = "\x00"


def chat_texts(
    policy_tokenizer: Any,
    tokenizer: Any,
    td: TensorDict,
    conversations: list[Conversation],
    *,
    rm: RewardModelConfig,
    stops: Collection[int],
) -> list[RewardText]:
    """Each row as the reward model's chat template writes it (``tokenizer``'s, ``rm``'s
    model's): its prompt's
    conversation (``conversations``, one per prompt, a row's by its uid:
    ``data.row_records``), then its response as a reward function reads it
    (``data.response_texts``, read with the policy's ``policy_tokenizer``, ended by EOS or
    one of ``stops``) as the assistant's turn. Where a response holds a special token's text,
    its place is between the text the template writes before and after a stand-in response
    (:func:`_between`)."""
    rows = row_records(conversations, td["uid"])
    responses = response_texts(policy_tokenizer, td, stops=stops)
    texts = []
    for conversation, response, held in zip(
        rows, responses, holds_special_text(tokenizer, responses), strict=True
    ):
        text = reward_chat_text(tokenizer, conversation, response, rm=rm)
        stand_in = reward_chat_text(tokenizer, conversation, _STAND_IN, rm=rm) if held else None
        texts.append(RewardText(text, None if stand_in is None else _between(text, stand_in)))
    return texts


def _between(text: str, stand_in: str) -> tuple[int, int]:
    """Where the response is in ``text``, a conversation's rendering, given ``stand_in``, its
    rendering with :data:`_STAND_IN` as the response: between the text the template writes
    before the stand-in and after it, each compared with ``text`` on its own side, so that a
    response that begins or ends like the template's text on the other side (a stand-in
    character, then the turn's end) cannot move its bounds into itself. A template that
    writes other text around this response (one that moves a reasoning part) widens the
    place to all that differs. ``data.templates.TurnFormat._span`` finds an observation's
    place the same way where the template writes the same text around it, and is None
    otherwise (an observation holding a special token's text is then refused): an
    observation's tokens join the trajectory the policy samples and trains on, where the
    template's turn markers must stay its special tokens, and an environment is user code
    whose contract a run checks. A response is the policy's own sample, which a run cannot
    refuse, and a wider place here only reads the template's moved text as characters in
    the reward model's input."""
    before, _, after = stand_in.partition(_STAND_IN)
    start = common_start(text, before)
    return start, len(text) - common_start(text[start:][::-1], after[::-1])


@dataclass(frozen=True)
class RewardInputs:
    """Texts as the reward model's token ids, and which were cut to the limit."""

    ids: list[list[int]]
    truncated: list[bool]


def encode_texts(
    tokenizer: Any, texts: Sequence[RewardText], *, max_length: int, special: bool
) -> RewardInputs:
    """Each text as the reward model reads it (``tokenizer``: its own): its special tokens
    added when ``special`` (a text a chat template wrote holds them already), then the last
    ``max_length`` tokens kept (the end, where the score is read). A response's special
    token's text is its characters (``data.tokenizer.encode_written``); the rest of its
    text, the template's turns included, is encoded as the tokenizer encodes any text, and
    the texts whose response holds none are encoded together."""
    encoded: list[list[int]] = [[] for _ in texts]
    whole = [row for row, text in enumerate(texts) if text.response is None]
    if whole:
        batch = tokenizer([texts[row].text for row in whole], add_special_tokens=special)
        for row, ids in zip(whole, batch["input_ids"], strict=True):
            encoded[row] = list(ids)
    for row, (text, response) in enumerate(texts):
        if response is not None:
            ids = encode_written(tokenizer, text, *response)
            encoded[row] = with_special_tokens(tokenizer, text, ids) if special else ids
    return RewardInputs(
        [ids[-max_length:] for ids in encoded], [len(ids) > max_length for ids in encoded]
    )
