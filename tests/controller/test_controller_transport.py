"""TensorDicts through Ray as raw byte arrays (``verlite.controller.transport``): exact round
trips of every dtype and layout, only a slice's rows sent, writable received tensors, and
worker groups whose batches and results travel that way."""

import pickle
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import ray
import torch
from tensordict import TensorDict

from verlite.controller import ResourcePool, Worker, WorkerGroup
from verlite.controller.transport import fits, from_wire, to_wire

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def mixed_batch() -> TensorDict:
    base = torch.arange(40, dtype=torch.int64).reshape(8, 5)
    td = TensorDict(
        {
            "ids": base[2:6],  # a row slice of a larger storage
            "t": torch.randn(5, 4).t(),  # not contiguous
            "bf16": torch.randn(4, 3, dtype=torch.bfloat16),
            "mask": torch.tensor([True, False, True, True]),
            "empty": torch.zeros(4, 0),
            "f64": torch.randn(4, 2, 2, dtype=torch.float64),
        },
        batch_size=[4],
    )
    td.set_non_tensor("temperature", 0.7)
    td["last"] = torch.ones(4)
    return td


def assert_same(a: TensorDict, b: TensorDict) -> None:
    assert list(a.keys()) == list(b.keys()) and a.batch_size == b.batch_size
    for key, value in b.items():
        if isinstance(value, torch.Tensor):
            assert a[key].dtype == value.dtype and torch.equal(a[key], value), key
        else:
            assert a.get_non_tensor(key) == b.get_non_tensor(key)


def test_round_trip_is_exact_and_sends_only_the_rows() -> None:
    td = mixed_batch()
    wire = to_wire(td)
    assert not isinstance(wire, bytes)
    sizes = {key: payload[0].nbytes for key, is_tensor, payload in wire[2] if is_tensor}
    assert sizes["ids"] == 4 * 5 * 8  # the slice's rows, not the 8-row storage
    assert_same(from_wire(pickle.loads(pickle.dumps(wire, protocol=5))), td)


def test_received_tensors_are_private_and_writable() -> None:
    td = mixed_batch()
    wire = to_wire(td)
    for _, is_tensor, payload in wire[2]:
        if is_tensor:
            payload[0].setflags(write=False)  # as Ray hands out-of-band buffers over
    received = from_wire(wire)
    received["ids"] += 1
    assert torch.equal(td["ids"], torch.arange(10, 30).reshape(4, 5))


def test_other_tensordicts_fall_back_to_plain_pickle() -> None:
    nested = TensorDict({"a": torch.ones(2), "inner": TensorDict({"b": torch.zeros(2)}, [2])}, [2])
    named = TensorDict({"a": torch.ones(2, 3)}, [2, 3], names=["rows", "cols"])
    for td in (nested, named):
        assert not fits(td)
        wire = to_wire(td)
        assert isinstance(wire, bytes)
        back = from_wire(wire)
        assert (back == td).all() and back.names == td.names


class MutatingWorker(Worker):
    """Writes into the batch it receives, and returns it."""

    def bump(self, td: TensorDict) -> TensorDict:
        td["x"] += self.rank + 1
        return td


@pytest.fixture(scope="module")
def group(shared_ray: Any) -> Iterator[WorkerGroup]:
    shared_ray.ensure()
    pool = ResourcePool(
        "wire", nnodes=1, workers_per_node=2, cpus_per_worker=1.0, gpus_per_worker=0.0, timeout_s=30
    )
    workers = WorkerGroup(
        "wire", MutatingWorker, pool, share=1.0, worker_kwargs={}, torch_threads=1, run_id="t"
    )
    yield workers
    workers.shutdown()
    pool.remove()


def test_broadcast_batch_is_each_workers_own_copy(group: WorkerGroup) -> None:
    td = TensorDict({"x": torch.zeros(3, 2), "uid": torch.arange(3)}, batch_size=[3])
    results: list[Any] = group.call("bump", td)  # one object in the store, read by both ranks
    assert [float(r["x"].max()) for r in results] == [1.0, 2.0]
    assert float(td["x"].abs().max()) == 0.0


def test_split_batch_and_results_round_trip(group: WorkerGroup) -> None:
    td = mixed_batch()
    td["x"] = torch.zeros(4)
    out = group.call("bump", td, dispatch="dp_split", collect="concat")
    assert_same(out.exclude("x"), td.exclude("x"))
    assert sorted(out["x"].tolist()) == [1.0, 1.0, 2.0, 2.0]
