"""Worker groups on one embedded Ray node: the loopback session, every dispatch and collect
through real actors, overlap of groups on separate pools, failures that surface fast and
leave nothing behind, resource errors, and the placement report."""

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from ray.exceptions import RayTaskError
from ray.util.placement_group import placement_group_table
from tensordict import TensorDict

from verlite.controller import (
    DpSplit,
    PlacementError,
    ResourcePool,
    Worker,
    WorkerGroup,
    WorkerGroupError,
    other_versions,
    write_placement_report,
)
from verlite.controller.failures import is_lost
from verlite.controller.session import WORKER_ENV
from verlite.core.metrics import Metric, MetricDict
from verlite.distributed import all_reduce_sum, get_rank, get_world_size
from verlite.package_versions import package_versions

# Ray workers cannot import this module (pytest puts tests/controller on the driver's
# sys.path only), so the test workers travel by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

HF_PROGRESS_BARS = "HF_HUB_DISABLE_PROGRESS_BARS"


class ProbeWorker(Worker):
    """A tiny worker exercising each kind of call."""

    def __init__(self, *, scale: float = 1.0, **base: Any) -> None:
        super().__init__(**base)
        self.scale = scale

    def echo(self, *args: Any, **kwargs: Any) -> tuple[int, tuple[Any, ...], dict[str, Any]]:
        return self.rank, args, kwargs

    def group_sum(self) -> tuple[int, int, float]:
        """The process group works: rank, world size, and an all-reduce over it."""
        return get_rank(), get_world_size(), float(all_reduce_sum(torch.ones(1))[0])

    def score(self, td: TensorDict) -> TensorDict:
        return TensorDict(
            {
                "uid": td["uid"],
                "y": td["x"] * self.scale,
                "rank": torch.full((td.shape[0],), self.rank),
                "temperature_seen": torch.full((td.shape[0],), td.get_non_tensor("temperature")),
            },
            batch_size=td.batch_size,
        )

    def metrics(self) -> MetricDict:
        return {"loss": Metric.loss(float(self.rank)), "rows": Metric.sum(1.0)}

    def sleep(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank

    def timed_sleep(self, seconds: float) -> tuple[float, float]:
        """When the sleep began and ended, on the machine's clock all workers share."""
        began = time.time()
        time.sleep(seconds)
        return began, time.time()

    def all_reduce_until_lost(self, leaving: int) -> None:
        """All-reduce in a loop; rank ``leaving``'s process ends abruptly half a second in."""
        start = time.monotonic()
        while True:
            if self.rank == leaving and time.monotonic() - start > 0.5:
                os._exit(1)
            all_reduce_sum(torch.ones(1))

    def environment(self) -> tuple[str | None, str]:
        """The progress-bar switch this process sees, and the runtime_env it runs in."""
        return os.environ.get(HF_PROGRESS_BARS), ray.get_runtime_context().get_runtime_env_string()

    def fail_on(self, rank: int, seconds: float, marks: str) -> None:
        """Rank ``rank`` raises; the others sleep, then leave a mark in ``marks``."""
        if self.rank == rank:
            raise ValueError(f"bad batch on rank {self.rank}")
        time.sleep(seconds)
        Path(marks, f"rank{self.rank}").touch()


@pytest.fixture(scope="module", autouse=True)
def ray_session(shared_ray: Any) -> None:
    shared_ray.ensure()


def make_group(name: str, *, nnodes: int = 1, workers_per_node: int = 2) -> WorkerGroup:
    pool = ResourcePool(
        name,
        nnodes=nnodes,
        workers_per_node=workers_per_node,
        cpus_per_worker=1.0,
        gpus_per_worker=0.0,
        timeout_s=30,
    )
    return WorkerGroup(
        name,
        ProbeWorker,
        pool,
        share=1.0,
        worker_kwargs={"scale": 3.0},
        torch_threads=1,
        run_id="test",
    )


@pytest.fixture(scope="module")
def pair() -> Iterator[WorkerGroup]:
    group = make_group("pair")
    yield group
    group.shutdown()
    group.pool.remove()


def assert_gone(pids: list[int], names: list[str], within_s: float = 60.0) -> None:
    # Killed at shutdown, the processes end by themselves a moment later: the wait is a hang
    # guard only, loose for a loaded machine.
    deadline = time.monotonic() + within_s
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if _running(pid)]
        time.sleep(0.1)
    assert not alive, f"worker processes {alive} outlived shutdown"
    named = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
    assert not named & set(names)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_embedded_ray_is_loopback_only() -> None:
    nodes = ray.nodes()
    assert [n["NodeManagerAddress"] for n in nodes] == ["127.0.0.1"]
    assert ray.get_runtime_context().gcs_address.startswith("127.0.0.1:")


