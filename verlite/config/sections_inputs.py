"""The sections of what a run starts from: the policy model (``model``) and the prompts
(``data``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from verlite.config.fields import (
    Needs,
    NonEmptyStr,
    PathStr,
    PositiveInt,
    Section,
    TemplateValue,
)

# What the deprecated ``model.dtype`` values mean as a ``model.precision``.
DTYPE_PRECISION = {"float32": "fp32", "float64": "fp64", "bfloat16": "bf16"}


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
    num_heads: PositiveInt = Field(
        4,
        description="Built-in model: attention heads; each holds hidden_size / num_heads "
        "dimensions, an even number (rotary embeddings rotate pairs).",
    )
    num_kv_heads: PositiveInt = Field(
        2, description="Built-in model: key/value heads (grouped-query attention)."
    )
    intermediate_size: PositiveInt = Field(128, description="Built-in model: MLP width.")
    vocab_size: PositiveInt | None = Field(
        None,
        description="Built-in model: rows of its embedding and LM head (a real model's vocabulary size, e.g. 152064, for its memory and FLOPs); at least the task tokenizer's size; a sampled id past the tokenizer's reads as <unk> to rewards. None: the tokenizer's size.",
    )
    precision: Literal["auto", "fp32", "fp64", "bf16-mixed", "bf16"] = Field(
        "auto",
        description="Numeric precision of every model: fp32 or fp64 (parameters and compute); "
        "bf16-mixed (fp32 master weights, gradients and optimizer state, forward and backward "
        "in bf16 under autocast; the models that are never trained hold their linear layers in "
        "bf16); bf16 (parameters and compute in bf16: updates below half a weight's bf16 "
        "spacing round away). auto: bf16-mixed where the workers run on cuda, fp32 on CPU.",
    )
    dtype: Literal["float32", "float64", "bfloat16"] | None = Field(
        None,
        description="Deprecated: model.precision. float32, float64 and bfloat16 set "
        "model.precision to fp32, fp64 and bf16.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description="Where workers run the model: auto picks cuda when the worker has a GPU.",
    )
    logits_chunk_tokens: PositiveInt = Field(
        1024,
        description="Log-prob passes (actor update, old and reference log-probs) compute the LM head's logits, their log-softmax and entropy this many response tokens at a time, recomputing each chunk in backward when a micro-batch holds more: fp32 logits of at most this many tokens x vocab exist at once (Qwen2.5's 152k vocab: 1024 tokens are 0.6 GB, where 32 rows of 1k tokens at once would be 19 GB). A micro-batch within one chunk is computed directly, without the recompute.",
    )
    attention_crossover: PositiveInt | None = Field(
        None,
        description="Packing roles: the sequence length at which a token's attention costs what its weights do, which balances their DP shares (a row of L tokens costs L + L^2 / this). None counts it from the model's FLOPs; `verlite measure-packing` measures it on this machine.",
    )

    @model_validator(mode="before")
    @classmethod
    def _fold_dtype(cls, data: Any) -> Any:
        """``model.dtype`` (deprecated) sets ``model.precision``; both set must agree."""
        if not isinstance(data, dict) or data.get("dtype") is None:
            return data
        dtype = data["dtype"]
        if not isinstance(dtype, str) or dtype not in DTYPE_PRECISION:
            return data  # the field's own check names the allowed values
        precision = DTYPE_PRECISION[dtype]
        if data.get("precision", "auto") not in ("auto", precision):
            raise ValueError(
                f"model.dtype={dtype} (deprecated) means model.precision={precision}, but "
                f"model.precision={data['precision']}; set model.precision alone"
            )
        return {**data, "precision": precision, "dtype": None}

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"model.hidden_size={self.hidden_size} must be divisible by model.num_heads={self.num_heads}"
            )
        head_dim = self.hidden_size // self.num_heads
        if head_dim % 2:
            raise ValueError(
                f"model.hidden_size={self.hidden_size} / model.num_heads={self.num_heads} gives "
                f"heads of {head_dim} dimensions; rotary position embeddings rotate pairs of "
                "them: give each head an even number"
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
        description="JSONL or Parquet file of training prompts, each row with a prompt and an answer field (data.prompt_key, data.answer_key).",
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
    prompt_overflow: Literal["truncate", "error", "drop"] = Field(
        "error",
        description="What to do with a prompt longer than max_prompt_length: error (the run stops before it starts, naming the prompt); truncate (batches keep its last tokens; counted in data/truncated_prompts); drop (left out of its split, as verl's filter_overlong_prompts does; a start-up line and data/dropped_prompts count them).",
    )
    train_batch_size: PositiveInt = Field(16, description="Prompts per training step.")
    shuffle: bool = Field(
        True, description="Shuffle training prompts each epoch (seeded by trainer.seed)."
    )
    prompt_key: NonEmptyStr = Field(
        "prompt",
        description="Prompt files: the field of a row that holds the prompt (GSM8K: question, MATH: problem): text, or a conversation as verl's files store it (a list of {role, content} messages, not ending with the assistant's; needs data.chat_template). A key with dots names a field inside fields, as data.answer_key's does.",
    )
    answer_key: NonEmptyStr = Field(
        "answer",
        description="Prompt files: the field of a row that holds the answer (text, or an integer read as its digits), as data.answer_rule reads it (MATH: solution). A key with dots names a field inside fields when the row has no field of that name (verl's files: reward_model.ground_truth).",
    )
    answer_rule: Literal["as_is", "gsm8k", "boxed"] = Field(
        "as_is",
        description="Prompt files: how a row's answer is taken from its answer field: as_is (the whole field); gsm8k (the text after the last '####', commas removed, stripped); boxed (the content of the last \\boxed{...}, braces balanced). A row where the rule finds no answer stops the run before it starts, naming the file and row.",
    )
    chat_template: bool = Field(
        False,
        description="Render each prompt with the tokenizer's own chat template (model.path's), a text prompt as one user turn after data.system_prompt, a conversation as its messages, with the assistant's generation prompt; the text is tokenized once, as the template writes it (no BOS added), and reward functions and environments receive it as the prompt. With rollout.multi_turn.env, each observation is written as the template's turn of rollout.multi_turn.observation_role, the sampled tokens kept as they are.",
    )
    system_prompt: str | None = Field(
        None,
        description="With data.chat_template: the system turn's text before each prompt (an empty string is an empty system turn). None: no system turn (the template may add its own default).",
    )
    chat_template_kwargs: dict[str, TemplateValue] = Field(
        default_factory=dict,
        description="With data.chat_template: variables the template reads, passed to apply_chat_template with every conversation it renders (prompts, the system turn's check, multi-turn turns), e.g. {enable_thinking: false} for Qwen3's template. A name the template does not read, or one of apply_chat_template's own parameters, a special token's (bos_token) or a template function's (raise_exception), is refused before the run starts.",
    )
    prompt_suffix: NonEmptyStr | None = Field(
        None,
        description="Text appended to every prompt after a space (to the user turn with data.chat_template; to a conversation's last turn), e.g. an instruction 'Put the final answer in \\boxed{}.'. A prompt that already ends with it is refused (it would hold it twice).",
    )

    @model_validator(mode="after")
    def _one_source(self) -> DataConfig:
        if self.task is not None and self.train_file is not None:
            raise ValueError(
                f"data.task={self.task!r} and data.train_file={self.train_file!r} are both set: set "
                "exactly one of them (a synthetic task or a prompt file); data.task=null trains on "
                "the file"
            )
        if self.task is None and self.train_file is None:
            raise ValueError(
                "data.task or data.train_file: set exactly one of them (a synthetic task or a prompt file)"
            )
        if self.task is not None:
            for name in ("prompt_key", "answer_key", "answer_rule"):
                value = getattr(self, name)
                if value != DataConfig.model_fields[name].default:
                    raise ValueError(
                        f"data.{name}={value!r} reads the rows of prompt files, but "
                        f"data.task={self.task} generates its prompts; unset one of them"
                    )
        if self.chat_template_kwargs and not self.chat_template:
            raise ValueError(
                f"data.chat_template_kwargs={self.chat_template_kwargs} are variables of the chat "
                "template, which is off; set data.chat_template=true or unset "
                "data.chat_template_kwargs"
            )
        if self.system_prompt is not None and not self.chat_template:
            raise ValueError(
                "data.system_prompt is a turn of the chat template, which is off; set "
                "data.chat_template=true or unset data.system_prompt"
            )
        if self.min_digits > self.max_digits:
            raise ValueError(
                f"data.min_digits={self.min_digits} must be <= data.max_digits={self.max_digits}"
            )
        return self


# Settings of these sections that only a feature makes count (verlite.config.inert).
NEEDS = (
    Needs(
        (
            "model.arch",
            "model.hidden_size",
            "model.num_layers",
            "model.num_heads",
            "model.num_kv_heads",
            "model.intermediate_size",
        ),
        unless="model.path is unset (the built-in model)",
        active=lambda cfg: cfg.model.path is None,
        example={"model.path": None},
    ),
    Needs(
        ("model.attention_crossover",),
        unless="a role packs (actor.packing, or critic.packing with a critic)",
        active=lambda cfg: any(getattr(cfg, role).packing for role in cfg.roles),
        example={"actor.packing": True},
    ),
    Needs(
        ("data.num_train_samples", "data.min_digits", "data.max_digits"),
        unless="data.task is set (a synthetic task)",
        active=lambda cfg: cfg.data.task is not None,
        example={"data.task": "copy", "data.train_file": None},
    ),
    Needs(
        ("data.val_file",),
        unless="data.train_file is set (a synthetic task makes its own validation prompts)",
        active=lambda cfg: cfg.data.train_file is not None,
        example={"data.task": None, "data.train_file": "prompts.jsonl"},
    ),
    Needs(
        ("data.num_val_samples",),
        unless="data.val_file is unset (the validation prompts are held out)",
        active=lambda cfg: cfg.data.val_file is None or cfg.data.task is not None,
        example={"data.val_file": None},
    ),
)
