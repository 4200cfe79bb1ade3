"""Checks that need more than one field of a config to decide (the sizes of the roles'
batches against the step, multi-turn against the roles and the reward, staleness against
where generation runs, a chat template against the model), run once every section is valid.
Each raises a ``ValueError`` whose message names its fields; :func:`check_across_fields`
runs them in a fixed order, so a config with several problems always reports the same one."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from verlite.config.sections_reward import RewardConfig
from verlite.config.sections_rollout import MultiTurnConfig

if TYPE_CHECKING:
    from verlite.config.schema import Config
    from verlite.config.sections_training import WorkerRoleConfig


def check_across_fields(cfg: Config) -> None:
    """Every check below, in order; raises at the first that fails."""
    if (
        cfg.algorithm.adv_estimator in ("grpo", "rloo", "reinforce_plus_plus_baseline")
        and cfg.rollout.n < 2
    ):
        raise ValueError(
            f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} compares samples of one prompt: "
            f"rollout.n must be >= 2, got {cfg.rollout.n}"
        )
    for role in cfg.roles:
        _check_role_sizes(cfg, role)
    if cfg.rollout.max_staleness > 0 and cfg.rollout.placement == "colocated":
        raise ValueError(
            f"rollout.max_staleness={cfg.rollout.max_staleness} generates while the actor "
            "trains, which needs rollout.placement=split (colocated actors generate and "
            "train in turn); set rollout.placement=split or rollout.max_staleness=0"
        )
    if cfg.algorithm.rollout_correction == "tis" and cfg.rollout.temperature == 0:
        raise ValueError(
            "algorithm.rollout_correction=tis weighs tokens by how likely the sampler made "
            "them, but rollout.temperature=0 samples greedily (no distribution); use "
            "rollout_correction=none or a temperature > 0"
        )
    _check_chat_template(cfg)
    _check_multi_turn(cfg)
    _check_scored_by_environment(cfg)
    _check_decode(cfg)
    if cfg.rollout.placement == "split" and cfg.generating_workers > cfg.sequences_per_step:
        raise ValueError(
            f"{cfg.generating_workers} rollout workers (trainer.nnodes={cfg.trainer.nnodes} * "
            f"rollout.workers_per_node={cfg.rollout.workers_per_node}) outnumber the "
            f"{cfg.sequences_per_step} sequences of a step (data.train_batch_size * "
            "rollout.n); some would have nothing to generate"
        )


def _check_decode(cfg: Config) -> None:
    """The static decode modes draw with per-sample keys; CUDA graphs need the generating
    workers on cuda, and cannot hold FSDP's all-gathers."""
    decode = cfg.rollout.decode
    if decode in ("static", "cuda_graphs") and cfg.rollout.randomness == "per_rank":
        raise ValueError(
            f"rollout.decode={decode} compacts finished rows away, which changes what a "
            "per-rank random stream draws for the others; use rollout.randomness=per_sample, "
            "or rollout.decode=eager"
        )
    if decode != "cuda_graphs":
        return
    if not cfg.generates_on_gpu:
        raise ValueError(
            "rollout.decode=cuda_graphs captures CUDA graphs, but the workers that generate run "
            f"on CPU (model.device={cfg.model.device}, no GPUs per worker); use "
            "rollout.decode=static or eager, or give the workers GPUs"
        )
    if cfg.rollout.placement == "colocated" and cfg.actor.strategy == "fsdp":
        raise ValueError(
            "rollout.decode=cuda_graphs cannot capture the parameter all-gathers of an FSDP "
            "actor that generates (rollout.placement=colocated); use rollout.decode=static, "
            "rollout.placement=split or actor.strategy=ddp"
        )


def _check_chat_template(cfg: Config) -> None:
    """A chat template is the model's tokenizer's: the built-in task tokenizer has none; the
    role of its observation turns is a setting of the template."""
    role = cfg.rollout.multi_turn.observation_role
    if not cfg.data.chat_template:
        if role != MultiTurnConfig.model_fields["observation_role"].default:
            raise ValueError(
                f"rollout.multi_turn.observation_role={role} is the role of the chat template's "
                "observation turns, but data.chat_template is off; set data.chat_template=true "
                "or unset it"
            )
        return
    if cfg.model.path is None:
        raise ValueError(
            "data.chat_template=true renders prompts with the tokenizer's chat template, but "
            "model.path is unset (the built-in task tokenizer has none); set model.path to a "
            "model folder whose tokenizer has one, or data.chat_template=false"
        )


