"""A tiny reward model saved to disk for tests: a Llama sequence classifier built from a
config (nothing downloaded), with a character tokenizer of its own whose ids differ from the
policy's (or a chat tokenizer, :func:`chat_reward_tokenizer`), and its scores by a plain
single-process Hugging Face forward, one text at a time."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from chat_model_support import chat_tokenizer
from tokenizers import processors
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    LlamaConfig,
    PreTrainedTokenizerBase,
)

from verlite.data.tokenizer import CHARACTERS, build_task_tokenizer

MAX_POSITIONS = 64
# A reward model's own turn format, unlike the policy's (chat_model_support.QWEN_TEMPLATE),
# that writes the BOS token itself, as Llama-3's does.
RM_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '### ' + message['role'] + ':\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
)


def chat_reward_tokenizer(template: str | None = RM_TEMPLATE) -> PreTrainedTokenizerBase:
    """A byte-level chat tokenizer (``chat_tokenizer``'s) with ``template``, whose encoding of
    a text adds BOS, as Llama's does: a template's text encoded with its special tokens
    added would begin with two."""
    tokenizer = chat_tokenizer(template, bos=True)
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tokenizer.bos_token_id)]
    )
    return tokenizer


def save_tiny_reward_model(
    folder: Path,
    *,
    num_labels: int = 1,
    seed: int = 0,
    vocab_size: int | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    max_positions: int = MAX_POSITIONS,
) -> Path:
    """A 2-layer LlamaForSequenceClassification and its tokenizer in ``folder``; the score
    head is scaled up so that scores spread over (0, 1) rather than sit at 0.5. The
    vocabulary is the tokenizer's size unless ``vocab_size`` says otherwise; the tokenizer
    a character tokenizer unless ``tokenizer`` is given."""
    # Reversed characters: the same text has other ids than under the policy's tokenizer.
    tokenizer = tokenizer or build_task_tokenizer(CHARACTERS[::-1])
    config = LlamaConfig(
        vocab_size=vocab_size or len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        num_labels=num_labels,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config)
    with torch.no_grad():
        model.score.weight.normal_(std=1.0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def reference_scores(
    folder: Path, texts: Sequence[str], *, max_length: int | None = None
) -> list[float]:
    """sigmoid of the logit Hugging Face's own forward gives each text alone (no padding),
    its last ``max_length`` tokens when given."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    cut = max_length or MAX_POSITIONS
    return reference_scores_of_ids(folder, [tokenizer(text)["input_ids"][-cut:] for text in texts])


def reference_scores_of_ids(folder: Path, ids: Sequence[Sequence[int]]) -> list[float]:
    """sigmoid of the logit Hugging Face's own forward gives each row of token ``ids`` alone."""
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    scores = []
    with torch.no_grad():
        for row in ids:
            logits = model(input_ids=torch.tensor([list(row)])).logits
            scores.append(float(torch.sigmoid(logits[0, 0])))
    return scores
