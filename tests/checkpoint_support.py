"""A checkpoint folder as verlite writes it, with no weights: enough for every check made
before Ray starts (which reads the JSON files and the DCP index, an index of no values here,
and sees that the other files exist)."""

from __future__ import annotations

import json
import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from verlite.checkpoint_files import SCHEDULE, TRAIN_STATE


def fake_checkpoint(output_dir: Path, step: int, roles: Sequence[str], **saved: Any) -> Path:
    """``output_dir/checkpoints/step_<step>``; ``saved`` joins the trainer state (``config=``
    or the ``model=`` settings older checkpoints recorded)."""
    folder = output_dir / "checkpoints" / f"step_{step}"
    for role in roles:
        (folder / role / TRAIN_STATE).mkdir(parents=True, exist_ok=True)
        index = pickle.dumps(Metadata(state_dict_metadata={}, storage_data={}))
        (folder / role / TRAIN_STATE / ".metadata").write_bytes(index)
        (folder / role / SCHEDULE).write_text(json.dumps(_schedule_state()))
    state = {"step": step, "loader": {}, "kl_coef": 0.0, **saved}
    (folder / "trainer_state.json").write_text(json.dumps(state))
    return folder


def _schedule_state() -> dict[str, Any]:
    """An LR schedule's state as ``TrainEngine.save`` writes it (LambdaLR's, before a step)."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)])
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0).state_dict()
