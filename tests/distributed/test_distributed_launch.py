"""run_on_ranks: results by rank, and failures (raise, hard exit, timeout) reported, not hung."""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from verlite import distributed as vdist

# A rank that another's failure or the timeout should stop sleeps this long, then leaves a
# mark: a mark found after run_on_ranks returned says it waited for that rank instead.
_STUCK_S = 60.0


def _echo_rank(rank: int, world: int, tag: str) -> tuple[int, int, str, torch.Tensor]:
    dist.barrier()
    return rank, world, tag, torch.full((2,), float(rank))


def _sleep(rank: int, world: int, marks: str) -> None:
    time.sleep(_STUCK_S)
    Path(marks, f"rank{rank}").touch()


def _raise_on_rank_one(rank: int, world: int, marks: str) -> None:
    if rank == 1:
        raise ValueError("boom on purpose")
    _sleep(rank, world, marks)


def _exit_on_rank_one(rank: int, world: int, marks: str) -> None:
    if rank == 1:
        os._exit(3)
    _sleep(rank, world, marks)


def _loaded(rank: int, world: int) -> list[str]:
    return [m for m in ("ray", "tensordict", "verlite.workers.train_engine") if m in sys.modules]


def test_ranks_start_with_the_training_engine_loaded_and_no_ray() -> None:
    """A rank forks from a server that imported the training engine once (imported per rank,
    it cost each rank of the invariance audit 2-4 s), and no Ray: this module imports
    neither, so a rank holds what the server preloaded."""
    assert vdist.run_on_ranks(_loaded, world_size=1) == [
        ["tensordict", "verlite.workers.train_engine"]
    ]


def test_results_come_back_in_rank_order() -> None:
    out = vdist.run_on_ranks(_echo_rank, world_size=3, args=("tag",), timeout_s=120)
    assert [r[:3] for r in out] == [(0, 3, "tag"), (1, 3, "tag"), (2, 3, "tag")]
    for rank, r in enumerate(out):
        assert torch.equal(r[3], torch.full((2,), float(rank)))


def test_raising_rank_is_named_with_its_traceback(tmp_path: Path) -> None:
    with pytest.raises(vdist.RankFailedError) as info:
        vdist.run_on_ranks(_raise_on_rank_one, world_size=2, args=(str(tmp_path),), timeout_s=120)
    assert list(tmp_path.iterdir()) == []  # rank 0 stopped, not waited for
    assert info.value.rank == 1
    message = str(info.value)
    assert "rank 1" in message
    assert "ValueError: boom on purpose" in message
    assert "_raise_on_rank_one" in message  # the remote traceback, not just the message
    assert multiprocessing.active_children() == []


def test_killed_rank_is_reported_not_hung(tmp_path: Path) -> None:
    with pytest.raises(vdist.RankFailedError, match=r"rank 1 exited with code 3") as info:
        vdist.run_on_ranks(_exit_on_rank_one, world_size=2, args=(str(tmp_path),), timeout_s=120)
    assert list(tmp_path.iterdir()) == []  # rank 0 stopped, not waited for
    assert info.value.rank == 1
    assert multiprocessing.active_children() == []


def test_timeout_stops_every_rank(tmp_path: Path) -> None:
    with pytest.raises(vdist.RankTimeoutError, match=r"ranks \[0, 1\] still running"):
        vdist.run_on_ranks(_sleep, world_size=2, args=(str(tmp_path),), timeout_s=5)
    assert list(tmp_path.iterdir()) == []  # both stopped at the timeout, not waited for
    assert multiprocessing.active_children() == []


def test_nccl_ranks_take_one_visible_gpu_each(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert vdist.rank_gpus("nccl", 2) == ["3", "5"]
    assert vdist.rank_gpus("cuda:nccl,cpu:gloo", 2) == ["3", "5"]  # with offload=all
    assert vdist.rank_gpus("gloo", 3) == [None, None, None]
    with pytest.raises(ValueError, match="NCCL needs one GPU per rank: 3 ranks, 2 GPUs visible"):
        vdist.rank_gpus("nccl", 3)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(ValueError, match=r"NCCL needs one GPU per rank: 2 ranks, 1 GPU visible$"):
        vdist.rank_gpus("nccl", 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ValueError, match=r"NCCL needs one GPU per rank: 1 rank, 0 GPUs visible$"):
        vdist.rank_gpus("nccl", 1)
