"""PolicyWorker: what the workers that sample from the policy share (the actor's and the
rollout's): the token ids generation needs, and the noise each draws with."""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict

from verlite.config import Config
from verlite.controller import Worker
from verlite.rollout import Noise, SamplingParams, noise_for


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

    def noise(
        self, prompts: TensorDict, params: SamplingParams, seed: int, device: torch.device
    ) -> Noise | None:
        """What this rank samples ``prompts`` with: each row's ``sample_key``
        (``rollout.randomness=per_sample``), or a stream seeded ``seed + rank``."""
        return noise_for(
            prompts,
            temperature=params.temperature,
            horizon=params.max_new_tokens,
            randomness=self.cfg.rollout.randomness,
            stream_seed=seed + self.rank,
            device=device,
        )
