"""Everything a run checks before Ray starts (docs/design.md, "A run"), so that a bad file,
model folder, reward, logger, checkpoint or output folder fails in a second with one line,
before any worker is placed."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from verlite import base_weights
from verlite.config import Config
from verlite.controller import check_device, check_fits_machine, check_fits_session
from verlite.data import PromptDataset, build_datasets, load_tokenizer
from verlite.driver.output_folder import FolderLock, prepare_output_folder
from verlite.envs import get_environment, turn_stop_id
from verlite.models import (
    builtin_vocab_size,
    check_gradient_checkpointing_supported,
    check_lora_supported,
    check_packing_supported,
    check_tokenizer_fits,
)
from verlite.models.precision import check_precision_supported
from verlite.models.reward_model import check_reward_model
from verlite.records.tracking import check_tracking_server, check_wandb
from verlite.rewards import RewardFn, resolve_reward
from verlite.rewards.remote import RemoteScorer


def check_placement(cfg: Config, *, in_session: bool) -> None:
    """The workers fit where they will run: the Ray session this process is already in, this
    machine for an embedded Ray; on a cluster, whose resources are not known before it is
    reached, that the device asked for exists here."""
    if in_session:
        check_fits_session(cfg)
    elif cfg.trainer.ray_address is None:
        check_fits_machine(cfg)
        check_precision_supported(cfg.precision, on_gpu=cfg.on_gpu)
    else:
        check_device(cfg)


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

    @classmethod
    def load(cls, cfg: Config) -> RunInputs:
        tokenizer = load_tokenizer(cfg.model.path, task=cfg.data.task)
        check_tokenizer_fits(cfg.model.path, len(tokenizer), field="model.path")
        builtin_vocab_size(cfg.model, len(tokenizer))
        for role in ("actor", "critic"):
            if getattr(cfg, role).packing:
                check_packing_supported(cfg.model, role=role)
            if getattr(cfg, role).gradient_checkpointing:
                check_gradient_checkpointing_supported(cfg.model, role=role)
        check_lora_supported(cfg.model, cfg.actor.lora)
        if cfg.rollout.multi_turn.env is not None:
            get_environment(cfg.rollout.multi_turn.env)
            if cfg.rollout.multi_turn.turn_stop is not None:
                turn_stop_id(cfg, tokenizer)
        train_set, val_set = build_datasets(cfg, tokenizer)
        reward_fn = resolve_reward(cfg)
        if cfg.reward.model.path is not None:
            check_reward_model(cfg.reward.model)
        remote = RemoteScorer.from_config(cfg.reward.remote)
        if remote is not None:
            remote.probe(train_set[0]["prompt"], train_set[0]["answer"])
        if "mlflow" in cfg.trainer.loggers:
            check_tracking_server(cfg.trainer.mlflow_tracking_uri)
        if "wandb" in cfg.trainer.loggers:
            check_wandb(cfg.trainer.wandb)
        base = None if cfg.model.path is None else base_weights.identity(cfg.model.path)
        # Last: it may move an earlier folder aside, which only a run that starts should do.
        resume_from, folder = prepare_output_folder(cfg, train_set=train_set.fingerprint)
        return cls(tokenizer, train_set, val_set, reward_fn, resume_from, folder, remote, base)
