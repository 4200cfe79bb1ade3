"""The sections of what a run starts from: the policy model (``model``) and the prompts
(``data``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from verlite.config.fields import PathStr, PositiveInt, Section


class ModelConfig(Section):
    """The policy model (the critic uses the same trunk with a scalar value head)."""

    path: PathStr | None = Field(
        None,
        description="Local Hugging Face causal-LM directory (weights + tokenizer). "
        "None builds the built-in tiny decoder from the fields below with verlite's task tokenizer.",
    )
    arch: Literal["llama", "qwen2"] = Field(
        "llama", description="Architecture of the built-in model."
    )
    hidden_size: PositiveInt = Field(64, description="Built-in model: hidden size.")
    num_layers: PositiveInt = Field(2, description="Built-in model: number of decoder layers.")
    num_heads: PositiveInt = Field(4, description="Built-in model: attention heads.")
    num_kv_heads: PositiveInt = Field(
        2, description="Built-in model: key/value heads (grouped-query attention)."
    )
    intermediate_size: PositiveInt = Field(128, description="Built-in model: MLP width.")
    vocab_size: PositiveInt | None = Field(
        None,
        description="Built-in model: rows of its embedding and LM head (a real model's vocabulary size, e.g. 152064, for its memory and FLOPs); at least the task tokenizer's size; a sampled id past the tokenizer's reads as <unk> to rewards. None: the tokenizer's size.",
    )
    dtype: Literal["float32", "float64", "bfloat16"] = Field(
        "float32", description="Parameter and compute dtype of actor, critic and reference."
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description="Where workers run the model: auto picks cuda when the worker has a GPU.",
    )
    attention_crossover: PositiveInt | None = Field(
        None,
        description="Packing roles: the sequence length at which a token's attention costs what its weights do, which balances their DP shares (a row of L tokens costs L + L^2 / this). None counts it from the model's FLOPs; `verlite measure-packing` measures it on this machine.",
    )

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"model.hidden_size={self.hidden_size} must be divisible by model.num_heads={self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model.num_heads={self.num_heads} must be divisible by model.num_kv_heads={self.num_kv_heads}"
            )
        return self

    @model_validator(mode="after")
    def _vocab_size_builtin(self) -> ModelConfig:
        if self.vocab_size is not None and self.path is not None:
            raise ValueError(
                f"model.vocab_size={self.vocab_size} sets the built-in model's vocabulary; "
                f"model.path={self.path!r} has its own (its config.json): leave model.vocab_size unset"
            )
        return self


class DataConfig(Section):
    """Prompts: a synthetic task generated from the seed, or JSONL/Parquet files."""

    task: Literal["copy", "reverse", "add", "lookup"] | None = Field(
        None,
        description="Synthetic task (prompts and rule-based reward generated from trainer.seed).",
    )
    train_file: PathStr | None = Field(
        None,
        description="JSONL or Parquet file of training prompts with 'prompt' and 'answer' fields.",
    )
    val_file: PathStr | None = Field(
        None,
        description="Validation prompts in the same format; None holds out data.num_val_samples prompts.",
    )
    num_train_samples: PositiveInt = Field(
        4096, description="Synthetic task: number of training prompts."
    )
    num_val_samples: PositiveInt = Field(64, description="Held-out prompts used for validation.")
    min_digits: PositiveInt = Field(
        2, description="Synthetic task: shortest digit string in a prompt."
    )
    max_digits: PositiveInt = Field(
        5, description="Synthetic task: longest digit string in a prompt."
    )
    max_prompt_length: PositiveInt = Field(32, description="Longest prompt in tokens.")
    prompt_overflow: Literal["truncate", "error"] = Field(
        "error",
        description="What to do with a prompt longer than max_prompt_length (truncated prompts are counted).",
    )
    train_batch_size: PositiveInt = Field(16, description="Prompts per training step.")
    shuffle: bool = Field(
        True, description="Shuffle training prompts each epoch (seeded by trainer.seed)."
    )

    @model_validator(mode="after")
    def _one_source(self) -> DataConfig:
        if (self.task is None) == (self.train_file is None):
            raise ValueError(
                "data.task or data.train_file: set exactly one of them (a synthetic task or a prompt file)"
            )
        if self.min_digits > self.max_digits:
            raise ValueError(
                f"data.min_digits={self.min_digits} must be <= data.max_digits={self.max_digits}"
            )
        return self