def test_embedded_ray_refuses_a_client_without_its_token() -> None:
    # Ray starts the cluster of a ray.init without an address with token authentication
    # (RAY_AUTH_MODE unset: on, the token in ~/.ray/auth_token, made there when missing), and
    # verlite keeps it so: another process of this machine reaches the loopback ports, not
    # the cluster.
    gcs = ray.get_runtime_context().gcs_address
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    code = f"from verlite.controller.session import start_ray; start_ray({gcs!r})"
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, "RAY_AUTH_MODE": "disabled"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0
    assert "refused this driver's authentication token" in done.stderr


def test_workers_of_the_embedded_ray_inherit_their_environment(pair: WorkerGroup) -> None:
    """In the embedded Ray that start_ray started, every worker sees WORKER_ENV from its node
    and runs in no runtime_env of its own: Ray may then hand it an idle worker process it
    started ahead, instead of starting one for it."""
    assert WORKER_ENV == {HF_PROGRESS_BARS: "1"}
    assert pair.call("environment") == [("1", "{}")] * 2


def test_group_forms_a_process_group(pair: WorkerGroup) -> None:
    assert pair.call("group_sum") == [(0, 2, 2.0), (1, 2, 2.0)]
    assert pair.call("ping", collect="rank0") is True
    records = pair.placement()
    assert [r["rank"] for r in records] == [0, 1]
    assert {r["node_ip"] for r in records} == {"127.0.0.1"}
    assert all(r["role"] == "pair" and r["resources"] == {"CPU": 1.0} for r in records)


def test_broadcast_and_all(pair: WorkerGroup) -> None:
    assert pair.call("echo", 1, "a", k=2) == [(0, (1, "a"), {"k": 2}), (1, (1, "a"), {"k": 2})]
    got = pair.call("echo", [10, 11], dispatch="all", k=["x", "y"])
    assert got == [(0, (10,), {"k": "x"}), (1, (11,), {"k": "y"})]


def test_dp_split_concat_restores_order(pair: WorkerGroup) -> None:
    n, width = 12, 10
    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(1, width + 1, (n,), generator=gen)
    batch = TensorDict(
        {
            "uid": torch.arange(n),
            "attention_mask": (torch.arange(width) < lengths[:, None]).long(),
            "x": torch.randn(n, generator=gen),
        },
        batch_size=[n],
    )
    batch.set_non_tensor("temperature", 0.25)
    out = pair.call("score", batch, dispatch="dp_split", collect="concat")
    assert out["uid"].tolist() == list(range(n))
    torch.testing.assert_close(out["y"], batch["x"] * 3.0)
    assert set(out["rank"].tolist()) == {0, 1}
    assert (out["temperature_seen"] == 0.25).all()


def test_shares_cut_into_mini_batches_reach_each_rank_as_k_rows(pair: WorkerGroup) -> None:
    batch = TensorDict({"uid": torch.arange(8), "x": torch.arange(8.0)}, batch_size=[8])
    shares = pair.call("echo", batch, dispatch=DpSplit(mini_batches=2), collect="list")
    pieces = [args[0] for _, args, _ in shares]
    assert [tuple(p.batch_size) for p in pieces] == [(2, 2), (2, 2)]
    for j in range(2):  # row j of every share: its piece of global mini-batch j
        assert sorted(int(u) for p in pieces for u in p[j]["uid"]) == list(range(4 * j, 4 * j + 4))
    with pytest.raises(ValueError, match="'concat' cannot follow DpSplit"):
        pair.call("score", batch, dispatch=DpSplit(mini_batches=2), collect="concat")


def test_metrics_are_reduced_over_ranks(pair: WorkerGroup) -> None:
    assert pair.call("metrics", collect="metrics") == {"loss": 0.5, "rows": 2.0}


def test_groups_on_separate_pools_overlap() -> None:
    first, second = make_group("left", workers_per_node=1), make_group("right", workers_per_node=1)
    try:
        first.call("ping")
        second.call("ping")
        pending = [g.call_async("timed_sleep", 1.0) for g in (first, second)]
        (left,), (right,) = (p.result() for p in pending)
        # The calls ran at the same time: each began before the other ended (evidence that
        # does not depend on how loaded the machine is, unlike a bound on the wall time).
        assert left[0] < right[1] and right[0] < left[1], (left, right)
    finally:
        for group in (first, second):
            group.shutdown()
            group.pool.remove()


def test_failures_name_the_rank_and_leave_no_orphans(tmp_path: Path) -> None:
    group = make_group("fragile")
    pids = [r["pid"] for r in group.placement()]
    names = [f"verlite:test:fragile:{rank}" for rank in range(2)]
    try:
        # Rank 0 is still busy for a minute when rank 1 raises: the error must not wait for
        # it. Its mark, left when its minute is up, would say the error did.
        with pytest.raises(WorkerGroupError, match="rank 1") as raised:
            group.call("fail_on", 1, 60.0, str(tmp_path))
        assert list(tmp_path.iterdir()) == []
        assert "ValueError: bad batch on rank 1" in str(raised.value)
        assert raised.value.node_ip == "127.0.0.1" and raised.value.method == "fail_on"
        assert not raised.value.lost  # a raise would repeat: no restart mends it

        pending = group.call_async("sleep", 60.0)
        time.sleep(0.5)
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(WorkerGroupError, match=r"rank 1 .* worker process died") as raised:
            pending.result()
        assert list(tmp_path.iterdir()) == []  # nor did this one wait for rank 0
        assert raised.value.lost
    finally:
        group.shutdown()
        group.pool.remove()
    group.shutdown()  # idempotent
    assert_gone(pids, names)


