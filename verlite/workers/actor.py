"""The actor worker: generation, log-probs (policy and frozen reference), policy updates."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from functools import partial
from pathlib import Path

import ray
import torch
from tensordict import TensorDict
from torch import nn

from verlite.config import Config
from verlite.core import seeds
from verlite.core.metrics import Metric, MetricDict
from verlite.core.partition import MicroBatchPlan
from verlite.data import PromptRecord
from verlite.distributed import (
    distinct_entries,
    first_names,
    full_state_dict,
    full_tensor,
    inference_module,
    model_state,
    sharded,
)
from verlite.generation import (
    DecodeSettings,
    Sampler,
    SamplingParams,
    SyncLayout,
    WeightBucket,
    base_checksum,
    make_bucket,
    split_frozen,
    sync_layout,
)
from verlite.models import build_policy, worker_device
from verlite.models.generation_ends import mark_generation_ends
from verlite.models.hf import HFModel
from verlite.models.lora import adapters_disabled, save_adapter
from verlite.models.precision import (
    autocast,
    generation_dtypes,
    refresh_inference_copy,
    stored_copy,
    untied_head,
)
from verlite.models.varlen import use_verlite_attention
from verlite.workers.forward import response_log_probs
from verlite.workers.objectives import ActorLossSettings, ppo_loss
from verlite.workers.peak_memory import PeakMemory
from verlite.workers.policy_worker import PolicyWorker, check_generation_fits
from verlite.workers.train_engine import TrainEngine, infer
from verlite.workers.training_worker import TrainingWorker


def _log_probs(key: str, model: nn.Module, td: TensorDict) -> dict[str, torch.Tensor]:
    temperature = float(td.get_non_tensor("temperature"))
    log_probs, _ = response_log_probs(model, td, temperature=temperature, entropy="none")
    return {key: log_probs}


def reference_home(offload: str, device: torch.device) -> torch.device:
    """Where the frozen reference waits between its log-prob passes: on the CPU when the actor
    offloads (``actor.offload`` not none), so that it holds no device memory while the
    policy generates and trains; else on ``device``."""
    return torch.device("cpu") if offload != "none" else device


@contextlib.contextmanager
def on_device(module: nn.Module, device: torch.device, *, home: torch.device) -> Iterator[None]:
    """``module`` on ``device`` for the block and back on ``home`` after, errors included
    (nothing moves when both are the same device)."""
    module.to(device)
    try:
        yield
    finally:
        module.to(home)


def generation_copy(policy: nn.Module, cfg: Config, decode: DecodeSettings) -> nn.Module | None:
    """What a colocated actor generates from besides its trained model
    (``Config.generation_copied``), made from ``policy`` before it is wrapped for training:
    a copy stored for generation as a rollout worker's model is
    (``models.precision.stored_copy``, ``store_for_generation``: under bf16-mixed bf16
    linear weights and a tied head made its own bf16 one, computing bit for bit what the
    trained model computes under autocast), refreshed in place before a generation when the
    trained weights changed since (``refresh_inference_copy``: ``ActorWorker.generate``).
    An FSDP actor's is whole on its device: it gathers the shards once per weight version, where
    generating through the sharded model would gather every layer at every decode step (from
    the host with ``actor.offload=all``), its ranks in lockstep. A captured step reads fixed
    addresses, and from the fp32 model it would cast every weight again at every replayed
    step (autocast's cache cannot hold casts across captures). None otherwise: the trained
    model generates, autocast casting its weights once per generation."""
    if not cfg.generation_copied(decode.mode):
        return None
    return stored_copy(policy, cfg.precision, generation=True)


class ActorWorker(TrainingWorker, PolicyWorker):
    """One rank of the actor group; the model is built by ``init_model`` once the group's
    process group exists (FSDP needs it)."""

    def init_model(self) -> None:
        cfg = self.cfg
        device = worker_device(cfg)
        if cfg.rollout.placement == "colocated":  # it generates, on this GPU
            check_generation_fits(cfg, self.vocab_size)
        self.load_environment()
        policy = self._build_policy()
        # The reference is the initial policy, frozen; a plain copy on every rank needs no
        # collectives, stored as models that are never trained are (``models.precision``).
        # A LoRA policy's initial policy is its base: the policy itself with its adapters
        # off (``models.lora``), no copy.
        self._reference_home = reference_home(cfg.actor.offload, device)
        self.reference: nn.Module | None = None
        if cfg.use_reference and not self.lora:
            reference = stored_copy(policy, cfg.precision).requires_grad_(False)
            # Switched under autocast, as its passes run: with packing, a forward proves that
            # packed sequences stay apart, and bf16 linear layers (bf16-mixed) run only under
            # autocast (it failed: "expected m1 and m2 to have the same dtype").
            with autocast(cfg.precision, next(reference.parameters()).device):
                use_verlite_attention(reference, packing=cfg.actor.packing)
            self.reference = reference.to(self._reference_home)
        colocated = cfg.rollout.placement == "colocated"
        decode = self.decode_settings(
            policy, device, lockstep=cfg.actor_lockstep, trains_on=colocated
        )
        self._generation_copy = generation_copy(policy, cfg, decode)
        if self._generation_copy is not None:
            self._generation_copy.to(device)
        self._staging = torch.empty(0, dtype=torch.uint8)  # a weight sync's, grown on first use
        self._base: tuple[int, int] | None = None  # a LoRA base's checksum, at the first sync
        self._rollout_seconds: MetricDict = {}  # generate_with_log_probs's, until the update
        self.engine = TrainEngine(
            policy,
            cfg=cfg.actor,
            total_updates=cfg.role_sizes("actor").total_updates,
            metric_prefix="actor",
            device=device,
            precision=cfg.precision,
        )
        # The version of the trained weights the generation copy holds: the initial policy's,
        # which it was copied from (``TrainEngine.weights_version``).
        self._copy_version = self.engine.weights_version
        trained = inference_module(self.engine.model)
        self.sampler = Sampler(
            trained if self._generation_copy is None else self._generation_copy,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
            lockstep=cfg.actor_lockstep,
            decode=decode,
        )
        self.loss_fn = partial(ppo_loss, settings=ActorLossSettings.from_config(cfg.actor))
        # The dtype a weight sync sends each entry of the policy's state in: the rollout
        # model's (``models.precision.generation_dtypes``), and the tied head's name when
        # the rollout model holds it apart (``untied_head``).
        self._sent_dtypes = generation_dtypes(trained, cfg.precision)
        self._untied_head = untied_head(trained, cfg.precision)
        self.peak_memory = PeakMemory(device)

    @property
    def lora(self) -> bool:
        return self.cfg.actor.lora.rank > 0

    def _build_policy(self) -> nn.Module:
        """The initial policy, the same on every rank (and on every rollout worker)."""
        cfg = self.cfg
        return build_policy(
            cfg.model,
            vocab_size=self.vocab_size,
            max_positions=cfg.max_sequence_length,
            seed=seeds.policy_init(cfg.trainer.seed),
            lora=cfg.actor.lora,
        )

    def generate(
        self,
        prompts: TensorDict,
        params: SamplingParams,
        seed: int,
        records: Sequence[PromptRecord] | None = None,
        *,
        in_step: bool = False,
    ) -> TensorDict:
        """Responses to this rank's prompts (trajectories with ``rollout.multi_turn``, whose
        environments get ``records``: :meth:`PolicyWorker.sample`). Sampling draws from each
        row's ``sample_key`` (``rollout.randomness=per_sample``), or from this rank's stream
        of the step seeded ``seed`` (``verlite.core.seeds.rank_sampling``). ``in_step``: a
        training step's generation (validation's is not), whose peak memory counts in the
        step's, reported with the update."""
        if in_step:
            self.peak_memory.begin()
        version = self.engine.weights_version
        if self._generation_copy is not None and self._copy_version != version:
            # Collective under FSDP2: each shard gathered whole once, where it is (a shard
            # offloaded to the host copied to the device first: ``distributed.full_tensor``).
            # Only when the weights changed since the copy's last refresh: a step's further
            # draws (``algorithm.dynamic_sampling``) and a validation reuse it. Every rank
            # decides alike: the version moves on every rank at once.
            state = model_state(self.engine.model)
            refresh_inference_copy(
                self._generation_copy, lambda name: full_tensor(state[name]), first_names(state)
            )
            self._copy_version = version
        cache_casts = not sharded(self.sampler.model)
        return self.sample(
            self.sampler.generate,
            prompts,
            params,
            seed,
            records,
            device=self.engine.device,
            cache_casts=cache_casts,
        ).cpu()

    def generate_with_log_probs(
        self,
        prompts: TensorDict,
        params: SamplingParams,
        seed: int,
        with_old: bool,
        records: Sequence[PromptRecord] | None = None,
    ) -> TensorDict:
        """The step batch of :meth:`generate` with the columns of :meth:`compute_log_probs`:
        log-probs need no reward, so they are computed where the rows were generated,
        without sending the batch back and forth through the driver."""
        started = time.perf_counter()
        batch = self.generate(prompts, params, seed, records, in_step=True)
        generated = time.perf_counter()
        batch.update(self.compute_log_probs(batch, with_old))
        # The split of this call's time, reported with the update's metrics (both end on the
        # host, so on cuda the GPU's work is done).
        self._rollout_seconds = {
            "timing_s/gen": Metric.max(generated - started),
            "timing_s/log_probs": Metric.max(time.perf_counter() - generated),
        }
        return batch

    def compute_log_probs(self, td: TensorDict, with_old: bool) -> TensorDict:
        """``old_log_probs`` of the current policy (with ``with_old``), and ``ref_log_prob``
        when a KL term is on; both passes run the same micro-batches."""
        self.peak_memory.begin()
        out = TensorDict({}, batch_size=td.batch_size)
        if not with_old and not self.cfg.use_reference:
            return out
        plan = self.engine.plan(td, training=False)
        if with_old:
            out = self.engine.infer(td, partial(_log_probs, "old_log_probs"), plan)
        if self.cfg.use_reference:
            out["ref_log_prob"] = self._reference_log_probs(td, plan)
        return out.cpu()

    def _reference_log_probs(self, td: TensorDict, plan: MicroBatchPlan) -> torch.Tensor:
        ref_fn = partial(_log_probs, "ref_log_prob")
        if self.lora:
            with adapters_disabled(self.engine.model):
                log_probs: torch.Tensor = self.engine.infer(td, ref_fn, plan)["ref_log_prob"]
                return log_probs
        assert self.reference is not None
        with (
            on_device(self.reference, self.engine.device, home=self._reference_home),
            autocast(self.cfg.precision, self.engine.device),
        ):
            ref = infer(
                self.reference,
                td,
                ref_fn,
                plan=plan,
                device=self.engine.device,
                packing=self.cfg.actor.packing,
            )
        ref_log_prob: torch.Tensor = ref["ref_log_prob"]
        return ref_log_prob

    def weight_layout(self) -> SyncLayout:
        """The buckets of a weight sync (``verlite.generation.weights``), the same on every rank."""
        return self._layout_of(self._synced_state())

    def _layout_of(self, state: dict[str, torch.Tensor]) -> SyncLayout:
        return sync_layout(state, self._sync_bucket_bytes, self._sent_dtypes)

    def _synced_state(self) -> dict[str, torch.Tensor]:
        """What a weight sync sends: the policy's state as the rollout model, built alike and
        stored for generation, holds it (``WeightReceiver`` expects each of its distinct
        tensors): a tensor under two names once, but a tied head the rollout model holds
        apart (bf16-mixed: ``models.precision.store_for_generation``) under its own name
        too, cast to bf16 on the actor; a LoRA policy's adapters only."""
        state = model_state(self.engine.model)
        distinct = distinct_entries(state)
        state = {
            name: value
            for name, value in state.items()
            if name in distinct or name == self._untied_head
        }
        return split_frozen(inference_module(self.engine.model), state)[0] if self.lora else state

    def _base_checksum(self) -> tuple[int, int] | None:
        """Collective: the checksum of a LoRA policy's frozen base (computed once), which
        an adapters-only sync's bucket 0 carries; None without LoRA."""
        if not self.lora:
            return None
        if self._base is None:
            state = model_state(self.engine.model)
            _, base = split_frozen(inference_module(self.engine.model), state)
            dtypes = self._sent_dtypes
            self._base = base_checksum(
                full_tensor(value).to(dtypes[name]) for name, value in base.items()
            )
        return self._base

    def publish_bucket(self, version: int, index: int) -> WeightBucket | None:
        """Collective: bucket ``index`` of the sync of ``version``, from rank 0 (the others
        take part in FSDP's gathers and return None). Bucket 0 starts a sync: the state
        and its layout are read then, and every bucket must follow, in order, before the
        next update. Its small tensors are staged in one buffer that the next bucket
        overwrites: put the bucket in the object store first (:meth:`put_bucket`)."""
        started = time.perf_counter()
        base = None
        if index == 0:
            base = self._base_checksum()
            self._publishing = self._synced_state()
            self._layout = self._layout_of(self._publishing)
        specs = self._layout.buckets[index]
        # Cast once, here, to what the rollout model holds (a no-op where it is the same).
        tensors = [
            full_tensor(self._publishing[spec.name]).to(self._sent_dtypes[spec.name])
            for spec in specs
        ]
        if self.rank != 0:
            return None
        size = self._layout.staging_bytes
        if self._staging.numel() < size:
            self._staging = torch.empty(size, dtype=torch.uint8)
        return make_bucket(
            version,
            index,
            self._layout,
            tensors,
            staging=self._staging,
            started=started,
            base_checksum=base,
        )

    def put_bucket(self, version: int, index: int) -> ray.ObjectRef[WeightBucket] | None:
        """Collective: :meth:`publish_bucket` put in the object store by rank 0; the call
        returns the reference, so waiting on it (the driver does, to name an actor's
        failure as the actor's) never fetches the weights."""
        bucket = self.publish_bucket(version, index)
        return None if bucket is None else ray.put(bucket)

    @property
    def _sync_bucket_bytes(self) -> int:
        return int(self.cfg.rollout.sync_bucket_mb * 2**20)

    def export_hf(self, path: str) -> None:
        """Collective: the trained policy in Hugging Face format, gathered on and written by
        rank 0 only, its generation config ending a response at the tokens the rollouts ended
        at (``models.generation_ends.mark_generation_ends``). A LoRA policy is written as a peft
        adapter folder, with the base it applies to in ``base/`` unless ``model.path`` names it
        (``models.lora.save_adapter``)."""
        state = full_state_dict(self.engine.model, rank0_only=True)
        if self.rank == 0:
            model = self._build_policy()
            model.load_state_dict(state)
            # Hugging Face generate on the export ends a response where the rollouts did.
            ends = [self.eos_token_id, *self.cfg.rollout.stop_token_ids]
            mark_generation_ends(model, ends, self.pad_token_id)
            if self.lora:
                save_adapter(model, Path(path), base_path=self.cfg.model.path)
            else:
                assert isinstance(model, HFModel)  # without adapters: the causal LM itself
                model.save_pretrained(path)

    def update_actor(self, td: TensorDict) -> MetricDict:
        """The policy updates of one step over this rank's share, ``(mini_batches, rows)``,
        the peak memory of the actor's work in the step and, when it generated the step's
        batch, the seconds of its generation and log-probs (the slowest rank's)."""
        return {**self._update(td), **self._step_seconds()}

    def skip_update(self) -> MetricDict:
        """A step without the policy's update (the critic's warm-up, ``critic.warmup_steps``):
        what the update reports of the step besides its own, the peak memory of the actor's
        work in it (since this call when it did none: a rollout group generated, and no
        log-probs were asked) and its generation's seconds."""
        self.peak_memory.begin()
        return {**self._peak(), **self._step_seconds()}

    def _step_seconds(self) -> MetricDict:
        seconds, self._rollout_seconds = self._rollout_seconds, {}
        return seconds
