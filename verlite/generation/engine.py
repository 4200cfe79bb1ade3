"""The interface between the trainer and a generation engine.

A rollout worker holds one engine. What an engine must do, and nothing more:

- ``load_bucket(bucket)``: take one bucket of a weight sync (``verlite.generation.weights``)
  into its model, and check what landed against the actor's checksum (after the last
  bucket: the sync's seconds); ``version`` is the version it holds, checked (None: none),
  and ``require(version)`` refuses any other.
- ``generate(prompts, params, noise)``: responses to left-padded prompts as the step
  TensorDict of ``verlite.step_batch``, each at most its row's ``token_budget`` long where
  the prompts carry one (``generation.sampling.row_budgets``: a multi-turn trajectory's
  room), each response token drawn with its row's own noise (``verlite.generation.noise``:
  per-sample keys, so that a run does not depend on its layout),
  with the token ids and ``rollout_log_probs``, the log-probabilities the engine drew
  each token with (float32, 0 on pads).

:class:`NativeEngine`, verlite's KV-cached sampler over a Hugging Face model, is the one
implementation; an inference server (vLLM, SGLang) would be another, behind the same
methods, without touching the trainer.
"""

from __future__ import annotations

from typing import Protocol

from tensordict import TensorDict
from torch import nn

from verlite.generation.decode import EAGER, DecodeSettings
from verlite.generation.noise import Noise
from verlite.generation.sampler import Sampler
from verlite.generation.sampling import SamplingParams
from verlite.generation.weights import WeightBucket, WeightReceiver


class GenerationEngine(Protocol):
    def load_bucket(self, bucket: WeightBucket) -> float | None: ...

    def require(self, version: int) -> None: ...

    @property
    def version(self) -> int | None: ...

    def generate(
        self, prompts: TensorDict, params: SamplingParams, noise: Noise | None
    ) -> TensorDict: ...


class NativeEngine:
    """:class:`~verlite.generation.sampler.Sampler` on a model of its own, which only
    weight syncs change."""

    def __init__(
        self,
        model: nn.Module,
        *,
        eos_token_id: int,
        pad_token_id: int,
        who: str,
        adapters_only: bool = False,
        decode: DecodeSettings = EAGER,
    ) -> None:
        # Parameters keep requires_grad (generation runs under no_grad either way): frozen
        # ones take other CPU matmul kernels, whose rounding differs from the actor's.
        self.receiver = WeightReceiver(model, who=who, adapters_only=adapters_only)
        self.sampler = Sampler(
            model,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            lockstep=False,
            decode=decode,
        )

    def load_bucket(self, bucket: WeightBucket) -> float | None:
        return self.receiver.load(bucket)

    def require(self, version: int) -> None:
        self.receiver.require(version)

    @property
    def version(self) -> int | None:
        return self.receiver.version

    def generate(
        self, prompts: TensorDict, params: SamplingParams, noise: Noise | None
    ) -> TensorDict:
        return self.sampler.generate(prompts, params, noise)
