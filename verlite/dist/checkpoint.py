"""Save and load one worker group's training state with torch.distributed.checkpoint (DCP).

Model and optimizer state go through ``get_state_dict`` / ``set_state_dict``, which key
everything by the unwrapped model's parameter names whatever the wrapping (none, DDP,
FSDP2), and DCP writes each rank's shard. Loading reshards: a checkpoint saved by N ranks
loads into M ranks. DCP files are not pickles, so loading runs no code.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


def save_train_state(model: nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    """Collective: every rank of the group calls it with the same ``path``."""
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(path))


def load_train_state(model: nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    """Collective: load in place into an identically built model and optimizer."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
