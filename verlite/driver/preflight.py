"""Everything a run checks before Ray starts (docs/design.md, "A run"), so that a bad file,
model folder, reward, logger, checkpoint or output folder fails in a second with one line,
before any worker is placed."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import ray
from transformers import PreTrainedTokenizerBase

from verlite import base_weights
from verlite.config import Config, ConfigError, RewardModelConfig
from verlite.config.checks import longest_sequence_fields
from verlite.controller import check_device, check_fits_machine, check_fits_session
from verlite.data import (
    DataError,
    PromptDataset,
    build_datasets,
    check_fills_a_batch,
    load_reward_tokenizer,
    load_tokenizer,
    record_conversation,
)
from verlite.data.templates import reads_chat_template, reward_chat_text, turn_format
from verlite.driver.output_folder import FolderLock, prepare_output_folder
from verlite.envs import get_environment, turn_stop_id
from verlite.errors import shown
from verlite.generation.decode import MAX_END_TOKENS, MAX_STOP_TOKENS, check_mode_supported
from verlite.generation.static_cache import UnsupportedModel
from verlite.models import builtin_vocab_size, hf_config, model_config
from verlite.models.generation_ends import generation_end_ids
from verlite.models.precision import check_precision_supported
from verlite.models.reward_model import check_reward_model
from verlite.models.support import (
    check_attention_supported,
    check_context_fits,
    check_lora_supported,
    check_rope_supported,
    check_tokenizer_fits,
    check_training_features,
    float32_norms_line,
)
from verlite.records.tracking import check_tracking_server, check_wandb
from verlite.rewards import RewardFn, check_answers, resolve_reward
from verlite.rewards.answer_reward import AnswerReward
from verlite.rewards.remote import RemoteScorer
from verlite.workers.policy_worker import check_generation_fits


def check_generation(cfg: Config, tokenizer_size: int) -> None:
    """What generation asks of the policy: ``rollout.stop_token_ids`` inside its vocabulary,
    and, with ``model.path``'s own end tokens, no more than the static path checks,
    and for the static decode modes every layer attending as full causal attention on the
    run's sequences (full attention, or a sliding window ``max_sequence_length`` never
    passes)."""
    config = hf_config(cfg.model, tokenizer_size, cfg.max_sequence_length)
    stops = cfg.rollout.stop_token_ids
    outside = [token for token in stops if token >= config.vocab_size]
    if outside:
        raise ConfigError(
            f"rollout.stop_token_ids={stops}: {outside} outside the model's vocabulary of "
            f"{config.vocab_size} tokens (ids 0 to {config.vocab_size - 1})"
        )
    if len(set(stops)) > MAX_STOP_TOKENS:
        raise ConfigError(
            f"rollout.stop_token_ids={stops}: {len(set(stops))} distinct tokens; at most "
            f"{MAX_STOP_TOKENS}"
        )
    # EOS and a multi-turn run's turn stop end a response too.
    ends = set(generation_end_ids(cfg.model.path)) | set(stops)
    if len(ends) > (most := MAX_END_TOKENS - 2):
        raise ConfigError(
            f"model.path={cfg.model.path!r} ends generation at {len(ends) - len(set(stops))} "
            f"tokens of its own (its generation config's eos_token_id) besides "
            f"rollout.stop_token_ids={stops}: {len(ends)} end tokens in all; at most {most}"
        )
    if cfg.rollout.decode != "auto":
        try:
            check_mode_supported(config, cfg.rollout.decode, longest=cfg.max_sequence_length)
        except UnsupportedModel as exc:
            raise ConfigError(f"rollout.decode={cfg.rollout.decode}: {exc}") from None


def check_placement(cfg: Config, *, in_session: bool, cpus: int | None = None) -> None:
    """The workers fit where they will run: the Ray session this process is already in, this
    machine for an embedded Ray (of ``cpus`` CPUs; None: the machine's); on a cluster, whose
    resources are not known before it is reached, that the device asked for exists here."""
    if in_session:
        check_fits_session(cfg)
    elif cfg.trainer.ray_address is None:
        check_fits_machine(cfg, cpus=cpus)
        check_precision_supported(cfg, on_gpu=cfg.on_gpu)
    else:
        check_device(cfg)


def check_validation_shares(cfg: Config, val_set: PromptDataset) -> None:
    """Validation spreads the prompts of ``val_set`` over the actor's workers, which answer
    them, and the reward model's, which score them; a data-parallel share is never empty
    (``core.partition.dp_shares``), so every such worker needs one prompt at least. Refused
    before the run starts, not at its first validation."""
    if cfg.trainer.val_freq == 0:
        return
    spread = {"actor": cfg.role_sizes("actor").dp_size, "reward model": cfg.reward_model_workers}
    num_val = len(val_set)
    for who, workers in spread.items():
        if num_val < workers:
            held = (
                f"data.val_file={shown(cfg.data.val_file)}"
                if cfg.data.val_file is not None
                else f"data.num_val_samples={cfg.data.num_val_samples}"
            )
            raise DataError(
                f"{num_val} validation prompts ({held}{val_set.dropped_note()}) are fewer than the {workers} {who} "
                "workers validation spreads them over, one at least each; validate on more "
                "prompts, use fewer workers, or trainer.val_freq=0"
            )


def _check_reward_template(
    tokenizer: PreTrainedTokenizerBase,
    datasets: Sequence[PromptDataset],
    *,
    rm: RewardModelConfig,
) -> None:
    """The reward model's chat template renders every prompt's conversation (with an empty
    response), or start-up stops in one line (:func:`reward_chat_text`), not a later step's
    scoring: a template refuses by the turns' roles (a system turn it has no role for, turns
    that do not alternate), so one conversation of each sequence of roles the prompts hold is
    rendered."""
    rendered = set()
    for dataset in datasets:
        for record in dataset:
            conversation = record_conversation(record)
            roles = tuple(message["role"] for message in conversation)
            if roles not in rendered:
                reward_chat_text(tokenizer, conversation, "", rm=rm)
                rendered.add(roles)


def _source(cfg: Config, train_set: PromptDataset) -> str:
    """Where a run's training prompts (``train_set``) come from, as a message names it."""
    data = cfg.data
    if data.task is not None:
        return (
            f" (data.task={data.task}, data.num_train_samples={data.num_train_samples}"
            f"{train_set.dropped_note()})"
        )
    held_out = (
        f" less data.num_val_samples={data.num_val_samples} held out"
        if data.val_file is None
        else ""
    )
    return f" (data.train_file={shown(data.train_file)}{held_out}{train_set.dropped_note()})"


