"""The run configuration's schema: one frozen pydantic model per YAML section.

Every YAML section maps 1:1 onto a model below. Models are frozen and forbid unknown keys;
every field carries a description (the reference in docs/config.md is generated from them).
Values that default to another field (the critic's loss settings, per-role worker counts,
the ``seq-mean-token-sum-norm`` scale) are filled in once, at load, so the resolved config
that a run logs is the config it uses. Sizes derived from several fields live in
:class:`RoleSizes` and :attr:`Config.max_sequence_length`, and nowhere else.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal
from urllib.parse import parse_qsl, urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    Strict,
    TypeAdapter,
    ValidationError,
    model_validator,
)

from verlite.core.advantages import ADV_ESTIMATORS, ESTIMATORS_NEEDING_CRITIC
from verlite.core.losses import KL_KINDS, LOSS_AGG_MODES, POLICY_LOSSES
from verlite.errors import shown
from verlite.redaction import redact_url


def _one_of(allowed: Sequence[str], what: str) -> AfterValidator:
    def check(value: str) -> str:
        if value not in allowed:
            raise ValueError(f"unknown {what}; allowed: {', '.join(allowed)}")
        return value

    return AfterValidator(check)


MIN_TEMPERATURE = 0.01


def _greedy_or_at_least_min_temperature(value: float) -> float:
    # Log-probs and their gradients scale as 1/temperature: near 0 they overflow float32
    # (the sampler then draws past the vocabulary) long before sampling differs from greedy.
    if 0.0 < value < MIN_TEMPERATURE:
        raise ValueError(
            f"must be 0 (greedy) or at least {MIN_TEMPERATURE}: logits divided by a smaller "
            "temperature overflow and its gradients grow as 1/temperature"
        )
    return value


def _kl_kind(value: str) -> str:
    if value.rstrip("+") not in KL_KINDS or value.count("+") > 1:
        raise ValueError(
            f"unknown KL kind; allowed: {', '.join(KL_KINDS)} (each also with a '+' suffix)"
        )
    return value


LossAggMode = Annotated[str, _one_of(LOSS_AGG_MODES, "loss aggregation mode")]
PolicyLossMode = Annotated[str, _one_of(sorted(POLICY_LOSSES), "policy loss")]
AdvEstimator = Annotated[str, _one_of(sorted(ADV_ESTIMATORS), "advantage estimator")]
KLKind = Annotated[str, AfterValidator(_kl_kind)]
# Every size and count fits a 32-bit int: a 29-digit step count is a typo, not a plan.
MAX_INT = 2**31 - 1
PositiveInt = Annotated[int, Field(gt=0, le=MAX_INT)]
NonNegativeInt = Annotated[int, Field(ge=0, le=MAX_INT)]
Beta = Annotated[float, Field(ge=0.0, lt=1.0)]
NonEmptyStr = Annotated[str, Field(min_length=1)]


def _path(value: str) -> str:
    if "\0" in value:
        raise ValueError("a path cannot hold a NUL byte")
    if value.startswith("~"):
        # A shell expands ~ only at a word's start, so trainer.output_dir=~/runs reaches
        # verlite as is, and it would make a folder named "~" here.
        raise ValueError("verlite does not expand '~'; write the home folder out (e.g. $HOME/...)")
    return value


# A file or folder on the machine that runs verlite.
PathStr = Annotated[NonEmptyStr, AfterValidator(_path)]


# A list (what YAML and JSON give) for a tuple field; its items stay strict.
AsList = Strict(False)


class Section(BaseModel):
    # strict: every value has the type its field names, from a file, the command line and the
    # API alike; nothing is coerced (True is no 1, 2.5 or "3" no int, 3 no string). An int
    # is a float (lr: 1), and a tuple field takes a list (AsList). inf and nan are refused
    # everywhere: no setting means anything with them, and torch would only report them
    # after Ray and the workers had started.
    model_config = ConfigDict(
        frozen=True, extra="forbid", validate_default=True, allow_inf_nan=False, strict=True
    )


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


class MultiTurnConfig(Section):
    """Multi-turn rollouts: the policy and an environment (its tools) take turns."""

    env: NonEmptyStr | None = Field(
        None,
        description="The environment: a registered name (lookup, lookup_without_tool) or "
        "'package.module:Class' (see verlite.envs); None generates one turn per prompt.",
    )
    max_turns: PositiveInt = Field(4, description="Most policy turns of a trajectory.")
    max_total_length: PositiveInt | None = Field(
        None,
        description="Most tokens of a trajectory, prompt, turns and observations included "
        "(>= data.max_prompt_length + rollout.max_response_length: the prompt and one turn); "
        "required with env.",
    )
    turn_stop: NonEmptyStr | None = Field(
        None,
        description="The text that ends a policy turn and hands it to the environment (one token "
        "of the tokenizer); the end-of-sequence token always ends the trajectory.",
    )
    tool_timeout_s: float = Field(
        30.0,
        gt=0.0,
        description="Most seconds one environment call may take; a step that takes longer or "
        "raises ends its trajectory (multiturn/tool_errors), never the run.",
    )
    max_abandoned_calls: NonNegativeInt = Field(
        32,
        description="Most environment calls that outlived tool_timeout_s and still run, per "
        "worker: a thread cannot be stopped, so each is left running "
        "(multiturn/abandoned_calls counts a step's); one more stops the run.",
    )


class RolloutConfig(Section):
    """Generation: sampling, and where it runs (the actor, or a rollout worker group)."""

    n: PositiveInt = Field(1, description="Responses sampled per prompt (GRPO/RLOO need >= 2).")
    temperature: Annotated[float, AfterValidator(_greedy_or_at_least_min_temperature)] = Field(
        1.0,
        ge=0.0,
        description=f"Sampling temperature; 0 is greedy, otherwise at least {MIN_TEMPERATURE}.",
    )
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass; 1 disables it.")
    top_k: NonNegativeInt = Field(0, description="Keep the k most likely tokens; 0 disables it.")
    max_response_length: PositiveInt = Field(
        16, description="Longest response in tokens (generation stops there)."
    )
    randomness: Literal["per_sample", "per_rank"] = Field(
        "per_sample",
        description="per_sample: a response's random draws are keyed by (trainer.seed, step, "
        "prompt position, sample index), so a run does not depend on how many workers ran it; "
        "per_rank: one random stream per actor worker, the negative control of "
        "`verlite check-invariance --run`.",
    )
    placement: Literal["colocated", "split"] = Field(
        "colocated",
        description="colocated: the actor workers generate with the weights they train; split: a "
        "rollout worker group of its own generates, its weights synced from the actor after "
        "every update (versioned and digest-checked).",
    )
    workers_per_node: PositiveInt | None = Field(
        None,
        description="split: rollout workers on each node (over trainer.nnodes nodes); None uses "
        "trainer.workers_per_node.",
    )
    cpus_per_worker: float | None = Field(
        None,
        gt=0.0,
        description="split: CPUs of one rollout worker; None uses trainer.cpus_per_worker.",
    )
    gpus_per_worker: float | None = Field(
        None,
        ge=0.0,
        description="split: GPUs of one rollout worker; None uses trainer.gpus_per_worker.",
    )
    sync_bucket_mb: float = Field(
        128.0,
        gt=0.0,
        description="split: weights travel to the rollout workers in buckets of about this many "
        "MiB (a tensor larger than a bucket travels alone).",
    )
    multi_turn: MultiTurnConfig = Field(
        default_factory=MultiTurnConfig,
        description="Multi-turn rollouts with an environment (tools).",
    )


class OptimConfig(Section):
    """Optimizer with an optional warm-up and cosine decay."""

    name: Literal["adamw", "sgd"] = Field(
        "adamw",
        description="adamw, or plain sgd (no momentum; the invariance audit uses it, see README).",
    )
    lr: float = Field(1e-4, gt=0.0, description="Peak learning rate.")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW decoupled weight decay.")
    betas: Annotated[tuple[Beta, Beta], AsList] = Field(
        (0.9, 0.999), description="AdamW betas, each in [0, 1) (ignored by sgd)."
    )
    warmup_steps: NonNegativeInt = Field(
        0, description="Optimizer steps of linear warm-up from 0 to lr."
    )
    schedule: Literal["constant", "cosine"] = Field("constant", description="LR after warm-up.")
    min_lr_ratio: float = Field(
        0.0, ge=0.0, le=1.0, description="Cosine schedule: final lr as a fraction of lr."
    )
    grad_clip: float | None = Field(
        1.0, gt=0.0, description="Clip the global gradient norm to this; None only measures it."
    )


class WorkerRoleConfig(Section):
    """What actor and critic share: parallelism, batching, loss aggregation, optimizer."""

    strategy: Literal["ddp", "fsdp", "none"] = Field(
        "ddp",
        description="Data parallelism: DDP, FSDP2 (fully_shard per decoder layer) or none (one worker only).",
    )
    workers_per_node: PositiveInt | None = Field(
        None, description="Workers of this role on each node; None uses trainer.workers_per_node."
    )
    ppo_mini_batch_size: PositiveInt = Field(
        16, description="Sequences (responses) per optimizer step, over all workers of this role."
    )
    ppo_epochs: PositiveInt = Field(1, description="Passes over each step's batch.")
    micro_batch_size_per_worker: PositiveInt = Field(
        4,
        description="Sequences per forward/backward on one worker (ignored with use_dynamic_bsz).",
    )
    use_dynamic_bsz: bool = Field(
        False,
        description="Cut micro-batches by a token budget (rows of similar length together) instead of a fixed size.",
    )
    max_token_len_per_worker: PositiveInt | None = Field(
        None,
        description="Token budget of one micro-batch with use_dynamic_bsz: rows x (longest prompt + longest response), padding included; with packing, the real tokens of the packed row (>= the longest prompt + response).",
    )
    packing: bool = Field(
        False,
        description="Run each micro-batch as one packed row of its sequences' real tokens (no padding), attention confined to each sequence; training and inference passes alike.",
    )
    loss_agg_mode: LossAggMode = Field(
        "token-mean", description=f"How token losses aggregate: {', '.join(LOSS_AGG_MODES)}."
    )
    loss_scale_factor: float | None = Field(
        None,
        gt=0.0,
        description="Constant divisor of seq-mean-token-sum-norm; None uses rollout.max_response_length.",
    )
    optim: OptimConfig = Field(
        default_factory=OptimConfig, description="Optimizer and LR schedule."
    )


# The projections of Llama- and Qwen2-family decoders: attention and MLP.
LORA_DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraConfig(Section):
    """LoRA adapters on the policy (through ``peft``, the ``lora`` extra): only the adapters
    train, the reference is the same model with its adapters off."""

    rank: NonNegativeInt = Field(
        0,
        description="Rank of the adapters' low-rank update; 0 trains every weight (no LoRA).",
    )
    alpha: float = Field(
        16.0, gt=0.0, description="Scale of the adapters' update: alpha / rank times B A."
    )
    dropout: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Dropout on the adapters' input while training; > 0 draws random masks, "
        "so gradients then depend on how the batch is split (the invariance audit uses 0).",
    )
    target_modules: Annotated[tuple[NonEmptyStr, ...], AsList] = Field(
        LORA_DEFAULT_TARGETS,
        min_length=1,
        description="Names of the linear layers that get adapters, matched as the last part "
        "of a module's name (peft's target_modules); each must name a layer of the model.",
    )


class ActorConfig(WorkerRoleConfig):
    """The policy: PPO-family losses, entropy bonus, KL loss to the reference."""

    policy_loss: PolicyLossMode = Field(
        "vanilla", description=f"Policy loss: {', '.join(sorted(POLICY_LOSSES))}."
    )
    clip_ratio_low: float = Field(
        0.2, ge=0.0, description="PPO clip below 1 (ratio >= 1 - clip_ratio_low)."
    )
    clip_ratio_high: float = Field(
        0.2, ge=0.0, description="PPO clip above 1 (ratio <= 1 + clip_ratio_high)."
    )
    clip_ratio_c: float = Field(
        3.0, gt=1.0, description="Dual-clip bound for negative advantages (> 1)."
    )
    entropy_coeff: float = Field(0.0, ge=0.0, description="Weight of the entropy bonus.")
    use_kl_loss: bool = Field(False, description="Add a KL-to-reference term to the actor loss.")
    kl_loss_coef: float = Field(0.001, ge=0.0, description="Weight of the KL loss.")
    kl_loss_type: KLKind = Field(
        "low_var_kl", description=f"KL estimator of the loss: {', '.join(KL_KINDS)}, optional '+'."
    )
    lora: LoraConfig = Field(
        default_factory=LoraConfig, description="LoRA adapters (rank 0: train every weight)."
    )


class CriticConfig(WorkerRoleConfig):
    """The value model (used when the advantage estimator needs one, i.e. GAE)."""

    loss_agg_mode: LossAggMode | None = Field(  # type: ignore[assignment]
        None, description="How token value losses aggregate; None uses actor.loss_agg_mode."
    )
    cliprange_value: float = Field(
        0.5, gt=0.0, description="Value clipping range around the rollout-time values."
    )
    warmup_steps: NonNegativeInt = Field(
        0,
        description="Training steps that update only the critic before the actor starts learning.",
    )


class KLControlConfig(Section):
    """Coefficient of the KL penalty in the reward."""

    type: Literal["fixed", "adaptive"] = Field(
        "fixed", description="Fixed coefficient or the adaptive controller (Ziegler 2019)."
    )
    kl_coef: float = Field(0.001, ge=0.0, description="(Initial) KL coefficient.")
    target_kl: float = Field(0.1, gt=0.0, description="Adaptive: KL the controller steers towards.")
    horizon: PositiveInt = Field(
        10000, description="Adaptive: samples over which the coefficient adapts."
    )


class AlgorithmConfig(Section):
    """Advantage estimation and KL-in-reward."""

    adv_estimator: AdvEstimator = Field(
        "gae", description=f"Advantage estimator: {', '.join(sorted(ADV_ESTIMATORS))}."
    )
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="Discount factor.")
    lam: float = Field(1.0, ge=0.0, le=1.0, description="GAE lambda.")
    norm_adv_by_std: bool = Field(
        True, description="GRPO: divide by the group std; false gives Dr. GRPO."
    )
    use_kl_in_reward: bool = Field(
        False, description="Subtract a KL penalty to the reference from the token rewards."
    )
    kl_penalty: KLKind = Field("kl", description="KL estimator of the in-reward penalty.")
    kl_ctrl: KLControlConfig = Field(
        default_factory=KLControlConfig, description="KL coefficient controller."
    )
    recompute_old_log_probs: Literal["auto", "always"] = Field(
        "always",
        description="always: the actor recomputes the old log-probs of every batch; auto: takes "
        "the sampler's own where they must agree (trainer.max_staleness=0, model.dtype=float32, "
        "temperature > 0, no top-k/top-p), saving a forward pass; start-up says which applies.",
    )
    rollout_correction: Literal["none", "tis"] = Field(
        "none",
        description="tis: weight each token's policy loss by the truncated importance ratio "
        "min(exp(old - rollout log-prob), rollout_is_cap) between the trained and the sampling "
        "policy, before the loss is normalized.",
    )
    rollout_is_cap: float = Field(
        2.0, gt=0.0, description="tis: the largest importance weight (truncation)."
    )


def _service_url(value: str | None) -> str | None:
    # The message starts with the field name so that config loading prints it as it is: the
    # URL without user:password@ or its query, never a credential it would otherwise echo.
    if value is None:
        return None
    parts = urlsplit(value)
    where = f"reward.remote.url={shown(redact_url(re.split(r'[?#]', value)[0]))}"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{where}: must be an http:// or https:// URL with a host")
    secret_names = [
        name for name, _ in parse_qsl(parts.query, keep_blank_values=True) if _SECRET.search(name)
    ]
    if "@" in parts.netloc or secret_names:
        held = f"?{'&'.join(secret_names)}=..." if secret_names else "user:password@"
        raise ValueError(
            f"{where}: must not hold credentials ({held}); name an environment variable "
            "that holds the token in reward.remote.auth_env instead"
        )
    try:
        parts.port  # noqa: B018 (it raises on a port that is not a number in range)
    except ValueError:
        raise ValueError(f"{where}: the port must be a number from 0 to 65535") from None
    return value


# Query parameters named like a credential (?api_key=..., ?token=..., ?sig=...).
_SECRET = re.compile(r"token|secret|passw|key|auth|credential|sig", re.IGNORECASE)
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _environment_name(value: str | None) -> str | None:
    # The value is not shown: what is not a variable's name may be the token itself.
    if value is not None and not _ENV_NAME.fullmatch(value):
        raise ValueError(
            "reward.remote.auth_env must be the name of an environment variable (letters, "
            "digits, '_'; not a digit first) that holds the token, never the token itself"
        )
    return value


class RemoteRewardConfig(Section):
    """A remote verifier: a user's HTTP service that scores batches of responses (README,
    "Remote verifiers"; the protocol is in verlite/rewards/remote.py)."""

    url: Annotated[str | None, AfterValidator(_service_url)] = Field(
        None,
        description="http(s) URL the responses are POSTed to, as JSON batches; its scores are "
        "the reward source 'remote' of reward.combine (not with rollout.multi_turn.env). None: "
        "no remote verifier. "
        "Probed with one request of one response before Ray starts.",
    )
    batch_size: PositiveInt = Field(64, description="Responses per request.")
    concurrency: Annotated[int, Field(gt=0, le=256)] = Field(
        4, description="Requests in flight at once."
    )
    timeout_s: float = Field(
        30.0,
        gt=0.0,
        description="Most seconds one request may take, from connecting to the end of its "
        "reply; a slower one is retried.",
    )
    max_retries: Annotated[int, Field(ge=0, le=100)] = Field(
        3,
        description="Retries of a request that failed in a way a retry can mend (no "
        "connection, a timeout, HTTP 5xx or 429); then the run stops naming the batch. A "
        "malformed reply, another 4xx or a score outside [0, 1] stops it at once.",
    )
    retry_backoff_s: float = Field(
        1.0,
        ge=0.0,
        le=600.0,
        description="Wait before the first retry of a request; it doubles with each retry.",
    )
    auth_env: Annotated[str | None, AfterValidator(_environment_name)] = Field(
        None,
        description="Name of the environment variable that holds a bearer token for the "
        "service (sent as 'Authorization: Bearer ...'; never logged). None sends none. Over "
        "plain http only to a service on this machine (loopback).",
    )

    @model_validator(mode="after")
    def _token_not_in_cleartext(self) -> RemoteRewardConfig:
        if self.auth_env is None or self.url is None:
            return self
        parts = urlsplit(self.url)
        if parts.scheme == "http" and not _is_loopback_host(parts.hostname or ""):
            raise ValueError(
                f"reward.remote.auth_env={self.auth_env!r} with an http:// URL to "
                f"{parts.hostname}: the token would cross the network in cleartext; use https "
                "(plain http is for a service on this machine: 127.0.0.1, localhost)"
            )
        return self


def _is_loopback_host(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class RewardModelConfig(Section):
    """A reward model: a Hugging Face sequence-classification model scored by a worker group
    of its own (role ``reward``), placed like the critic."""

    path: PathStr | None = Field(
        None,
        description="Local Hugging Face sequence-classification model directory (weights, "
        "config.json with one label, its own tokenizer); it reads prompt + response as text "
        "and scores sigmoid(logit). None: no reward model.",
    )
    workers_per_node: PositiveInt | None = Field(
        None,
        description="Reward-model workers on each node (over trainer.nnodes nodes; CPUs and "
        "GPUs per worker as trainer's, shared with roles of the same count under "
        "trainer.placement=colocate); None uses trainer.workers_per_node.",
    )
    micro_batch_size_per_worker: PositiveInt = Field(
        16, description="Responses one reward-model worker scores per forward pass."
    )
    max_length: PositiveInt | None = Field(
        None,
        description="Most reward-model tokens of one prompt + response; a longer text keeps its "
        "last tokens (the response's end, which the score is read at; reward/model/truncated "
        "counts them). None: the model's max_position_embeddings.",
    )


class RewardConfig(Section):
    """How responses are scored: every reward, built-in or user, returns a finite score in [0, 1]."""

    fn: str | None = Field(
        None,
        description="A registered reward name or 'package.module:function'; None uses the task's reward "
        "(exact match of the answer for prompt files).",
    )
    timeout_s: float = Field(
        30.0,
        gt=0.0,
        description="Longest one call of the reward function may take; a slower call stops the "
        "run with an error naming the response.",
    )
    remote: RemoteRewardConfig = Field(
        default_factory=RemoteRewardConfig,
        description="A remote verifier: a user's HTTP service that scores the responses.",
    )
    model: RewardModelConfig = Field(
        default_factory=RewardModelConfig,
        description="A reward model scored by a worker group of its own.",
    )
    combine: dict[str, float] | None = Field(
        None,
        description="The step's score as a weighted sum of reward sources, e.g. {fn: 0.5, model: "
        "0.5}: fn (the rule-based reward: reward.fn or the task's), model (reward.model) and "
        "remote (reward.remote), each of the last two named when set; weights >= 0, not all 0; "
        "a source of weight 0 is scored and logged (reward/<source>/mean) without counting. "
        "None: the one of model and remote that is set, with weight 1, else {fn: 1}.",
    )

    @model_validator(mode="before")
    @classmethod
    def _default_combine(cls, data: Any) -> Any:
        """An unset ``combine`` is resolved at load: the reward model alone when one is set."""
        if not isinstance(data, Mapping):
            return data
        combine = data.get("combine")
        if isinstance(combine, Mapping) and any(
            ":" in str(key) and value is None for key, value in combine.items()
        ):
            raise ValueError(
                f"reward.combine={shown(dict(combine))}: YAML reads 'fn:0.5' as one key; write "
                "each entry with a space after the colon, e.g. '{fn: 0.5, model: 0.5}'"
            )
        if combine is not None:
            return data
        model, remote = _as_dict(data.get("model")), _as_dict(data.get("remote"))
        chosen = [
            source
            for source, section, key in (("model", model, "path"), ("remote", remote, "url"))
            if isinstance(section, dict) and section.get(key) is not None
        ]
        if len(chosen) > 1:
            return data  # the after-validator asks for combine
        return {**data, "combine": {chosen[0] if chosen else "fn": 1.0}}

    @property
    def sources(self) -> tuple[str, ...]:
        """The reward sources this config sets up: what ``combine`` may weigh."""
        return (
            "fn",
            *(("model",) if self.model.path is not None else ()),
            *(("remote",) if self.remote.url is not None else ()),
        )

    @model_validator(mode="after")
    def _check_combine(self) -> RewardConfig:
        if self.combine is None:  # left unset with both a reward model and a remote verifier
            raise ValueError(
                "reward.model.path and reward.remote.url are both set: give reward.combine, "
                "e.g. {model: 0.5, remote: 0.5}"
            )
        unset_field = {"model": "reward.model.path", "remote": "reward.remote.url"}
        for source, weight in self.combine.items():
            if source not in self.sources:
                unset = f" ({unset_field[source]} is unset)" if source in unset_field else ""
                raise ValueError(
                    f"reward.combine.{source}: not a configured reward source{unset}; "
                    f"configured: {', '.join(self.sources)}"
                )
            if weight < 0:
                raise ValueError(f"reward.combine.{source}={weight:g}: weights must be >= 0")
        for source in self.sources[1:]:
            if source not in self.combine:
                raise ValueError(
                    f"reward.combine={self.combine} leaves out {source}, but "
                    f"{unset_field[source]} is set: it would be set up for nothing; add "
                    f"{source} (weight 0 only logs it) or unset {unset_field[source]}"
                )
        if self.fn is not None and "fn" not in self.combine:
            raise ValueError(
                f"reward.fn={self.fn!r} is set, but reward.combine={self.combine} leaves out fn: "
                "it would score nothing; add fn to reward.combine or unset reward.fn"
            )
        if not any(self.combine.values()):
            raise ValueError(
                f"reward.combine={self.combine}: no source has a weight > 0; give at least one"
            )
        return self


class WandbConfig(Section):
    """Weights & Biases (``trainer.loggers: [wandb]``): where the run is recorded."""

    project: NonEmptyStr = Field("verlite", description="W&B project of the run.")
    entity: NonEmptyStr | None = Field(
        None, description="W&B team or user; None uses the account's default entity."
    )
    run_name: NonEmptyStr | None = Field(
        None, description="Display name of the run; None uses the output folder's name."
    )
    mode: Literal["offline", "online"] = Field(
        "offline",
        description="offline writes the run under <output_dir>/wandb, for `wandb sync` later; "
        "online sends it as it goes (needs WANDB_API_KEY or `wandb login`).",
    )


class TrainerConfig(Section):
    """The run: steps, cluster layout, validation, checkpoints, logging."""

    total_steps: PositiveInt = Field(20, description="Training steps (one batch of prompts each).")
    output_dir: PathStr = Field(
        "outputs/run",
        description="Folder for metrics, checkpoints, workers.json and the exported model.",
    )
    seed: NonNegativeInt = Field(0, description="Seed of data, sampling and initialization.")
    nnodes: PositiveInt = Field(1, description="Nodes each worker group spans.")
    workers_per_node: PositiveInt = Field(
        1, description="Workers per node for every role without its own setting."
    )
    placement: Literal["colocate", "split"] = Field(
        "colocate",
        description="colocate: roles share bundles with fractional resources; split: a pool per role.",
    )
    max_staleness: NonNegativeInt = Field(
        0,
        description="With rollout.placement=split: how many weight versions a batch may lag the "
        "actor that trains on it; 0 is on-policy, k >= 1 generates the next batches while the "
        "actor trains.",
    )
    cpus_per_worker: float = Field(1.0, gt=0.0, description="CPUs of one worker bundle.")
    gpus_per_worker: float = Field(0.0, ge=0.0, description="GPUs of one worker bundle.")
    ray_address: NonEmptyStr | None = Field(
        None, description="Ray cluster to connect to; None starts an embedded local Ray."
    )
    resource_timeout_s: float = Field(
        60.0,
        gt=0.0,
        description="Fail if the workers cannot be placed within this many seconds, at the start "
        "and after each restart (the wait for a replacement node).",
    )
    max_restarts: int = Field(
        0,
        ge=0,
        le=1000,
        description="How many times a run whose worker process or node was lost starts its "
        "groups again and resumes from its latest checkpoint (the first step without one); "
        "0 stops the run at the first loss. What a worker raises, and the driver's own "
        "errors, never restart.",
    )
    torch_threads_per_worker: PositiveInt = Field(
        1, description="torch threads of each CPU worker."
    )
    val_freq: NonNegativeInt = Field(
        5, description="Validate every this many steps (and at the end); 0 never."
    )
    save_freq: NonNegativeInt = Field(
        0, description="Checkpoint every this many steps (and at the end); 0 never."
    )
    max_checkpoints: PositiveInt = Field(3, description="Checkpoints kept; older ones are deleted.")
    overwrite: bool = Field(
        False,
        description="A non-empty output_dir that this run does not continue is refused; true moves "
        "its contents aside (to <output_dir>.replaced-<UTC time>) and starts a fresh run there.",
    )
    resume: PathStr = Field(
        "auto", description="'auto' (latest complete checkpoint), 'disable', or a checkpoint path."
    )
    loggers: Annotated[
        tuple[Literal["console", "jsonl", "logline", "tensorboard", "mlflow", "wandb"], ...],
        AsList,
    ] = Field(
        ("console", "jsonl"),
        description="Metric sinks: console (progress line), jsonl (<output_dir>/metrics.jsonl), "
        "logline (one marked JSON line per step on stdout, read back by `verlite metrics --job`), "
        "tensorboard, mlflow, wandb (see trainer.wandb).",
    )
    mlflow_tracking_uri: NonEmptyStr | None = Field(
        None, description="MLflow tracking URI; None uses a file store in output_dir."
    )
    wandb: WandbConfig = Field(
        default_factory=WandbConfig, description="Weights & Biases, with 'wandb' in loggers."
    )
    max_consecutive_skips: PositiveInt = Field(
        3,
        description="Stop after this many consecutive updates skipped for a non-finite loss or gradient.",
    )


@dataclass(frozen=True)
class RoleSizes:
    """Batch sizes of one role, derived once from the config."""

    dp_size: int
    mini_batch_size_per_worker: int
    # Optimizer steps of one training step, and of the whole run (the LR schedule's length).
    num_mini_batches: int
    total_updates: int


class Config(Section):
    """A whole run. Load with :func:`load_config`."""

    # The raw mapping it was loaded from: overrides apply to it, so that fields defaulting to
    # other fields follow them (``load_config(cfg, overrides)``).
    _source: dict[str, Any] | None = PrivateAttr(None)

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Config:
        """A copy; one with ``update`` forgets the mapping it was loaded from, which no
        longer describes it."""
        copy = super().model_copy(update=update, deep=deep)
        if update:
            copy._source = None
        return copy

    model: ModelConfig = Field(default_factory=ModelConfig, description="The policy model.")
    data: DataConfig = Field(description="Prompts.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Generation.")
    actor: ActorConfig = Field(default_factory=ActorConfig, description="Policy training.")
    critic: CriticConfig = Field(
        default_factory=CriticConfig, description="Value-model training (GAE only)."
    )
    algorithm: AlgorithmConfig = Field(
        default_factory=AlgorithmConfig, description="Advantages and KL-in-reward."
    )
    reward: RewardConfig = Field(default_factory=RewardConfig, description="Scoring.")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="The run.")

    @model_validator(mode="before")
    @classmethod
    def _fill_inherited(cls, data: Any) -> Any:
        """Resolve fields that default to other fields, before validation, on the raw mapping."""
        if not isinstance(data, Mapping):
            return data
        data = dict(data)
        sections = {
            name: _as_dict(data.get(name)) for name in ("actor", "critic", "trainer", "rollout")
        }
        rollout, trainer = sections["rollout"], sections["trainer"]
        if isinstance(rollout, dict):
            for key in ("workers_per_node", "cpus_per_worker", "gpus_per_worker"):
                value = _get(trainer, key, TrainerConfig)
                # An invalid trainer value is reported once, on the trainer.
                if rollout.get(key) is None and _is_valid(TrainerConfig, key, value):
                    rollout[key] = value
            data["rollout"] = rollout
        reward = _as_dict(data.get("reward"))
        reward_model = _as_dict(reward.get("model")) if isinstance(reward, dict) else None
        if isinstance(reward_model, dict) and reward_model.get("workers_per_node") is None:
            value = _get(trainer, "workers_per_node", TrainerConfig)
            if _is_valid(TrainerConfig, "workers_per_node", value):
                data["reward"] = {**reward, "model": {**reward_model, "workers_per_node": value}}
        actor, critic = sections["actor"], sections["critic"]
        if isinstance(actor, dict) and isinstance(critic, dict):
            trainer_wpn = _get(sections["trainer"], "workers_per_node", TrainerConfig)
            for role in (actor, critic):
                if role.get("workers_per_node") is None:
                    role["workers_per_node"] = trainer_wpn
            for key in ("loss_agg_mode", "loss_scale_factor"):
                value = actor.get(key, ActorConfig.model_fields[key].default)
                # An invalid actor value is reported once, on the actor, not again on the critic.
                if critic.get(key) is None and _is_valid(ActorConfig, key, value):
                    critic[key] = value
            for role in (actor, critic):  # each role's own mode: the critic may set its own
                if (
                    role.get("loss_agg_mode") == "seq-mean-token-sum-norm"
                    and role.get("loss_scale_factor") is None
                ):
                    role["loss_scale_factor"] = _get(
                        sections["rollout"], "max_response_length", RolloutConfig
                    )
            data.update(actor=actor, critic=critic)
        return data

    @property
    def use_critic(self) -> bool:
        return self.algorithm.adv_estimator in ESTIMATORS_NEEDING_CRITIC

    @property
    def use_reference(self) -> bool:
        """A frozen copy of the initial policy lives in each actor worker when a KL term is on."""
        return self.actor.use_kl_loss or self.algorithm.use_kl_in_reward

    @property
    def roles(self) -> list[Literal["actor", "critic"]]:
        """The worker groups a run has."""
        return ["actor", "critic"] if self.use_critic else ["actor"]

    @property
    def sequences_per_step(self) -> int:
        return self.data.train_batch_size * self.rollout.n

    @property
    def response_width(self) -> int:
        """Tokens of a row's response area: one response, or with a multi-turn environment
        every turn and observation of a trajectory."""
        multi_turn = self.rollout.multi_turn
        if multi_turn.env is not None and multi_turn.max_total_length is not None:
            return multi_turn.max_total_length - self.data.max_prompt_length
        return self.rollout.max_response_length

    @property
    def _longest_sequence_fields(self) -> str:
        if self.response_width != self.rollout.max_response_length:
            return "rollout.multi_turn.max_total_length"
        return "data.max_prompt_length + rollout.max_response_length"

    @property
    def max_sequence_length(self) -> int:
        """The longest row of a step: a full prompt and a full response area (the models'
        position range, and the least a token budget must hold)."""
        return self.data.max_prompt_length + self.response_width

    def role_sizes(self, role: Literal["actor", "critic"]) -> RoleSizes:
        cfg: WorkerRoleConfig = getattr(self, role)
        dp = self.trainer.nnodes * (cfg.workers_per_node or self.trainer.workers_per_node)
        num_mini_batches = self.sequences_per_step // cfg.ppo_mini_batch_size
        return RoleSizes(
            dp_size=dp,
            mini_batch_size_per_worker=cfg.ppo_mini_batch_size // dp,
            num_mini_batches=num_mini_batches,
            total_updates=self.trainer.total_steps * cfg.ppo_epochs * num_mini_batches,
        )

    @model_validator(mode="after")
    def _cross_field(self) -> Config:
        if (
            self.algorithm.adv_estimator in ("grpo", "rloo", "reinforce_plus_plus_baseline")
            and self.rollout.n < 2
        ):
            raise ValueError(
                f"algorithm.adv_estimator={self.algorithm.adv_estimator} compares samples of one prompt: "
                f"rollout.n must be >= 2, got {self.rollout.n}"
            )
        for role in self.roles:
            self._check_role_sizes(role)
        if self.trainer.max_staleness > 0 and self.rollout.placement == "colocated":
            raise ValueError(
                f"trainer.max_staleness={self.trainer.max_staleness} generates while the actor "
                "trains, which needs rollout.placement=split (colocated actors generate and "
                "train in turn); set rollout.placement=split or trainer.max_staleness=0"
            )
        if self.algorithm.rollout_correction == "tis" and self.rollout.temperature == 0:
            raise ValueError(
                "algorithm.rollout_correction=tis weighs tokens by how likely the sampler made "
                "them, but rollout.temperature=0 samples greedily (no distribution); use "
                "rollout_correction=none or a temperature > 0"
            )
        self._check_multi_turn()
        self._check_scored_by_environment()
        rollout_workers = self.trainer.nnodes * (self.rollout.workers_per_node or 1)
        if self.rollout.placement == "split" and rollout_workers > self.sequences_per_step:
            raise ValueError(
                f"{rollout_workers} rollout workers (trainer.nnodes={self.trainer.nnodes} * "
                f"rollout.workers_per_node={self.rollout.workers_per_node}) outnumber the "
                f"{self.sequences_per_step} sequences of a step (data.train_batch_size * "
                "rollout.n); some would have nothing to generate"
            )
        return self

    def _check_scored_by_environment(self) -> None:
        """A multi-turn run is scored by its environment (the reward of a trajectory's last
        turn): a reward source, or a setting of the reward function, would be ignored or set
        up for nothing beside it."""
        env = self.rollout.multi_turn.env
        if env is None:
            return
        reward = self.reward
        settings = (  # (field, whether set, how the message shows it)
            ("reward.model.path", reward.model.path is not None, f"={reward.model.path!r}"),
            ("reward.remote.url", reward.remote.url is not None, ""),  # may hold a credential
            ("reward.fn", reward.fn is not None, f"={reward.fn!r}"),
            # {fn: 1} is what an unset combine resolves to.
            ("reward.combine", reward.combine != {"fn": 1.0}, f"={reward.combine}"),
            (
                "reward.timeout_s",
                reward.timeout_s != RewardConfig.model_fields["timeout_s"].default,
                f"={reward.timeout_s:g}",
            ),
        )
        for field, is_set, value_text in settings:
            if is_set:
                raise ValueError(
                    f"{field}{value_text} with rollout.multi_turn.env={env!r}: a multi-turn run "
                    "is scored by its environment; unset one of them"
                )

    def _check_multi_turn(self) -> None:
        multi_turn = self.rollout.multi_turn
        if multi_turn.env is None:
            return
        one_turn = self.data.max_prompt_length + self.rollout.max_response_length
        if multi_turn.max_total_length is None:
            raise ValueError(
                f"rollout.multi_turn.env={multi_turn.env!r} needs rollout.multi_turn."
                f"max_total_length (the most tokens of a trajectory, >= {one_turn})"
            )
        if self.rollout.placement == "colocated" and self.actor.strategy == "fsdp":
            raise ValueError(
                "rollout.multi_turn with an FSDP actor that generates (rollout.placement="
                "colocated) is not supported: its ranks would take different numbers of turns "
                "in lockstep collectives; use rollout.placement=split or actor.strategy=ddp"
            )
        if multi_turn.max_total_length < one_turn:
            raise ValueError(
                f"rollout.multi_turn.max_total_length={multi_turn.max_total_length} cannot hold "
                f"the prompt and one turn: data.max_prompt_length + rollout.max_response_length "
                f"= {one_turn}"
            )

    def _check_role_sizes(self, role: Literal["actor", "critic"]) -> None:
        cfg: WorkerRoleConfig = getattr(self, role)
        sizes = self.role_sizes(role)
        seqs = self.sequences_per_step
        mini = f"{role}.ppo_mini_batch_size={cfg.ppo_mini_batch_size}"
        if seqs % cfg.ppo_mini_batch_size:
            raise ValueError(
                f"{mini} must divide the sequences per step, data.train_batch_size * rollout.n = "
                f"{self.data.train_batch_size} * {self.rollout.n} = {seqs}"
            )
        if cfg.ppo_mini_batch_size % sizes.dp_size:
            raise ValueError(
                f"{mini} must be divisible by the {role}'s {sizes.dp_size} workers "
                f"(trainer.nnodes={self.trainer.nnodes} * {role}.workers_per_node={cfg.workers_per_node})"
            )
        if cfg.strategy == "none" and sizes.dp_size > 1:
            raise ValueError(
                f"{role}.strategy=none runs one worker, but {role} has {sizes.dp_size} workers; use ddp or fsdp"
            )
        if cfg.use_dynamic_bsz:
            longest = self.max_sequence_length
            if cfg.max_token_len_per_worker is None:
                raise ValueError(
                    f"{role}.use_dynamic_bsz=true needs {role}.max_token_len_per_worker (>= {longest})"
                )
            if cfg.max_token_len_per_worker < longest:
                raise ValueError(
                    f"{role}.max_token_len_per_worker={cfg.max_token_len_per_worker} is below the longest sequence, "
                    f"{self._longest_sequence_fields} = {longest}"
                )
            return
        micro = f"{role}.micro_batch_size_per_worker={cfg.micro_batch_size_per_worker}"
        per_worker = sizes.mini_batch_size_per_worker
        if cfg.micro_batch_size_per_worker > per_worker:
            raise ValueError(
                f"{micro} is larger than the per-worker mini-batch {per_worker} ({mini} / {sizes.dp_size} workers)"
            )
        if per_worker % cfg.micro_batch_size_per_worker:
            # Every rank must run the same number of micro-batches: FSDP collectives pair up
            # forward and backward calls across ranks.
            raise ValueError(
                f"{mini} must be divisible by micro_batch_size_per_worker * workers = "
                f"{cfg.micro_batch_size_per_worker} * {sizes.dp_size}"
            )


def _as_dict(section: Any) -> Any:
    if section is None:
        return {}
    if isinstance(section, BaseModel):
        return section.model_dump()
    return dict(section) if isinstance(section, Mapping) else section


def _is_valid(model: type[BaseModel], key: str, value: Any) -> bool:
    field = model.model_fields[key]
    try:
        TypeAdapter(Annotated[field.annotation, *field.metadata]).validate_python(
            value, strict=model.model_config.get("strict")
        )
    except ValidationError:
        return False
    return True


def _get(section: Any, key: str, model: type[BaseModel]) -> Any:
    if isinstance(section, dict) and section.get(key) is not None:
        return section[key]
    return model.model_fields[key].default
