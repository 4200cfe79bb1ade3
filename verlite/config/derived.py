"""What a config decides beyond its fields, computed from it alone and only here: the worker
groups a run has, the sizes of a step and of each role's batches (:class:`RoleSizes`), the
longest sequence, the numeric precision, and whether the actor recomputes the old log-probs."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from verlite.core.advantages import ESTIMATORS_NEEDING_CRITIC
from verlite.core.sharding import fsdp_shards

if TYPE_CHECKING:
    from verlite.config.schema import Config
    from verlite.config.sections_inputs import DataConfig, ModelConfig
    from verlite.config.sections_reward import RewardConfig
    from verlite.config.sections_rollout import RolloutConfig
    from verlite.config.sections_trainer import TrainerConfig
    from verlite.config.sections_training import (
        ActorConfig,
        AlgorithmConfig,
        CriticConfig,
        TrainedRole,
        WorkerRoleConfig,
    )


@dataclass(frozen=True)
class RoleSizes:
    """Batch sizes of one role, derived once from the config."""

    dp_size: int
    mini_batch_size_per_worker: int
    # Optimizer steps of one training step, and of the whole run (the LR schedule's length).
    num_mini_batches: int
    total_updates: int


class Derived:
    """The derived values as properties of :class:`~verlite.config.Config` (mixed into it)."""

    if TYPE_CHECKING:
        data: DataConfig
        model: ModelConfig
        rollout: RolloutConfig
        actor: ActorConfig
        critic: CriticConfig
        algorithm: AlgorithmConfig
        reward: RewardConfig
        trainer: TrainerConfig

    @property
    def use_critic(self) -> bool:
        return self.algorithm.adv_estimator in ESTIMATORS_NEEDING_CRITIC

    @property
    def use_reference(self) -> bool:
        """A frozen copy of the initial policy lives in each actor worker when a KL term is on."""
        return self.actor.use_kl_loss or self.algorithm.use_kl_in_reward

    @property
    def roles(self) -> list[TrainedRole]:
        """The worker groups a run has."""
        return ["actor", "critic"] if self.use_critic else ["actor"]

    @property
    def trained_workers(self) -> dict[str, int]:
        """Each worker group a run trains, and its workers (ranks)."""
        return {role: self.role_sizes(role).dp_size for role in self.roles}

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
    def prompt_bos(self) -> bool:
        """Whether a prompt's tokens start with the tokenizer's BOS: not under a chat template,
        whose rendered text carries its own beginning."""
        return not self.data.chat_template

    @property
    def max_sequence_length(self) -> int:
        """The longest row of a step: a full prompt and a full response area (the models'
        position range, and the least a token budget must hold)."""
        return self.data.max_prompt_length + self.response_width

    @property
    def cache_positions(self) -> int:
        """The most positions one generation's KV cache spans: a prompt and a response; in a
        multi-turn run, a turn's prompt (the trajectory so far, as long as one token short
        of ``max_sequence_length``) and a whole turn after it, which the row with the most
        room left may take while the others stop at theirs."""
        if self.rollout.multi_turn.env is None:
            return self.max_sequence_length
        return self.max_sequence_length - 1 + self.rollout.max_response_length

    @property
    def on_gpu(self) -> bool:
        """Whether the training workers run their models on cuda: ``model.device=cuda``, or
        ``auto`` with GPUs in their bundles (Ray hides every GPU from a worker given none)."""
        device = self.model.device
        return device == "cuda" or (device == "auto" and self.trainer.gpus_per_worker > 0)

    @property
    def generates_on_gpu(self) -> bool:
        """Whether the workers that generate (the actor's, or the rollout group's with
        ``rollout.placement=split``) run their models on cuda."""
        gpus = self.trainer.gpus_per_worker
        if self.rollout.placement == "split" and self.rollout.gpus_per_worker is not None:
            gpus = self.rollout.gpus_per_worker
        return self.model.device == "cuda" or (self.model.device == "auto" and gpus > 0)

    @property
    def actor_lockstep(self) -> bool:
        """Whether the actor generates through its FSDP2 model, each decode step gathering
        every layer, its ranks in lockstep: a split run's FSDP actor, which generates the
        validation batches only. A colocated FSDP actor generates from a whole copy of its
        policy instead (:meth:`generation_copied`), gathered once per weight version."""
        return self.actor.strategy == "fsdp" and self.rollout.placement == "split"

    def generation_copied(self, decode: str) -> bool:
        """Whether a colocated actor decoding in mode ``decode`` (resolved: not ``auto``)
        generates from a copy of its policy stored for generation
        (``workers.actor.generation_copy``; its bytes count in ``check_generation_fits``):
        an FSDP actor whose model FSDP2 shards (``core.sharding.fsdp_shards``: over more
        than one rank or offloaded; through its shards a decode step would gather every
        layer, from the host with ``actor.offload=all``), and under bf16-mixed with CUDA
        graphs (a replayed step would cast every fp32 weight again)."""
        if self.rollout.placement != "colocated":
            return False
        graphs = decode == "cuda_graphs" and self.precision == "bf16-mixed"
        sharded = self.actor.strategy == "fsdp" and fsdp_shards(
            self.role_sizes("actor").dp_size, offload=self.actor.offload == "all"
        )
        return sharded or graphs

    @property
    def generating_workers(self) -> int:
        """The workers a step's generation is spread over: the actor's data-parallel ranks,
        or the rollout group's workers."""
        if self.rollout.placement == "split":
            return self.trainer.nnodes * (self.rollout.workers_per_node or 1)
        return self.role_sizes("actor").dp_size

    @property
    def reward_model_workers(self) -> int:
        """The reward model group's workers, which a step's and a validation's scoring is
        spread over (0 when no reward model scores: ``reward.combine`` weighs no ``model``)."""
        if self.reward.model.path is None or "model" not in (self.reward.combine or {}):
            return 0
        return self.trainer.nnodes * (
            self.reward.model.workers_per_node or self.trainer.workers_per_node
        )

    @property
    def rows_per_generating_worker(self) -> int:
        """The most rows of a step one generating worker holds (its share, rounded up)."""
        return -(-self.sequences_per_step // self.generating_workers)

    @property
    def precision(self) -> Literal["fp32", "fp64", "bf16-mixed", "bf16"]:
        """``model.precision`` with ``auto`` resolved: bf16-mixed on a GPU, fp32 on CPU (every
        worker of a run uses this one, so a weight sync's dtypes agree on both sides)."""
        if self.model.precision != "auto":
            return self.model.precision
        return "bf16-mixed" if self.on_gpu else "fp32"

    def role_sizes(self, role: TrainedRole) -> RoleSizes:
        cfg: WorkerRoleConfig = getattr(self, role)
        dp = self.trainer.nnodes * (cfg.workers_per_node or self.trainer.workers_per_node)
        num_mini_batches = self.sequences_per_step // cfg.ppo_mini_batch_size
        return RoleSizes(
            dp_size=dp,
            mini_batch_size_per_worker=cfg.ppo_mini_batch_size // dp,
            num_mini_batches=num_mini_batches,
            total_updates=self.trainer.total_steps * cfg.ppo_epochs * num_mini_batches,
        )


def old_log_probs_source(cfg: Config) -> tuple[bool, str]:
    """Whether the actor recomputes the old log-probs of each batch, and why (the line the
    run prints at start-up). ``algorithm.recompute_old_log_probs=auto`` takes the sampler's
    own where they must agree with a recompute: the same weights (staleness 0), fp32 (the
    sampler's log-probs are fp32: in fp64 a recompute is finer, in bf16 and bf16-mixed the
    sampler's step-by-step decoding rounds otherwise than a whole forward pass), and the whole
    distribution sampled."""
    if cfg.algorithm.recompute_old_log_probs == "always":
        return (
            True,
            "old log-probs: recomputed by the actor (algorithm.recompute_old_log_probs=always)"
            + _truncated_tis(cfg),
        )
    rollout = cfg.rollout
    reasons = [
        reason
        for reason, applies in (
            (f"rollout.max_staleness={rollout.max_staleness}", rollout.max_staleness > 0),
            (f"model.precision={cfg.precision}", cfg.precision != "fp32"),
            ("rollout.temperature=0 (greedy)", rollout.temperature == 0),
        )
        if applies
    ] + _truncation(cfg)
    if reasons:
        return True, (
            "old log-probs: recomputed by the actor, as the sampler's may differ "
            f"(algorithm.recompute_old_log_probs=auto; {', '.join(reasons)})" + _truncated_tis(cfg)
        )
    inert = (
        "; so algorithm.rollout_correction=tis has nothing to correct (weights 1)"
        if cfg.algorithm.rollout_correction == "tis"
        else ""
    )
    return False, (
        "old log-probs: the sampler's own, which a recompute would repeat to float rounding "
        f"(algorithm.recompute_old_log_probs=auto): one forward pass a step saved{inert}"
    )


def _truncation(cfg: Config) -> list[str]:
    """The settings that make the sampler draw from a truncated distribution."""
    rollout = cfg.rollout
    return [
        setting
        for setting, applies in (
            (f"rollout.top_k={rollout.top_k}", rollout.top_k > 0),
            (f"rollout.top_p={rollout.top_p:g}", rollout.top_p < 1.0),
        )
        if applies
    ]


def _truncated_tis(cfg: Config) -> str:
    """What ``algorithm.rollout_correction=tis`` weighs with top-k or top-p sampling (the
    start-up line's tail; empty otherwise): the sampler's log-probs are of the truncated,
    renormalized distribution, so on-policy each weight is the probability mass the
    truncation kept, at most 1, and scales that token's policy gradient down."""
    truncation = _truncation(cfg)
    if cfg.algorithm.rollout_correction != "tis" or not truncation:
        return ""
    return (
        f"; with {' and '.join(truncation)} the sampler draws from the truncated distribution, "
        "so algorithm.rollout_correction=tis weighs each token by the probability mass the "
        "truncation kept (at most 1: on-policy it scales the policy gradient down)"
    )


# A typical magnitude of a language model's weights (Hugging Face initializes them with this
# standard deviation): the scale at which pure bf16 is judged to lose AdamW's updates.
TYPICAL_WEIGHT = 0.02


def bf16_lost_update(magnitude: float) -> float:
    """The largest update that leaves a bf16 number of ``magnitude`` as it is: half its
    spacing, which is 2^(e - 7) for numbers in [2^e, 2^(e + 1)) (bf16 keeps 8 significant
    bits)."""
    return 2.0 ** (math.floor(math.log2(magnitude)) - 8)


def precision_line(cfg: Config) -> str:
    """The line a run prints at start-up about its precision."""
    meaning = {
        "fp32": "parameters and compute in fp32",
        "fp64": "parameters and compute in fp64",
        "bf16-mixed": "fp32 master weights, gradients and optimizer state; bf16 compute",
        "bf16": "parameters and compute in bf16, no master weights",
    }[cfg.precision]
    auto = f"; model.precision=auto on {'cuda' if cfg.on_gpu else 'CPU'}"
    return f"precision: {cfg.precision} ({meaning}{auto if cfg.model.precision == 'auto' else ''})"


def precision_warning(cfg: Config) -> str | None:
    """Under pure bf16, one line naming each role whose learning rate is too small to move
    a weight of typical magnitude (an AdamW step moves each weight by about the learning
    rate); None otherwise. A run prints it before Ray starts: the user decides, but is told
    before any weights load."""
    if cfg.precision != "bf16":
        return None
    lost = bf16_lost_update(TYPICAL_WEIGHT)
    rates = [
        f"{role}.optim.lr={lr:g}"
        for role in cfg.roles
        if (lr := getattr(cfg, role).optim.lr) < lost
    ]
    if not rates:
        return None
    return (
        f"warning: model.precision=bf16: {', '.join(rates)} {'is' if len(rates) == 1 else 'are'} "
        f"at most half the bf16 spacing of a weight of magnitude {TYPICAL_WEIGHT:g} "
        f"({lost:.2g}): {'its' if len(rates) == 1 else 'their'} updates round away and such "
        "weights never change; use "
        "model.precision=bf16-mixed (fp32 master weights)"
    )
