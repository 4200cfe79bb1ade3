"""What verlite reads of a Hugging Face model it holds as an ``nn.Module`` (a causal LM, a
peft model over one, which forwards these to it, a sharded or unwrapped one): its config and
its embeddings. torch types an attribute a module's class does not declare as
``Tensor | Module`` (``nn.Module.__getattr__``: a parameter, buffer or submodule), which
these are not; each accessor states what it is."""

from __future__ import annotations

from typing import TypeVar

from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

# A Hugging Face model, named here for the packages that hold one without importing
# transformers themselves (workers/: the README's layout).
HFModel = PreTrainedModel
# A module that a function changes in place and returns: its caller keeps the module's type.
ModuleT = TypeVar("ModuleT", bound=nn.Module)


def config_of(model: nn.Module) -> PretrainedConfig:
    """``model``'s Hugging Face config (a peft model's: its base model's)."""
    config = model.config
    assert isinstance(config, PretrainedConfig)  # what every Hugging Face model holds
    return config


def output_embeddings(model: nn.Module) -> nn.Module | None:
    """``model``'s LM head (``get_output_embeddings``); None for a model without one (a
    value model's trunk)."""
    # A method of every Hugging Face model, not the submodule nn.Module's __getattr__ types it as.
    head: nn.Module | None = model.get_output_embeddings()  # type: ignore[operator]
    return head


def input_embeddings(model: nn.Module) -> nn.Module:
    """``model``'s token embedding (``get_input_embeddings``)."""
    # A method of every Hugging Face model, not the submodule nn.Module's __getattr__ types it as.
    embedding: nn.Module = model.get_input_embeddings()  # type: ignore[operator]
    return embedding
