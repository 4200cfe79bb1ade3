"""TrainingWorker: a worker that trains with a :class:`~verlite.workers.train_engine.TrainEngine`,
the base of the actor and critic workers; it adds checkpoints of the training state."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tensordict import TensorDict

from verlite.checkpoint_files import RNG_FILE
from verlite.controller import Worker
from verlite.core.metrics import MetricDict
from verlite.distributed import backend_for
from verlite.distributed.rng_state import read_rng_states
from verlite.distributed.sharded_state import CheckpointLoadError, CheckpointMismatchError
from verlite.errors import DamagedFileError, MismatchedFileError
from verlite.models import resolve_device
from verlite.models.flops import DecoderShape
from verlite.workers.peak_memory import PeakMemory

if TYPE_CHECKING:
    from verlite.config import Config
    from verlite.workers.train_engine import LossFn, TrainEngine


class TrainingWorker(Worker):
    """A worker that trains with a :class:`~verlite.workers.train_engine.TrainEngine` (``self.engine``,
    built by the subclass's ``init_model``): checkpoints of its training state, the peak
    memory of its work in a step (``self.peak_memory``, also built there) and what the
    driver's MFU figures need."""

    cfg: Config
    engine: TrainEngine
    peak_memory: PeakMemory
    loss_fn: LossFn

    def backend(self) -> str:
        """The backend of the device the model runs on (``model.device``), not of the GPUs
        the worker was given: a worker given a GPU whose model runs on the CPU joins gloo
        (NCCL reduces device tensors only: DDP's first broadcast of its CPU parameters, and
        every count the engine all-reduces, would fail). A role that keeps its FSDP2 shards
        on the host (``offload=all``) joins gloo for them beside NCCL (``backend_for``)."""
        host_shards = getattr(self.cfg, self.role).offload == "all"
        return backend_for(resolve_device(self.cfg.model), host_shards=host_shards)

    def _update(self, td: TensorDict) -> MetricDict:
        """The updates of one step over this rank's share, ``(mini_batches, rows)``, and the
        peak memory of the role's work in the step (``perf/max_memory_allocated_gb/<role>``)."""
        self.peak_memory.begin()
        metrics = self.engine.train_step(td, self.loss_fn)
        metrics.update(self._peak())
        return metrics

    def _peak(self) -> MetricDict:
        """The peak memory of the role's work in the step, which ends the step's window."""
        return {
            f"perf/max_memory_allocated_gb/{self.engine.metric_prefix}": self.peak_memory.metric()
        }

    def compute_profile(self) -> tuple[str | None, DecoderShape]:
        """Asked once at start-up: the name of this rank's GPU (None on CPU) and what its
        model's FLOPs are counted from."""
        device = self.engine.device
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
        return name, DecoderShape.of(self.engine.model)

    def save_checkpoint(self, path: str) -> None:
        """Collective over the group: model, optimizer and schedule (DCP), and this rank's RNG
        states: the CPU's, and its GPU's on cuda (LoRA's dropout draws there)."""
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        self.engine.save(folder)
        states = {"cpu": torch.get_rng_state()}
        device = self.engine.device
        if device.type == "cuda":
            states["cuda"] = torch.cuda.get_rng_state(device)
        torch.save(states, folder / RNG_FILE.format(rank=self.rank))

    def load_checkpoint(self, path: str) -> None:
        """Collective: restore what ``save_checkpoint`` wrote, with any number of ranks then.

        The RNG file of this rank is restored when it exists: each rank of a resume by as many
        workers as the save's restores its own; by fewer, the ranks it has restore theirs and
        the others' are never read; by more, the ranks past the save's keep their seeded
        state. Sampling seeds come from the step number, so a different count still resumes
        cleanly. Damaged bytes are bad input that names what to resume instead
        (:class:`DamagedFileError`); values of another model than the config's are
        :class:`MismatchedFileError` (the driver knows whether its settings or damage is
        why); an ``OSError`` reading a file is raised as it is (the disk's,
        not the user's input)."""
        folder = Path(path)
        try:
            self.engine.load(folder)
        except CheckpointLoadError as exc:
            raise DamagedFileError(str(exc)) from None
        except CheckpointMismatchError as exc:
            raise MismatchedFileError(str(exc)) from None
        rng_file = folder / RNG_FILE.format(rank=self.rank)
        if rng_file.is_file():
            try:
                states = read_rng_states(rng_file)
            except CheckpointLoadError as exc:
                raise DamagedFileError(f"{rng_file} {exc}") from None
            torch.set_rng_state(states["cpu"])
            device = self.engine.device
            # a checkpoint of CPU workers resumed on a GPU (model.device may change) has none
            if device.type == "cuda" and "cuda" in states:
                torch.cuda.set_rng_state(states["cuda"], device)
