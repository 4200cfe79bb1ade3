"""TrainingWorker: a worker that trains with a :class:`~verlite.workers.train_engine.TrainEngine`,
the base of the actor and critic workers; it adds checkpoints of the training state."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from verlite.controller import Worker

if TYPE_CHECKING:
    from verlite.workers.train_engine import TrainEngine


class TrainingWorker(Worker):
    """A worker that trains with a :class:`~verlite.workers.train_engine.TrainEngine` (``self.engine``,
    built by the subclass's ``init_model``): checkpoints of its training state."""

    engine: TrainEngine

    def save_checkpoint(self, path: str) -> None:
        """Collective over the group: model, optimizer and schedule (DCP), and this rank's RNG."""
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        self.engine.save(folder)
        torch.save({"cpu": torch.get_rng_state()}, folder / f"rng_rank{self.rank}.pt")

    def load_checkpoint(self, path: str) -> None:
        """Collective: restore what ``save_checkpoint`` wrote, with any number of ranks then.

        The RNG file of this rank is restored when it exists (same worker count as the save);
        sampling seeds come from the step number, so a different count still resumes cleanly.
        """
        folder = Path(path)
        self.engine.load(folder)
        rng_file = folder / f"rng_rank{self.rank}.pt"
        if rng_file.is_file():
            torch.set_rng_state(torch.load(rng_file, weights_only=True)["cpu"])
