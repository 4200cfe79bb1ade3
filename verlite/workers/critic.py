"""The critic worker: value predictions and value-model updates."""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import torch
from tensordict import TensorDict
from torch import nn

from verlite.config import Config
from verlite.core import seeds
from verlite.core.metrics import Metric, MetricDict
from verlite.models import build_value_model, worker_device
from verlite.workers.forward import response_values
from verlite.workers.objectives import CriticLossSettings, value_loss
from verlite.workers.peak_memory import PeakMemory
from verlite.workers.train_engine import TrainEngine
from verlite.workers.training_worker import TrainingWorker


def _values(model: nn.Module, td: TensorDict) -> dict[str, torch.Tensor]:
    return {"values": response_values(model, td)}


class CriticWorker(TrainingWorker):
    """One rank of the critic group; the model is built by ``init_model``."""

    def __init__(self, *, cfg: Config, vocab_size: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.cfg = cfg
        self.vocab_size = vocab_size

    def init_model(self) -> None:
        cfg = self.cfg
        max_positions = cfg.max_sequence_length
        device = worker_device(cfg)
        model = build_value_model(
            cfg.model,
            vocab_size=self.vocab_size,
            max_positions=max_positions,
            seed=seeds.critic_init(cfg.trainer.seed),
        )
        self.engine = TrainEngine(
            model,
            cfg=cfg.critic,
            total_updates=cfg.role_sizes("critic").total_updates,
            metric_prefix="critic",
            device=device,
            precision=cfg.precision,
        )
        self.loss_fn = partial(value_loss, settings=CriticLossSettings.from_config(cfg.critic))
        self.peak_memory = PeakMemory(device)
        self._values_seconds: MetricDict = {}  # compute_values's, until the update

    def compute_values(self, td: TensorDict) -> TensorDict:
        """The values of this rank's share of the step batch; its seconds are reported with
        the update's metrics (they end on the host: on cuda the GPU's work is done)."""
        self.peak_memory.begin()
        started = time.perf_counter()
        values = self.engine.infer(td, _values).cpu()
        self._values_seconds = {"timing_s/values": Metric.max(time.perf_counter() - started)}
        return values

    def update_critic(self, td: TensorDict) -> MetricDict:
        """The value updates of one step over this rank's share, ``(mini_batches, rows)``,
        the peak memory of the critic's work in the step and the seconds of its value pass
        (the slowest rank's)."""
        seconds, self._values_seconds = self._values_seconds, {}
        return {**self._update(td), **seconds}
