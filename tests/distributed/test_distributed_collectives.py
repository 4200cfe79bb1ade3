"""Collectives: no-ops without a process group, correct values over two spawned ranks."""

from __future__ import annotations

from typing import Any

import torch

from verlite import distributed as vdist


def test_collectives_are_noops_without_a_group() -> None:
    t = torch.tensor([1.0, -2.0])
    assert vdist.all_reduce_sum(t) is t
    assert vdist.all_reduce_max(t) is t
    assert vdist.all_reduce_mean(t) is t
    assert t.tolist() == [1.0, -2.0]
    obj = {"a": 1}
    assert vdist.all_gather_object(obj) == [obj]
    assert vdist.broadcast_object(obj) is obj


def _collectives_rank(rank: int, world: int) -> dict[str, Any]:
    base = float(rank + 1)
    return {
        "rank": (vdist.get_rank(), vdist.get_world_size()),
        "sum": vdist.all_reduce_sum(torch.tensor([base, -base])).tolist(),
        "sum_int": vdist.all_reduce_sum(torch.tensor([rank + 1])).tolist(),
        "max": vdist.all_reduce_max(torch.tensor([base, -base])).tolist(),
        "mean": vdist.all_reduce_mean(torch.tensor([base, 10 * base])).tolist(),
        "gather": vdist.all_gather_object({"from": rank}),
        "bcast": vdist.broadcast_object(f"sent by {rank}", src=world - 1),
    }


def test_collectives_over_two_ranks() -> None:
    out = vdist.run_on_ranks(_collectives_rank, world_size=2, timeout_s=120)
    for rank, res in enumerate(out):
        assert res["rank"] == (rank, 2)
        assert res["sum"] == [3.0, -3.0]
        assert res["sum_int"] == [3]
        assert res["max"] == [2.0, -1.0]
        assert res["mean"] == [1.5, 15.0]
        assert res["gather"] == [{"from": 0}, {"from": 1}]
        assert res["bcast"] == "sent by 1"
