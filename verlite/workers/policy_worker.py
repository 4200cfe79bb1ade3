"""PolicyWorker: what the workers that sample from the policy share (the actor's and the
rollout's): the token ids generation needs, the noise each draws with, and multi-turn
rollouts with an environment (``rollout.multi_turn``), whose tools run here, in the worker
that generates, never on the driver."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from tensordict import TensorDict
from torch import nn

from verlite.config import Config, ConfigError
from verlite.config.checks import cache_position_fields
from verlite.controller import Worker
from verlite.core import seeds
from verlite.data import PromptRecord, row_records
from verlite.data.templates import turn_format
from verlite.data.tokenizer import load_tokenizer
from verlite.envs import (
    AbandonedCalls,
    SessionThreads,
    get_environment,
    open_sessions,
    turn_stop_id,
)
from verlite.generation import DecodeSettings, Noise, SamplingParams, noise_for
from verlite.generation.decode import auto_mode
from verlite.generation.multi_turn import TurnLimits, generate_multi_turn
from verlite.generation.noise import turn_keys
from verlite.generation.sampling import mark_prompt_padding
from verlite.generation.static_cache import cache_bytes
from verlite.models import hf_config, meta_causal_lm
from verlite.models.hf import config_of
from verlite.models.precision import autocast, cache_dtype, param_dtype, store_for_generation

Generate = Callable[[TensorDict, SamplingParams, Noise | None], TensorDict]


def check_generation_fits(cfg: Config, tokenizer_size: int) -> None:
    """On this process's GPU (cuda:0), for workers that generate on cuda: one generating
    worker's KV cache (its rows x the longest sequence x what the model's layers cache per
    position, ``static_cache.cache_bytes``, from the config alone, in the dtype every decode
    path stores it in, ``precision.cache_dtype``) and the policy's weights
    as it generates with them must fit the GPU's memory. A bound from below: activations,
    and a colocated actor's gradients and optimizer state, come on top (a generation that
    does not fit what is free is refused then, before it starts). Checked by the driver
    before Ray starts where this machine's GPU is the workers' (an embedded Ray), and by
    each generating worker before it builds a model (a cluster's GPUs, which the driver
    cannot see)."""
    if not cfg.generates_on_gpu or not torch.cuda.is_available():
        return
    config = hf_config(cfg.model, tokenizer_size, cfg.max_sequence_length)
    model = meta_causal_lm(config)
    trained = sum(p.numel() for p in model.parameters()) * param_dtype(cfg.precision).itemsize
    # What a rollout worker's model, or a colocated actor's generation copy, holds: a tied
    # head its own bf16 tensor under bf16-mixed (``store_for_generation``; on the meta
    # device, nothing is allocated).
    stored = store_for_generation(model, cfg.precision)
    weights = sum(p.numel() * p.element_size() for p in stored.parameters())
    if cfg.rollout.placement == "colocated":  # its trained weights, and a copy to generate from
        mode = cfg.rollout.decode
        if mode == "auto":
            mode = auto_mode(
                config,
                device=torch.device("cuda"),
                lockstep=cfg.actor_lockstep,
                per_rank=cfg.rollout.randomness == "per_rank",
                longest=cfg.max_sequence_length,
            )
        copied = cfg.generation_copied(mode)
        weights = _trained_on_gpu(cfg, trained) + (weights if copied else 0)
    rows = cfg.rows_per_generating_worker
    kv = cache_bytes(config, rows, cfg.cache_positions, cache_dtype(cfg.precision))
    total = torch.cuda.get_device_properties(0).total_memory
    if kv + weights > total:
        raise ConfigError(
            f"generation cannot fit {torch.cuda.get_device_name(0)} ({total / 2**30:.1f} GiB): "
            f"the KV cache of {rows} rows per generating worker (data.train_batch_size x "
            f"rollout.n / {cfg.generating_workers} workers) x {cfg.cache_positions} "
            f"positions ({cache_position_fields(cfg)}) is {kv / 2**30:.1f} GiB and the weights "
            f"{weights / 2**30:.1f} GiB; generate fewer or shorter rows per worker"
        )


def _trained_on_gpu(cfg: Config, trained: int) -> int:
    """Of a colocated actor's ``trained`` weight bytes, what one rank holds on its GPU: all
    under DDP, a shard under FSDP2 (``fully_shard`` over every actor rank; it generates from
    a whole copy, counted apart: ``Config.generation_copied``), none with its CPU offload
    (``actor.offload=all``; the copy stays on the GPU)."""
    if cfg.actor.strategy != "fsdp":
        return trained
    if cfg.actor.offload == "all":
        return 0
    return -(-trained // cfg.role_sizes("actor").dp_size)


class PolicyWorker(Worker):
    """A worker holding a policy it samples from."""

    def __init__(
        self, *, cfg: Config, vocab_size: int, eos_token_id: int, pad_token_id: int, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id

    def load_environment(self) -> None:
        """A multi-turn run's environment class (``rollout.multi_turn.env``), its session
        threads, the tokenizer and the turn format; called by ``init_model``, not the
        constructor: a ``UserError`` a call raises reaches the command line as bad input
        (``controller.failures.WorkerInputError``, exit 2), where Ray reports a
        constructor's as a dead actor, its type lost (a run failure, exit 1)."""
        cfg = self.cfg
        multi_turn = cfg.rollout.multi_turn
        if multi_turn.env is None:
            return
        self.environment = get_environment(multi_turn.env)
        self.env_threads = SessionThreads(
            multi_turn.env_threads, AbandonedCalls(multi_turn.max_abandoned_calls)
        )
        self.tokenizer = load_tokenizer(cfg.model.path, task=cfg.data.task)
        self.stop_token_ids = (
            () if multi_turn.turn_stop is None else (turn_stop_id(cfg, self.tokenizer),)
        )
        self.turns = turn_format(cfg, self.tokenizer)

    def decode_settings(
        self, model: nn.Module, device: torch.device, *, lockstep: bool, trains_on: bool
    ) -> DecodeSettings:
        """How ``model`` decodes on ``device``: ``rollout.decode``, ``auto`` resolved
        (``generation.decode.auto_mode``: static in ``lockstep``, a split run's FSDP actor,
        whose all-gathers cannot be captured; an explicit mode the model cannot run was
        refused at start-up, ``driver.preflight.check_generation``), and ``cuda_graphs`` as
        static where this worker does not generate the rows trained on (``trains_on``: a
        split run's actor, whose generations are the validation batches, every
        ``trainer.val_freq`` steps).
        Its graphs' memory pool, and under bf16-mixed the bf16 copy of the policy they are
        captured from (``workers.actor.generation_copy``: 15 GB for a 7B policy), stayed on
        the device all run for those few generations; decoding statically, the trained
        model generates under autocast, whose bf16 casts last one generation. The cache is
        reserved for this worker's share of a step (when ``trains_on``) by the most
        positions a generation spans (``Config.cache_positions``)."""
        cfg, rollout = self.cfg, self.cfg.rollout
        mode = rollout.decode
        if mode == "auto":
            mode = auto_mode(
                config_of(model),
                device=device,
                lockstep=lockstep,
                per_rank=rollout.randomness == "per_rank",
                longest=cfg.max_sequence_length,
            )
        if mode == "cuda_graphs" and not trains_on:
            mode = "static"
        rows = cfg.rows_per_generating_worker if trains_on else 0
        return DecodeSettings(
            mode,
            batch_buckets=None
            if rollout.decode_batch_buckets is None
            else tuple(rollout.decode_batch_buckets),
            reserve=(rows, cfg.cache_positions),
        )

    def noise(
        self,
        prompts: TensorDict,
        params: SamplingParams,
        seed: int,
        device: torch.device,
        turn: int = 0,
    ) -> Noise | None:
        """What this rank samples ``prompts`` with: each row's ``sample_key``
        (``rollout.randomness=per_sample``), or its stream in turn ``turn`` of the step
        seeded ``seed`` (``verlite.core.seeds.rank_sampling``)."""
        return noise_for(
            prompts,
            temperature=params.temperature,
            horizon=params.max_new_tokens,
            randomness=self.cfg.rollout.randomness,
            stream_seed=seeds.rank_sampling(seed, rank=self.rank, turn=turn),
            device=device,
        )

    def sample(
        self,
        generate: Generate,
        prompts: TensorDict,
        params: SamplingParams,
        seed: int,
        records: Sequence[PromptRecord] | None,
        *,
        device: torch.device,
        cache_casts: bool = True,
    ) -> TensorDict:
        """The step batch of ``prompts`` (moved to ``device``, where the model samples): one
        response each, or with ``rollout.multi_turn.env`` a trajectory with the environment
        of its record (``records``: the step's prompt records, one per prompt, a row's by its
        ``uid``). The model runs in the run's precision (``verlite.models.precision.autocast``;
        with ``cache_casts``, each weight cast to bf16 once for the whole generation, which a
        sharded model's gathered layers are not)."""
        prompts = mark_prompt_padding(prompts).to(device)
        with autocast(self.cfg.precision, device, cache=cache_casts):
            if self.cfg.rollout.multi_turn.env is None or records is None:
                return generate(prompts, params, self.noise(prompts, params, seed, device))
            multi_turn = self.cfg.rollout.multi_turn
            sessions = open_sessions(
                self.environment,
                row_records(records, prompts["uid"]),
                indices=prompts["uid"].tolist(),
                timeout_s=multi_turn.tool_timeout_s,
                threads=self.env_threads,
                turns=self.turns,
            )
            turn_params = replace(
                params, stop_token_ids=params.stop_token_ids + self.stop_token_ids
            )

            def turn(td: TensorDict, index: int, max_new_tokens: int) -> TensorDict:
                p = replace(turn_params, max_new_tokens=max_new_tokens)
                if "sample_key" in set(td.keys()):
                    td["sample_key"] = turn_keys(td["sample_key"], index)
                return generate(td, p, self.noise(td, p, seed, device, turn=index))

            limits = TurnLimits(
                max_turns=multi_turn.max_turns,
                width=self.cfg.response_width,
                turn_tokens=params.max_new_tokens,
                end_token_ids=tuple(params.end_tokens(self.eos_token_id)),
                pad_token_id=self.pad_token_id,
                turn_stop_ids=self.stop_token_ids,
                unwritten_end=None if self.turns is None else self.turns.unwritten_end,
            )
            try:
                return generate_multi_turn(turn, prompts, sessions, self.tokenizer, limits)
            finally:
                for session in sessions:
                    session.close()