@dataclass(frozen=True)
class RunInputs:
    """What a run reads before any worker starts: the tokenizer, the prompt datasets, the
    reward function or the remote verifier (probed: it answers), the checkpoint to resume
    from (None: a fresh run; checked, its training prompts included) and the hold on the
    output folder, made ready under its contract (``verlite.driver.output_folder``)."""

    tokenizer: PreTrainedTokenizerBase
    train_set: PromptDataset
    val_set: PromptDataset
    reward_fn: RewardFn
    resume_from: Path | None
    folder: FolderLock
    remote: RemoteScorer | None = None
    # The identity of model.path's weight files, taken once here (``verlite.base_weights``).
    base_weights: dict[str, str] | None = None
    # Whether the reward model reads each conversation in its chat template
    # (``reads_chat_template`` of reward.model and its tokenizer).
    reward_model_reads_chat: bool = False

    @classmethod
    def load(cls, cfg: Config, notes: Sequence[str] = ()) -> RunInputs:
        """The run's inputs, every check passed; then the lines a run that starts says of
        its settings and inputs (``notes``, a caller's, first), printed: a run refused says
        one line, its refusal."""
        said = list(notes)
        reward_model_reads_chat = False
        if cfg.model.path is not None:  # its tokenizer's load reads config.json too
            model_config(cfg.model.path)  # a config.json that does not load, named as one
        tokenizer = load_tokenizer(cfg.model.path, task=cfg.data.task)
        check_tokenizer_fits(cfg.model.path, len(tokenizer), field="model.path")
        builtin_vocab_size(cfg.model, len(tokenizer))
        check_attention_supported(cfg.model)
        check_generation(cfg, len(tokenizer))
        if cfg.trainer.ray_address is None and not ray.is_initialized():
            check_generation_fits(cfg, len(tokenizer))
        check_training_features(cfg)
        if (frozen_head := check_lora_supported(cfg.model, cfg.actor.lora)) is not None:
            said.append(frozen_head)
        context = check_context_fits(
            cfg.model,
            max_sequence_length=cfg.max_sequence_length,
            fields=longest_sequence_fields(cfg),
        )
        if context is not None:
            said.append(context)
        check_rope_supported(cfg.model, max_sequence_length=cfg.max_sequence_length)
        if cfg.rollout.multi_turn.env is not None:
            get_environment(cfg.rollout.multi_turn.env)
            if cfg.rollout.multi_turn.turn_stop is not None:
                turn_stop_id(cfg, tokenizer)
        train_set, val_set = build_datasets(cfg, tokenizer)
        for dataset in (train_set, val_set):
            if (dropped := dataset.dropped_line(cfg.data.max_prompt_length)) is not None:
                said.append(dropped)
        check_fills_a_batch(
            len(train_set), cfg.data.train_batch_size, source=_source(cfg, train_set)
        )
        check_validation_shares(cfg, val_set)
        turn_format(cfg, tokenizer)  # refuses a template multi-turn turns cannot be written in
        reward_fn = resolve_reward(cfg)
        combine = cfg.reward.combine
        assert combine is not None  # resolved at load
        if "fn" in combine and cfg.rollout.multi_turn.env is None:  # else it scores nothing
            check_answers(reward_fn, (train_set, val_set))
        if cfg.reward.model.path is not None:
            check_reward_model(cfg.reward.model)
            rm_tokenizer = load_reward_tokenizer(cfg.reward.model.path)
            check_tokenizer_fits(
                cfg.reward.model.path, len(rm_tokenizer), field="reward.model.path"
            )
            reward_model_reads_chat = reads_chat_template(cfg.reward.model, rm_tokenizer)
            if reward_model_reads_chat:
                _check_reward_template(rm_tokenizer, (train_set, val_set), rm=cfg.reward.model)
                if cfg.reward.model.chat_template == "auto":
                    said.append(
                        "reward.model.chat_template=auto: the reward model's tokenizer has a "
                        "chat template; it reads each prompt and response as a conversation in it"
                    )
        if (norms := float32_norms_line(cfg)) is not None:
            said.append(norms)
        remote = RemoteScorer.from_config(cfg.reward.remote)
        if remote is not None:
            remote.probe(train_set[0]["prompt"], train_set[0]["answer"])
        if "mlflow" in cfg.trainer.loggers:
            check_tracking_server(cfg.trainer.mlflow_tracking_uri)
        if "wandb" in cfg.trainer.loggers:
            check_wandb(cfg.trainer.wandb)
        base = None if cfg.model.path is None else base_weights.identity(cfg.model.path)
        # Last: it may move an earlier folder aside, which only a run that starts should do.
        resume_from, folder, resuming = prepare_output_folder(cfg, train_set=train_set.fingerprint)
        for line in [*said, *resuming]:
            print(line, flush=True)
        return cls(
            tokenizer,
            train_set,
            val_set,
            reward_fn,
            resume_from,
            folder,
            remote,
            base,
            reward_model_reads_chat,
        )

    def set_aside(self) -> None:
        """Let go of what the run takes up again at its first use (the answer reward's
        verifier process, which reading the answers started): for a caller that holds several
        runs' inputs before any of them runs (``check-invariance --run``)."""
        if isinstance(self.reward_fn, AnswerReward):
            self.reward_fn.close()
