"""The training sections: the actor and the critic (what they share: parallelism, batching,
loss aggregation, the optimizer), LoRA adapters, and the algorithm (advantages, KL)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import AfterValidator, Field

from verlite.config.fields import (
    AsList,
    Distinct,
    Needs,
    NonEmptyStr,
    NonNegativeInt,
    PositiveInt,
    Section,
    fields_but,
)
from verlite.core.advantages import (
    ADV_ESTIMATORS,
    ESTIMATOR_SETTINGS,
    ESTIMATORS_NEEDING_CRITIC,
    GROUP_BASELINES,
    SETTINGS,
)
from verlite.core.losses import KL_KINDS, LOSS_AGG_MODES, POLICY_LOSSES

if TYPE_CHECKING:
    from verlite.config.schema import Config


# The roles that train a model of their own (the policy, the value model): each has a section
# of this module, an update and its layouts.
TrainedRole = Literal["actor", "critic"]


def _one_of(allowed: Sequence[str], what: str) -> AfterValidator:
    def check(value: str) -> str:
        if value not in allowed:
            raise ValueError(f"unknown {what}; allowed: {', '.join(allowed)}")
        return value

    return AfterValidator(check)


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
Beta = Annotated[float, Field(ge=0.0, lt=1.0)]


class OptimConfig(Section):
    """Optimizer with an optional warm-up and cosine decay."""

    name: Literal["adamw", "sgd"] = Field(
        "adamw",
        description="adamw, or plain sgd (no momentum; the invariance audit uses it, see docs/invariance-audit.md).",
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
        description="Run each micro-batch as one packed row of its sequences' real tokens (no padding), attention confined to each sequence; training and inference passes alike. A sliding-window model packs only when its window is at least the longest sequence (data.max_prompt_length + rollout.max_response_length, or rollout.multi_turn.max_total_length).",
    )
    loss_agg_mode: LossAggMode = Field(
        "token-mean", description=f"How token losses aggregate: {', '.join(LOSS_AGG_MODES)}."
    )
    loss_scale_factor: float | None = Field(
        None,
        gt=0.0,
        description="Constant divisor of seq-mean-token-sum-norm; None uses rollout.max_response_length, with multi-turn rollouts one turn's limit (verl's default, the response area's width, is rollout.multi_turn.max_total_length - data.max_prompt_length: set that to normalize by the most tokens a trajectory holds).",
    )
    optim: OptimConfig = Field(
        default_factory=OptimConfig, description="Optimizer and LR schedule."
    )
    gradient_checkpointing: bool = Field(
        False,
        description="Activation checkpointing: keep only each decoder layer's input during the training forward and recompute the layer in backward (less memory, one more forward of compute); the same gradients. Log-prob and value passes are unaffected.",
    )
    offload: Literal["none", "optimizer", "all"] = Field(
        "none",
        description="Keep training state on the CPU: optimizer (its state lives on the CPU; the step goes one parameter at a time, that parameter's state on the device for its own step; any strategy), or all (FSDP2's CPU offload: parameters, gradients and optimizer state on the CPU, the optimizer steps there; needs strategy=fsdp). With the actor, not none also keeps the reference model on the CPU except during its log-prob pass.",
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
    target_modules: Annotated[tuple[NonEmptyStr, ...], AsList, Distinct] = Field(
        LORA_DEFAULT_TARGETS,
        min_length=1,
        description="Names of the linear layers that get adapters, matched as the last part "
        "of a module's name (peft's target_modules); each must name a layer of the model, once. "
        "Add lm_head where the base's head is untrained (the built-in model; a run without it "
        "says so at start-up): docs/lora.md.",
    )


class ActorConfig(WorkerRoleConfig):
    """The policy: PPO-family losses, entropy bonus, KL loss to the reference."""

    policy_loss: PolicyLossMode = Field(
        "vanilla",
        description=f"Policy loss: {', '.join(sorted(POLICY_LOSSES))}. vanilla: PPO's clipped "
        "token ratio with dual-clip; gspo: GSPO's sequence ratio (the geometric mean of its token "
        "ratios) clipped, aggregated by actor.loss_agg_mode as every loss is (the paper, and verl, "
        "which imposes it, use seq-mean-token-mean, and clip ranges near 3e-4 / 4e-4; token-mean "
        "weighs each response by its length); reinforce: -advantage * log-prob, no ratio (exact "
        "on-policy only).",
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


class DynamicSamplingConfig(Section):
    """DAPO's dynamic sampling (docs/dapo.md): train only on groups whose scores vary."""

    enable: bool = Field(
        False,
        description="Drop the groups whose rollout.n scores are all equal (zero advantage under a "
        "group baseline) and draw more prompts for the step until data.train_batch_size groups "
        "vary; the step trains on those alone. Needs a group baseline (adv_estimator grpo, rloo "
        "or reinforce_plus_plus_baseline), rollout.max_staleness=0 and "
        "rollout.randomness=per_sample.",
    )
    max_draws: PositiveInt = Field(
        4,
        description="Most batches of data.train_batch_size prompts drawn for one step, the first "
        "included. When they hold fewer varied groups than a step needs, the step is topped up "
        "with tied groups in draw order (dynamic_sampling/filled_groups) and a line says so.",
    )


