"""A step's responses as the driver's scorer (``driver/scorer.py``) reads them, from texts;
that scorer for a run whose one reward source is a function."""

from typing import Any

import torch
from tensordict import TensorDict
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from verlite.config import Config
from verlite.driver.scorer import Scorer
from verlite.rewards import RewardFn


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A small byte-level BPE tokenizer: any text round-trips."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator([r"\boxed{72} #### 1/2 \frac{1}{2}"] * 10, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>")


def step_batch(tokenizer: PreTrainedTokenizerFast, texts: list[str], uids: list[int]) -> Any:
    """A step's responses as the scorer reads them: ids ending in EOS, right-padded, by uid."""
    ids = [[*tokenizer.encode(t), tokenizer.eos_token_id] for t in texts]
    width = max(map(len, ids))
    return TensorDict(
        {
            "responses": torch.tensor([r + [0] * (width - len(r)) for r in ids]),
            "response_mask": torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in ids]),
            "uid": torch.tensor(uids),
        },
        batch_size=[len(ids)],
    )


def fn_scorer(cfg: Config, tokenizer: PreTrainedTokenizerFast, reward_fn: RewardFn) -> Scorer:
    """The driver's scorer of a run whose one reward source is the function ``reward_fn``."""
    return Scorer(
        cfg,
        tokenizer,
        reward_fn=reward_fn,
        remote=None,
        reward_model=None,
        reward_model_reads_chat=False,
    )
