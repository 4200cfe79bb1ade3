"""The ``rollout`` section: sampling, where generation runs and how far ahead, and
multi-turn rollouts with an environment."""

from __future__ import annotations

import itertools
from typing import Annotated, Literal

from pydantic import AfterValidator, Field

from verlite.config.fields import (
    Needs,
    NonEmptyStr,
    NonNegativeInt,
    OptionalGpusPerWorker,
    PositiveInt,
    Seconds,
    Section,
    fields_but,
)

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


def _ascending_buckets(value: list[int] | None) -> list[int] | None:
    if value is not None and not value:
        raise ValueError("is empty: give ascending row counts, or null for powers of two")
    if value is not None and any(a >= b for a, b in itertools.pairwise(value)):
        raise ValueError(f"{value} is not strictly ascending")
    return value


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
        "of the tokenizer as it follows other text: a SentencePiece tokenizer's '?' after a word, "
        "not the '▁?' it makes of '?' alone; not the end-of-sequence token nor one of "
        "rollout.stop_token_ids; one "
        "of model.path's own end tokens then ends a turn only); the end-of-sequence token "
        "always ends the trajectory.",
    )
    observation_role: Literal["tool", "user"] = Field(
        "tool",
        description="With data.chat_template: the role of the template's turn that holds an "
        "observation (tool: Qwen2.5 writes it as a user turn in <tool_response> tags; user, "
        "for a template without a tool role).",
    )
    tool_timeout_s: Seconds = Field(
        30.0,
        description="Most seconds one environment call may take, from its start (not from the "
        "time it waited for its thread's earlier calls); a step that takes longer or raises "
        "ends its trajectory (multiturn/tool_errors), never the run. Counted as the time the "
        "call would take alone: calls that compute in Python side by side (env_threads) take "
        "turns on the interpreter lock, so the CPU time the others ran meanwhile is not charged "
        "to it, but at least its share of the wall time: a stuck call is found within k times "
        "this, k the calls running beside it, itself included (docs/multi-turn.md).",
    )
    max_abandoned_calls: NonNegativeInt = Field(
        32,
        description="Most environment calls that outlived tool_timeout_s and still run, per "
        "worker: a thread cannot be stopped, so each is left running "
        "(multiturn/abandoned_calls counts a step's); one more stops the run.",
    )
    env_threads: PositiveInt = Field(
        32,
        description="Threads that run a worker's environment calls: each trajectory's calls "
        "run in one of them (per-thread state is shared by the trajectories of a thread), "
        "bound when its environment is made. A step's environments are made and reset, and a "
        "turn's steps run, side by side on the threads, "
        "each thread's one after another; a call that outlives tool_timeout_s retires its "
        "thread, whose other trajectories move to a fresh one at their next call.",
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
    stop_token_ids: list[NonNegativeInt] = Field(
        default_factory=list,
        description="Token ids that end a response as the end-of-sequence token does, besides "
        "model.path's own end tokens (its generation_config.json's eos_token_id, which end one "
        "already: an instruct model's end of turn); each must be inside the model's "
        "vocabulary.",
    )
    ignore_eos: bool = Field(
        False,
        description="Benchmarks only: generate every response to rollout.max_response_length, "
        "the end-of-sequence token and model.path's own end tokens included (stop_token_ids "
        "still end a response), so that "
        "a random model's responses are full length.",
    )
    decode: Literal["auto", "eager", "static", "cuda_graphs"] = Field(
        "auto",
        description="How the sampler decodes. eager: a KV cache grown a position per step, "
        "one kernel launch per operation; static: a KV cache of fixed shape kept between "
        "generations, finished rows compacted out by batch-size buckets; cuda_graphs: static, "
        "each decode step captured once as a CUDA graph and replayed (cuda only; a split "
        "run's actor, which generates the validation batches only, decodes static instead; a "
        "colocated FSDP actor captures them from a whole copy of its policy, gathered once "
        "per weight version). auto: cuda_graphs on cuda (static for a split run's actor), eager "
        "on CPU. static "
        "and cuda_graphs need rollout.randomness=per_sample and a model with full attention "
        "in every layer, or sliding-window layers whose window is at least the longest "
        "sequence (data.max_prompt_length + rollout.max_response_length, or "
        "rollout.multi_turn.max_total_length); auto decodes any other model eagerly.",
    )
    decode_batch_buckets: Annotated[
        list[PositiveInt] | None, AfterValidator(_ascending_buckets)
    ] = Field(
        None,
        description="static and cuda_graphs: the row counts, ascending, that a generation's "
        "unfinished rows are compacted to as others finish; with cuda_graphs a generation's "
        "first steps run on one too, the smallest holding its batch (past the largest, the "
        "next power of two) within the rows the cache holds, padded with finished rows, so a "
        "graph is captured per bucket used, not per batch size (a batch past the cache's rows "
        "runs on itself, the cache grown to it). None: the powers of two.",
    )
    placement: Literal["colocated", "split"] = Field(
        "colocated",
        description="Who generates: colocated: the actor workers, with the weights they train; "
        "split: a rollout worker group of its own, its weights synced from the actor after every "
        "update (versioned and digest-checked), in a pool of bundles of its own. Unlike "
        "trainer.placement (colocate|split), which says whether the other groups share Ray "
        "bundles.",
    )
    max_staleness: NonNegativeInt = Field(
        0,
        description="split: how many weight versions a batch may lag the actor that trains on "
        "it; 0 is on-policy, k >= 1 generates the next batches while the actor trains.",
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
    gpus_per_worker: OptionalGpusPerWorker = Field(
        None,
        description="split: GPUs of one rollout worker; None uses trainer.gpus_per_worker; auto "
        "as trainer.gpus_per_worker's.",
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


# Settings of this section that only a feature makes count (verlite.config.inert).
NEEDS = (
    Needs(
        ("rollout.top_k", "rollout.top_p"),
        unless="rollout.temperature > 0 (0 takes the most likely token)",
        active=lambda cfg: cfg.rollout.temperature > 0,
        example={"rollout.temperature": 1.0},
    ),
    Needs(
        tuple(
            f"rollout.{name}"
            for name in ("workers_per_node", "cpus_per_worker", "gpus_per_worker", "sync_bucket_mb")
        ),
        unless="rollout.placement=split",
        active=lambda cfg: cfg.rollout.placement == "split",
        example={"rollout.placement": "split"},
    ),
    Needs(
        ("rollout.decode_batch_buckets",),
        unless="rollout.decode is static or cuda_graphs (auto: on cuda, with "
        "rollout.randomness=per_sample)",
        active=lambda cfg: (
            cfg.rollout.decode in ("static", "cuda_graphs")
            or (
                cfg.rollout.decode == "auto"
                and (cfg.on_gpu or cfg.generates_on_gpu)
                and cfg.rollout.randomness == "per_sample"
            )
        ),
        example={"rollout.decode": "static"},
    ),
    Needs(
        fields_but(MultiTurnConfig, "rollout.multi_turn", "env"),
        unless="rollout.multi_turn.env is set",
        active=lambda cfg: cfg.rollout.multi_turn.env is not None,
        example={"rollout.multi_turn.env": "lookup", "rollout.multi_turn.max_total_length": 64},
    ),
)
