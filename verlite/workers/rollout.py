"""The rollout worker (``rollout.placement=split``): generation only, with a model of its own
that weight syncs from the actor replace (``verlite.generation.weights``); no optimizer."""

from __future__ import annotations

from collections.abc import Sequence

import ray
from tensordict import TensorDict

from verlite.core import seeds
from verlite.data import PromptRecord
from verlite.generation import GenerationEngine, NativeEngine, SamplingParams, WeightBucket
from verlite.models import build_policy, worker_device
from verlite.models.precision import store_for_generation
from verlite.workers.peak_memory import PeakMemory, with_peak
from verlite.workers.policy_worker import PolicyWorker, check_generation_fits


class RolloutWorker(PolicyWorker):
    """One rank of the rollout group; each rank generates its share on its own (no
    collectives), with weights of the version the trainer names."""

    generation_engine: GenerationEngine

    def init_model(self) -> None:
        cfg = self.cfg
        self.device = worker_device(cfg)
        check_generation_fits(cfg, self.vocab_size)
        self.load_environment()
        self.peak_memory = PeakMemory(self.device)
        # Its initial weights never generate: the first sync replaces them. A LoRA policy's
        # sync sends the adapters alone: the base is built as the actor builds it (same
        # seed), and each sync checks that it is the actor's. Stored as a model that only
        # samples (``models.precision.store_for_generation``: under bf16-mixed its linear
        # layers in bf16, a tied head its own bf16 one): the dtypes the actor's syncs send.
        lora = cfg.actor.lora
        model = build_policy(
            cfg.model,
            vocab_size=self.vocab_size,
            max_positions=cfg.max_sequence_length,
            seed=seeds.policy_init(cfg.trainer.seed),
            lora=lora,
        )
        model = store_for_generation(model, cfg.precision).to(self.device)
        self.generation_engine = NativeEngine(
            model,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
            who=f"rollout rank {self.rank} (node {self.node_info()['node_ip']})",
            adapters_only=lora.rank > 0,
            decode=self.decode_settings(model, self.device, lockstep=False, trains_on=True),
        )

    def init_distributed(self, master_addr: str, master_port: int) -> None:
        """Rollout ranks share no collectives: no process group to join."""

    def load_bucket(self, bucket: ray.ObjectRef[WeightBucket]) -> tuple[int | None, float] | None:
        """Take one bucket of a weight sync (the actor's reference, handed over by Ray
        from the actor's call), checked where it landed (raises
        :class:`~verlite.generation.WeightSyncError`); after the last bucket, the version now
        held and the sync's seconds."""
        self.peak_memory.begin()  # a sync is the first work of the step it is for
        seconds = self.generation_engine.load_bucket(ray.get(bucket))
        return None if seconds is None else (self.generation_engine.version, seconds)

    def generate(
        self,
        prompts: TensorDict,
        params: SamplingParams,
        seed: int,
        version: int,
        records: Sequence[PromptRecord] | None = None,
    ) -> TensorDict:
        """Responses to this rank's prompts with the weights of ``version`` (refused with
        any other), drawn as the actor's :meth:`~verlite.workers.actor.ActorWorker.generate`,
        with this rank's peak memory since its sync or this call began (``PEAK_COLUMN``)."""
        self.generation_engine.require(version)
        self.peak_memory.begin()
        batch = self.sample(
            self.generation_engine.generate, prompts, params, seed, records, device=self.device
        )
        return with_peak(batch.cpu(), self.peak_memory)