def _check_scored_by_environment(cfg: Config) -> None:
    """A multi-turn run is scored by its environment (the reward of a trajectory's last
    turn): a reward source, or a setting of the reward function, would be ignored or set
    up for nothing beside it."""
    env = cfg.rollout.multi_turn.env
    if env is None:
        return
    reward = cfg.reward
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


def _check_multi_turn(cfg: Config) -> None:
    multi_turn = cfg.rollout.multi_turn
    if multi_turn.env is None:
        return
    one_turn = cfg.data.max_prompt_length + cfg.rollout.max_response_length
    if multi_turn.max_total_length is None:
        raise ValueError(
            f"rollout.multi_turn.env={multi_turn.env!r} needs rollout.multi_turn."
            f"max_total_length (the most tokens of a trajectory, >= {one_turn})"
        )
    if cfg.rollout.placement == "colocated" and cfg.actor.strategy == "fsdp":
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


def _check_role_sizes(cfg: Config, role: Literal["actor", "critic"]) -> None:
    section: WorkerRoleConfig = getattr(cfg, role)
    sizes = cfg.role_sizes(role)
    seqs = cfg.sequences_per_step
    mini = f"{role}.ppo_mini_batch_size={section.ppo_mini_batch_size}"
    if seqs % section.ppo_mini_batch_size:
        raise ValueError(
            f"{mini} must divide the sequences per step, data.train_batch_size * rollout.n = "
            f"{cfg.data.train_batch_size} * {cfg.rollout.n} = {seqs}"
        )
    if section.ppo_mini_batch_size % sizes.dp_size:
        raise ValueError(
            f"{mini} must be divisible by the {role}'s {sizes.dp_size} workers "
            f"(trainer.nnodes={cfg.trainer.nnodes} * {role}.workers_per_node={section.workers_per_node})"
        )
    if section.offload == "all" and section.strategy != "fsdp":
        raise ValueError(
            f"{role}.offload=all is FSDP2's CPU offload and needs {role}.strategy=fsdp, got "
            f"{role}.strategy={section.strategy}; use strategy=fsdp or offload=optimizer"
        )
    if section.strategy == "none" and sizes.dp_size > 1:
        raise ValueError(
            f"{role}.strategy=none runs one worker, but {role} has {sizes.dp_size} workers; use ddp or fsdp"
        )
    if section.use_dynamic_bsz:
        longest = cfg.max_sequence_length
        if section.max_token_len_per_worker is None:
            raise ValueError(
                f"{role}.use_dynamic_bsz=true needs {role}.max_token_len_per_worker (>= {longest})"
            )
        if section.max_token_len_per_worker < longest:
            raise ValueError(
                f"{role}.max_token_len_per_worker={section.max_token_len_per_worker} is below the longest sequence, "
                f"{longest_sequence_fields(cfg)} = {longest}"
            )
        return
    micro = f"{role}.micro_batch_size_per_worker={section.micro_batch_size_per_worker}"
    per_worker = sizes.mini_batch_size_per_worker
    if section.micro_batch_size_per_worker > per_worker:
        raise ValueError(
            f"{micro} is larger than the per-worker mini-batch {per_worker} ({mini} / {sizes.dp_size} workers)"
        )
    if per_worker % section.micro_batch_size_per_worker:
        # Every rank must run the same number of micro-batches: FSDP collectives pair up
        # forward and backward calls across ranks.
        raise ValueError(
            f"{mini} must be divisible by micro_batch_size_per_worker * workers = "
            f"{section.micro_batch_size_per_worker} * {sizes.dp_size}"
        )


def longest_sequence_fields(cfg: Config) -> str:
    """The fields that set the longest sequence of a step, as a message names them."""
    if cfg.response_width != cfg.rollout.max_response_length:
        return "rollout.multi_turn.max_total_length"
    return "data.max_prompt_length + rollout.max_response_length"
