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
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict

from verlite.config import Config
from verlite.controller import Worker
from verlite.data import (
    continuation_text,
    load_reward_tokenizer,
    load_tokenizer,
    response_texts,
    row_records,
)
from verlite.data.files import Conversation
from verlite.data.templates import reads_chat_template, reward_chat_text
from verlite.models import model_dtype, worker_device
from verlite.models.hf import HFModel
from verlite.models.precision import autocast, store_for_inference
from verlite.models.reward_model import (
    encode_texts,
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
        prompts' (a row's by its uid), sent unless ``reward.model.chat_template=false``."""
        self.peak_memory.begin()
        if self.reads_chat_template:
            path = self.cfg.reward.model.path
            assert conversations is not None and path is not None
            texts = chat_texts(self.policy_tokenizer, self.tokenizer, td, conversations, path=path)
        else:
            texts = reward_texts(self.policy_tokenizer, td)
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


def reward_texts(tokenizer: Any, td: TensorDict) -> list[str]:
    """Each row's prompt and response as text, read with the policy's ``tokenizer`` (a
    Hugging Face tokenizer, ``data.load_tokenizer``'s): the prompt without its special
    tokens, then the response as it continues the prompt's text (``data.continuation_text``:
    the space before its first word kept)."""
    width = td["responses"].shape[1]
    # Each batch read on the host once, not a row at a time (on a GPU every read waits).
    prompts = td["input_ids"][:, :-width].tolist()
    real = td["attention_mask"][:, :-width].tolist()
    lengths = td["response_mask"].sum(-1).tolist()
    texts = []
    for prompt, keep, response, n in zip(
        prompts, real, td["responses"].tolist(), lengths, strict=True
    ):
        ids = [token for token, kept in zip(prompt, keep, strict=True) if kept]
        texts.append(
            tokenizer.decode(ids, skip_special_tokens=True)
            + continuation_text(tokenizer, ids, response[:n])
        )
    return texts


def chat_texts(
    policy_tokenizer: Any,
    tokenizer: Any,
    td: TensorDict,
    conversations: list[Conversation],
    *,
    path: str,
) -> list[str]:
    """Each row as the reward model's chat template writes it (``tokenizer``'s): its prompt's
    conversation (``conversations``, one per prompt, a row's by its uid:
    ``data.row_records``), then its response as a reward function reads it
    (``data.response_texts``, read with the policy's ``policy_tokenizer``) as the
    assistant's turn."""
    return [
        reward_chat_text(tokenizer, conversation, response, path=path)
        for conversation, response in zip(
            row_records(conversations, td["uid"]),
            response_texts(policy_tokenizer, td),
            strict=True,
        )
    ]