def test_a_peer_lost_in_a_collective_is_a_loss_however_it_is_first_seen() -> None:
    group = make_group("collective")
    try:
        pending = group.call_async("all_reduce_until_lost", 1)
        # The live rank sees its peer go as a transport error of the collective...
        with pytest.raises(RayTaskError) as seen_by_rank_0:
            ray.get(pending.ref(0), timeout=60)
        assert "gloo/transport" in str(seen_by_rank_0.value.cause)
        assert is_lost(seen_by_rank_0.value)
        # ...and the group names the rank whose process ended, as lost.
        with pytest.raises(WorkerGroupError) as raised:
            pending.result()
        assert raised.value.lost and raised.value.rank == 1, raised.value
        assert raised.value.cause == "worker process died"
    finally:
        group.shutdown(graceful=False)
        group.pool.remove()


def test_too_many_workers_fail_with_the_resources() -> None:
    pool = ResourcePool(
        "huge", nnodes=2, workers_per_node=1, cpus_per_worker=1, gpus_per_worker=1, timeout_s=2
    )
    with pytest.raises(PlacementError) as raised:
        pool.ready()
    message = str(raised.value)
    # The pool's timeout fired (pytest's timeout is the only hang guard): the message says so.
    assert message.startswith(
        "cannot place pool 'huge' within 2s: not enough alive nodes can hold a node group."
    )
    assert "2 node(s) x 1 bundle(s) of {CPU 1, GPU 1}" in message
    assert "1 alive node(s)" in message and "CPU 4 total" in message and "GPU 0 total" in message


def test_pending_placement_times_out_and_releases_its_groups(pair: WorkerGroup) -> None:
    # The node has 4 CPUs, 2 of them held by `pair`: 3 fit the node but not what is free.
    pool = ResourcePool(
        "blocked", nnodes=1, workers_per_node=3, cpus_per_worker=1, gpus_per_worker=0, timeout_s=2
    )
    with pytest.raises(PlacementError, match="not placed in time") as raised:
        pool.ready()
    assert "CPU 4 total / 2 available" in str(raised.value)
    states = [
        pg["state"]
        for pg in placement_group_table().values()
        if pg["name"].startswith("verlite:blocked:")
    ]
    assert states == ["REMOVED"]


def test_placement_report(pair: WorkerGroup, tmp_path: Path) -> None:
    summary = write_placement_report([pair], tmp_path)
    assert summary == "placed 2 workers in 2 bundles on 1 node: pair 1x2"
    records = json.loads((tmp_path / "workers.json").read_text())
    assert records == pair.placement()
    assert {"role", "rank", "node_id", "node_ip", "pid", "resources"} <= set(records[0])
    # each worker's own packages, here the driver's: no line says otherwise. Mutation: the
    # workers' versions not reported -> this fails
    assert [r["versions"] for r in records] == [package_versions(peft=True)] * 2
    assert other_versions(records, lora=True) is None


def test_workers_of_other_package_versions_than_the_drivers_are_named_by_node_ip() -> None:
    """Mutation: no version compared -> None, this fails."""
    here = package_versions(peft=True)
    older = {**here, "torch": "2.0.0"}

    def worker(role: str, rank: int, node: str, versions: dict[str, str]) -> dict[str, Any]:
        return {"role": role, "rank": rank, "node_ip": node, "versions": versions}

    records = [
        worker("actor", 0, "10.0.0.1", here),
        worker("actor", 1, "10.0.0.2", older),
        worker("critic", 1, "10.0.0.2", older),
        worker("critic", 2, "10.0.0.3", {**older, "transformers": "4.0.0"}),
    ]
    # peft shapes no numbers without adapters. Mutation: peft compared whatever lora -> fails
    no_adapters = [{**records[0], "versions": {**here, "peft": "0.1.0"}}]
    assert other_versions(no_adapters, lora=False) is None
    assert other_versions(no_adapters, lora=True) is not None
    assert other_versions(records, lora=False) == (
        "workers run other package versions than the driver (the worker's -> the driver's): "
        f"actor 1, critic 1 on 10.0.0.2: torch 2.0.0 -> {here['torch']}; critic 2 on 10.0.0.3: "
        f"torch 2.0.0 -> {here['torch']}, transformers 4.0.0 -> {here['transformers']}; they may "
        "compute other numbers than the driver's packages would, and a checkpoint records the "
        "driver's"
    )
