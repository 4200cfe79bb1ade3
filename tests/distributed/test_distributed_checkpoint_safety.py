"""Loading a training-state checkpoint runs no code from its files: DCP's metadata pickle
and its non-tensor values are the two places a crafted checkpoint could carry code."""

from __future__ import annotations

import contextlib
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from verlite.distributed.sharded_state import (
    CheckpointLoadError,
    load_train_state,
    save_train_state,
)


class _RunsCode:
    """Unpickling this would create ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def _model_and_optimizer(lr: float = 0.01) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model(torch.randn(2, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_round_trip_restores_weights_and_hyperparameters(tmp_path: Path) -> None:
    model, optimizer = _model_and_optimizer(lr=0.0123)
    save_train_state(model, optimizer, tmp_path / "ck")
    restored, restored_optimizer = _model_and_optimizer(lr=0.5)
    with torch.no_grad():
        for p in restored.parameters():
            p.zero_()
    load_train_state(restored, restored_optimizer, tmp_path / "ck", create_state=lambda: None)
    for a, b in zip(model.parameters(), restored.parameters(), strict=True):
        assert torch.equal(a, b)
    assert restored_optimizer.param_groups[0]["lr"] == 0.0123  # a non-tensor value


def test_metadata_that_names_other_code_is_refused(tmp_path: Path) -> None:
    model, optimizer = _model_and_optimizer()
    save_train_state(model, optimizer, tmp_path / "ck")
    marker = tmp_path / "ran"
    (tmp_path / "ck" / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    with pytest.raises(CheckpointLoadError, match=r"refers to posix\.system, which is not a"):
        load_train_state(model, optimizer, tmp_path / "ck", create_state=lambda: None)
    assert not marker.exists()


def test_the_refusal_is_named_whatever_dcp_makes_of_the_readers_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # torch 2.11's loader (the GPU machine's) swallows what the reader raises and reports
    # only "metadata is None": the metadata is checked before DCP reads it.
    def load_of_torch_2_11(state: object, *, storage_reader: Any, planner: object) -> None:
        with contextlib.suppress(Exception):
            storage_reader.read_metadata()
        raise AssertionError("metadata is None")

    model, optimizer = _model_and_optimizer()
    save_train_state(model, optimizer, tmp_path / "ck")
    marker = tmp_path / "ran"
    (tmp_path / "ck" / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    monkeypatch.setattr(dcp, "load", load_of_torch_2_11)
    with pytest.raises(CheckpointLoadError, match=r"refers to posix\.system, which is not a"):
        load_train_state(model, optimizer, tmp_path / "ck", create_state=lambda: None)
    assert not marker.exists()


def test_a_non_tensor_value_that_would_run_code_is_refused(tmp_path: Path) -> None:
    model, optimizer = _model_and_optimizer()
    marker = tmp_path / "ran"
    model_state, optim_state = get_state_dict(model, optimizer)
    optim_state["param_groups"][0]["lr"] = _RunsCode(marker)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp_path / "ck"))
    assert not marker.exists()
    with pytest.raises(CheckpointLoadError, match="UnpicklingError: Weights only load failed"):
        load_train_state(model, optimizer, tmp_path / "ck", create_state=lambda: None)
    assert not marker.exists()
