"""A tiny reward model saved to disk for tests: a Llama sequence classifier built from a
config (nothing downloaded), with a character tokenizer of its own whose ids differ from the
policy's, and its scores by a plain single-process Hugging Face forward, one text at a time."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer, LlamaConfig

from verlite.data.tokenizer import CHARACTERS, build_task_tokenizer

MAX_POSITIONS = 64


def save_tiny_reward_model(
    folder: Path, *, num_labels: int = 1, seed: int = 0, vocab_size: int | None = None
) -> Path:
    """A 2-layer LlamaForSequenceClassification and its tokenizer in ``folder``; the score
    head is scaled up so that scores spread over (0, 1) rather than sit at 0.5. The
    vocabulary is the tokenizer's size unless ``vocab_size`` says otherwise."""
    # Reversed characters: the same text has other ids than under the policy's tokenizer.
    tokenizer = build_task_tokenizer(CHARACTERS[::-1])
    config = LlamaConfig(
        vocab_size=vocab_size or len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS,
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
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    scores = []
    with torch.no_grad():
        for text in texts:
            ids = tokenizer(text)["input_ids"][-(max_length or MAX_POSITIONS) :]
            logits = model(input_ids=torch.tensor([ids])).logits
            scores.append(float(torch.sigmoid(logits[0, 0])))
    return scores