class OverlongConfig(Section):
    """DAPO's overlong shaping (docs/dapo.md) of responses that reach the length limit."""

    buffer: NonNegativeInt = Field(
        0,
        description="Soft overlong penalty: over the last `buffer` tokens before the response "
        "limit (rollout.max_response_length, or the multi-turn response area), a response's "
        "score falls linearly, to -penalty at the limit; 0: off.",
    )
    penalty: float = Field(
        1.0, gt=0.0, description="The soft overlong penalty at the limit (DAPO's factor)."
    )
    filter: bool = Field(
        False,
        description="Leave responses that reach the limit (and multi-turn trajectories cut "
        "short) out of the policy loss: their tokens and sequences are not counted; their scores "
        "still count in their group's baseline and the critic still learns from them.",
    )


class AlgorithmConfig(Section):
    """Advantage estimation and KL-in-reward."""

    adv_estimator: AdvEstimator = Field(
        "gae", description=f"Advantage estimator: {', '.join(sorted(ADV_ESTIMATORS))}."
    )
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="Discount factor.")
    lam: float = Field(1.0, ge=0.0, le=1.0, description="GAE lambda.")
    norm_adv_by_std: bool = Field(
        True,
        description="GRPO: divide by the group std; false gives Dr. GRPO's advantage, which "
        "the paper pairs with actor.loss_agg_mode=seq-mean-token-sum-norm (no per-response "
        "length normalization; seq-mean-token-mean would keep it).",
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
        "the sampler's own where they must agree (rollout.max_staleness=0, model.precision fp32, "
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
    dynamic_sampling: DynamicSamplingConfig = Field(
        default_factory=DynamicSamplingConfig,
        description="DAPO's dynamic sampling: more prompts until enough groups vary.",
    )
    overlong: OverlongConfig = Field(
        default_factory=OverlongConfig,
        description="DAPO's overlong shaping: a soft penalty near the limit, or filtering.",
    )


def _scales_a_loss(cfg: Config, role: TrainedRole) -> bool:
    """Whether ``role``'s loss_scale_factor scales a loss: its own under
    seq-mean-token-sum-norm, and the actor's the critic's too when the critic takes it
    (config.defaults: a critic that sets none, or null, takes the actor's; one that sets the
    same value leaves the actor's unnamed, which is harmless)."""
    if getattr(cfg, role).loss_agg_mode == "seq-mean-token-sum-norm":
        return True
    return (
        role == "actor"
        and cfg.use_critic
        and cfg.critic.loss_agg_mode == "seq-mean-token-sum-norm"
        and cfg.critic.loss_scale_factor == cfg.actor.loss_scale_factor
    )


def _role_needs(role: TrainedRole) -> tuple[Needs, ...]:
    """What a role's settings need, the same for the actor and the critic."""
    return (
        Needs(
            (f"{role}.max_token_len_per_worker",),
            unless=f"{role}.use_dynamic_bsz=true",
            active=lambda cfg: getattr(cfg, role).use_dynamic_bsz,
            example={f"{role}.use_dynamic_bsz": True, f"{role}.max_token_len_per_worker": 512},
        ),
        Needs(
            (f"{role}.micro_batch_size_per_worker",),
            unless=f"{role}.use_dynamic_bsz=false (a token budget cuts the micro-batches)",
            active=lambda cfg: not getattr(cfg, role).use_dynamic_bsz,
            example={f"{role}.use_dynamic_bsz": False},
        ),
        Needs(
            (f"{role}.loss_scale_factor",),
            unless=f"{role}.loss_agg_mode=seq-mean-token-sum-norm"
            + (
                " (or the critic's, which takes it unless it sets its own)"
                if role == "actor"
                else ""
            ),
            active=lambda cfg: _scales_a_loss(cfg, role),
            example={f"{role}.loss_agg_mode": "seq-mean-token-sum-norm"},
        ),
        Needs(
            (f"{role}.optim.min_lr_ratio",),
            unless=f"{role}.optim.schedule=cosine",
            active=lambda cfg: getattr(cfg, role).optim.schedule == "cosine",
            example={f"{role}.optim.schedule": "cosine"},
        ),
        Needs(
            (f"{role}.optim.betas",),
            unless=f"{role}.optim.name=adamw",
            active=lambda cfg: getattr(cfg, role).optim.name == "adamw",
            example={f"{role}.optim.name": "adamw"},
        ),
    )


def _estimator_reads(setting: str) -> Needs:
    """``algorithm.<setting>``, which only the estimators that read it use."""
    readers = sorted(name for name in ADV_ESTIMATORS if setting in ESTIMATOR_SETTINGS[name])
    return Needs(
        (f"algorithm.{setting}",),
        unless=f"algorithm.adv_estimator reads it ({', '.join(readers)})",
        active=lambda cfg: setting in ESTIMATOR_SETTINGS[cfg.algorithm.adv_estimator],
        example={
            "algorithm.adv_estimator": readers[0],
            **({"rollout.n": 2} if readers[0] in GROUP_BASELINES else {}),
        },
    )


# Settings of these sections that only a feature makes count (verlite.config.inert); the
# critic's first, so that a critic setting of a run without a critic is named for that.
NEEDS = (
    Needs(
        ("critic",),
        unless=f"algorithm.adv_estimator trains a critic ({', '.join(sorted(ESTIMATORS_NEEDING_CRITIC))})",
        active=lambda cfg: cfg.use_critic,
        example={"algorithm.adv_estimator": sorted(ESTIMATORS_NEEDING_CRITIC)[0]},
    ),
    *_role_needs("actor"),
    *_role_needs("critic"),
    Needs(
        ("actor.kl_loss_coef", "actor.kl_loss_type"),
        unless="actor.use_kl_loss=true",
        active=lambda cfg: cfg.actor.use_kl_loss,
        example={"actor.use_kl_loss": True},
    ),
    Needs(
        ("actor.clip_ratio_low", "actor.clip_ratio_high"),
        unless="actor.policy_loss clips a ratio (not reinforce)",
        active=lambda cfg: cfg.actor.policy_loss != "reinforce",
        example={"actor.policy_loss": "vanilla"},
    ),
    Needs(
        ("actor.clip_ratio_c",),
        unless="actor.policy_loss=vanilla (dual-clip)",
        active=lambda cfg: cfg.actor.policy_loss == "vanilla",
        example={"actor.policy_loss": "vanilla"},
    ),
    Needs(
        fields_but(LoraConfig, "actor.lora", "rank"),
        unless="actor.lora.rank > 0",
        active=lambda cfg: cfg.actor.lora.rank > 0,
        example={"actor.lora.rank": 4},
    ),
    Needs(
        ("algorithm.kl_penalty", "algorithm.kl_ctrl"),
        unless="algorithm.use_kl_in_reward=true",
        active=lambda cfg: cfg.algorithm.use_kl_in_reward,
        example={"algorithm.use_kl_in_reward": True},
    ),
    Needs(
        ("algorithm.kl_ctrl.target_kl", "algorithm.kl_ctrl.horizon"),
        unless="algorithm.kl_ctrl.type=adaptive",
        active=lambda cfg: cfg.algorithm.kl_ctrl.type == "adaptive",
        example={"algorithm.use_kl_in_reward": True, "algorithm.kl_ctrl.type": "adaptive"},
    ),
    *(_estimator_reads(setting) for setting in sorted(SETTINGS)),
    Needs(
        ("algorithm.rollout_is_cap",),
        unless="algorithm.rollout_correction=tis",
        active=lambda cfg: cfg.algorithm.rollout_correction == "tis",
        example={"algorithm.rollout_correction": "tis", "rollout.temperature": 1.0},
    ),
    Needs(
        ("algorithm.dynamic_sampling.max_draws",),
        unless="algorithm.dynamic_sampling.enable=true",
        active=lambda cfg: cfg.algorithm.dynamic_sampling.enable,
        example={
            "algorithm.dynamic_sampling.enable": True,
            "algorithm.adv_estimator": "grpo",
            "rollout.n": 2,
        },
    ),
    Needs(
        ("algorithm.overlong.penalty",),
        unless="algorithm.overlong.buffer > 0",
        active=lambda cfg: cfg.algorithm.overlong.buffer > 0,
        example={"algorithm.overlong.buffer": 2},
    ),
)
