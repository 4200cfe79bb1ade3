"""Reward models: a Hugging Face sequence-classification model that scores a prompt and its
response, read as text, with a number in [0, 1].

The rule: the model reads ``prompt + response`` tokenized by its own tokenizer (its special
tokens added, as its ``__call__`` adds them), or the conversation as its chat template writes
it (``reward.model.chat_template``: no special tokens added, the template wrote them), a
special token's text inside the response read as its characters (the texts and their
tokens: ``workers.reward_model``), and the score is ``sigmoid(logit)`` of its one label at
the text's last token. Decoder classifiers (Hugging Face's
``GenericForSequenceClassification``: Llama, Qwen2, Mistral, ...) are accepted, as their
score head reads that token; the last token is found from each row's length, not from the
pad id (which may also be a real token, e.g. a pad that is the EOS). A text longer than the
limit keeps its last tokens, where the score is read.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import transformers
from torch import nn
from transformers import (
    AutoModelForSequenceClassification,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.modeling_layers import GenericForSequenceClassification

from verlite.config import ConfigError, RewardModelConfig
from verlite.models import load_pretrained, model_config
from verlite.models.precision import fp64_throughout
from verlite.models.support import check_sdpa
from verlite.models.varlen import Padding, known_padding, use_verlite_attention


def token_limit(cfg: RewardModelConfig, config: PretrainedConfig) -> int:
    """The most tokens of one text: ``reward.model.max_length``, within the model's
    positions, or all of them."""
    positions = getattr(config, "max_position_embeddings", None)
    if cfg.max_length is None:
        if not isinstance(positions, int):
            raise ConfigError(
                f"reward.model.path={cfg.path!r}: its config.json has no max_position_embeddings; "
                "set reward.model.max_length"
            )
        return positions
    if isinstance(positions, int) and cfg.max_length > positions:
        raise ConfigError(
            f"reward.model.max_length={cfg.max_length} is more than the model's "
            f"max_position_embeddings={positions}"
        )
    return cfg.max_length


def check_reward_model(cfg: RewardModelConfig) -> None:
    """At start-up, before Ray: ``reward.model.path`` holds a decoder sequence-classification
    model with one label whose class runs SDPA attention, and ``max_length`` fits it; each
    problem one line (its tokenizer: ``driver.preflight``)."""
    assert cfg.path is not None
    path = cfg.path
    config = model_config(path, field="reward.model.path")
    names = list(getattr(config, "architectures", None) or [])
    classes = [getattr(transformers, name, None) for name in names]
    if not any(name.endswith("ForSequenceClassification") for name in names):
        raise ConfigError(
            f"reward.model.path={path!r} is not a sequence-classification model (config.json "
            f"architectures: {names or 'none'}); save an AutoModelForSequenceClassification"
        )
    if not any(
        isinstance(c, type) and issubclass(c, GenericForSequenceClassification) for c in classes
    ):
        raise ConfigError(
            f"reward.model.path={path!r}: {names[0]} is not a decoder classifier whose score "
            "head reads the last token (LlamaForSequenceClassification, Qwen2..., Mistral...)"
        )
    if config.num_labels != 1:
        raise ConfigError(
            f"reward.model.path={path!r} has num_labels={config.num_labels}; a reward model "
            "has one label, whose sigmoid is the score"
        )
    with torch.device("meta"):  # no memory
        check_sdpa(
            AutoModelForSequenceClassification.from_config(config),
            field="reward.model.path",
            path=path,
        )
    token_limit(cfg, config)


def load_reward_model(cfg: RewardModelConfig, dtype: torch.dtype) -> PreTrainedModel:
    """The reward model of ``cfg.path``, every weight loaded, in eval mode."""
    assert cfg.path is not None
    model = load_pretrained(
        AutoModelForSequenceClassification, cfg.path, dtype, field="reward.model.path"
    )
    evaluated: PreTrainedModel = fp64_throughout(model).eval()
    use_verlite_attention(evaluated, packing=False)  # its mask from the padding (score_texts)
    return evaluated


def score_head(model: nn.Module) -> nn.Linear:
    """The reward model's score head: a linear layer in every class :func:`check_reward_model`
    admits (``GenericForSequenceClassification``'s ``score``)."""
    head = model.score
    assert isinstance(head, nn.Linear)
    return head


@torch.inference_mode()
def score_texts(
    model: PreTrainedModel, ids: Sequence[Sequence[int]], device: torch.device
) -> torch.Tensor:
    """``sigmoid(logit)`` at each text's last token, in the score head's dtype but at least
    float32 (float64 in an fp64 run: ``precision.score_dtype``), for one micro-batch of texts
    (right-padded here: a real token never attends to a pad under causal attention, and the
    score is read at each row's own last token)."""
    lengths = torch.tensor([len(row) for row in ids])
    width = int(lengths.max())
    input_ids = torch.zeros(len(ids), width, dtype=torch.long)  # the pad id is never read
    for row, values in enumerate(ids):
        input_ids[row, : len(values)] = torch.tensor(values, dtype=torch.long)
    mask = (torch.arange(width) < lengths[:, None]).long()
    # Read here on the CPU: the pass builds its attention mask knowing it, where Hugging
    # Face's check would read the device's mask (``varlen.known_padding``).
    padding = Padding.SOME if bool((lengths < width).any()) else Padding.NONE
    input_ids, mask, lengths = input_ids.to(device), mask.to(device), lengths.to(device)
    base = getattr(model, model.base_model_prefix)
    # No KV cache: a decoder's config asks for one, which the pass would build for nothing.
    with known_padding(padding):
        hidden = base(input_ids=input_ids, attention_mask=mask, use_cache=False).last_hidden_state
    last = hidden[torch.arange(len(ids), device=device), lengths - 1]
    # The score head in at least fp32 under any precision (its weights are kept so:
    # ``workers.reward_model``): the score is what training reads.
    head = score_head(model)
    dtype = torch.promote_types(head.weight.dtype, torch.float32)
    bias = None if head.bias is None else head.bias.to(dtype)
    with torch.autocast(device.type, enabled=False):
        logit = torch.nn.functional.linear(last.to(dtype), head.weight.to(dtype), bias)
    # The sigmoid in float64, rounded once to that dtype. A row's score must not depend on
    # how many rows it is scored with: the CPU kernel takes a vectorized path or a scalar one
    # by the tensor's length, and in float32 the two differ in the last unit (4 rows of 64
    # scored at once against one at a time, AVX-512). In float64 a row's score still differs
    # by a few float64 units with the rows beside it (the sigmoid's two paths, and already
    # the logit: the forward's products are blocked by the row count, 5e-15 apart here),
    # which the rounding to float32 absorbs and an fp64 run keeps within its 1e-9 tolerance
    # (where a float32 unit would not be).
    return torch.sigmoid(logit.double()).to(dtype).squeeze(-1)
