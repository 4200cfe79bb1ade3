"""Worker groups on a simulated three-node cluster (``ray.cluster_utils.Cluster``, 2 CPUs per
node, all on loopback): node groups pinned to distinct nodes in node-id order, colocated
and split roles, and a DP=4 actor update over two nodes equal to the single-process one."""

import os
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
from ray.cluster_utils import Cluster
from tensordict import TensorDict

from verlite.audit.invariance import Case, Outcome, compare, make_batch, run_case
from verlite.config import Config, load_config
from verlite.controller import (
    ResourcePool,
    Worker,
    WorkerGroup,
    build_pools,
    start_ray,
    stop_ray,
    write_placement_report,
)
from verlite.controller.session import WORKER_ENV

# The simulated cluster takes this process's Ray connection: after the shared Ray's tests.
pytestmark = pytest.mark.releases_shared_ray
ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "ppo_tiny.yaml"
NODES = 3
CPUS_PER_NODE = 2
CASE = Case("actor", "token-mean", "2")

# Ray workers cannot import this module (pytest puts tests/controller on the driver's
# sys.path only), so the test workers travel by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class UpdateWorker(Worker):
    """Runs one actor update of its share of the batch inside the group's process group."""

    def update(self, cfg: Config, batch: TensorDict) -> Outcome | None:
        return run_case(cfg, CASE, batch, strategy="ddp")


class EnvironmentWorker(Worker):
    def environment(self) -> tuple[str | None, dict[str, Any]]:
        """The progress-bar switch this process sees, and the runtime_env it runs in."""
        context = ray.get_runtime_context()
        return os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS"), context.runtime_env


@pytest.fixture(scope="module", autouse=True)
def cluster(shared_ray: Any) -> Iterator[Cluster]:
    shared_ray.release()  # the simulated cluster needs this process's Ray connection
    node_args: dict[str, Any] = {"num_cpus": CPUS_PER_NODE, "node_ip_address": "127.0.0.1"}
    cluster = Cluster(
        initialize_head=True, head_node_args={**node_args, "include_dashboard": False}
    )
    try:
        for _ in range(NODES - 1):
            cluster.add_node(**node_args)
        cluster.wait_for_nodes()
        start_ray(cluster.address)
        yield cluster
    finally:
        stop_ray()
        cluster.shutdown()


def sorted_node_ids() -> list[str]:
    return sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])


def placed_groups(overrides: list[str]) -> tuple[list[WorkerGroup], list[ResourcePool]]:
    cfg = load_config(
        CONFIG,
        [
            "trainer.nnodes=2",
            "actor.micro_batch_size_per_worker=4",
            "critic.micro_batch_size_per_worker=4",
            *overrides,
        ],
    )
    pools = build_pools(cfg, ["actor", "critic"])
    groups = [
        WorkerGroup(
            role, Worker, pool, share=share, worker_kwargs={}, torch_threads=1, run_id="multi"
        )
        for role, (pool, share) in pools.items()
    ]
    return groups, list({id(pool): pool for pool, _ in pools.values()}.values())


def release(groups: list[WorkerGroup], pools: list[ResourcePool]) -> None:
    for group in groups:
        group.shutdown()
    for pool in pools:
        pool.remove()


def test_colocated_roles_share_bundles_on_distinct_nodes(tmp_path: Path) -> None:
    groups, pools = placed_groups(["trainer.placement=colocate"])
    try:
        assert len(pools) == 1
        actor, critic = (group.placement() for group in groups)
        nodes = [r["node_id"] for r in actor]
        # One worker per node, on the first two nodes in id order (every node was free).
        assert nodes == sorted_node_ids()[:2]
        assert [r["node_id"] for r in critic] == nodes
        assert all(r["resources"] == {"CPU": 0.5} for r in actor + critic)
        summary = write_placement_report(groups, tmp_path)
        assert (
            summary == "placed 4 workers in 2 bundles on 2 nodes: actor 2x1, critic 2x1 (colocated)"
        )
    finally:
        release(groups, pools)


def test_split_roles_get_their_own_pools(tmp_path: Path) -> None:
    groups, pools = placed_groups(["trainer.placement=split"])
    try:
        assert len(pools) == 2
        for group in groups:
            records = group.placement()
            assert len({r["node_id"] for r in records}) == 2
            assert all(r["resources"] == {"CPU": 1.0} for r in records)
        summary = write_placement_report(groups, tmp_path)
        assert summary == "placed 4 workers in 4 bundles on 2 nodes: actor 2x1, critic 2x1 (split)"
    finally:
        release(groups, pools)


def test_dp4_update_over_two_nodes_matches_the_single_process_reference() -> None:
    cfg = load_config(CONFIG, ["model.precision=fp64"])
    batch = make_batch(cfg, seed=cfg.trainer.seed)
    pool = ResourcePool(
        "dp4", nnodes=2, workers_per_node=2, cpus_per_worker=1, gpus_per_worker=0, timeout_s=60
    )
    group = WorkerGroup(
        "actor", UpdateWorker, pool, share=1.0, worker_kwargs={}, torch_threads=1, run_id="dp4"
    )
    try:
        records = group.placement()
        per_node = Counter(r["node_id"] for r in records)
        assert list(per_node.values()) == [2, 2]
        # Ranks follow the nodes in id order, then the bundle index.
        assert [r["node_id"] for r in records] == sorted(r["node_id"] for r in records)
        outcome = group.call("update", cfg, batch, collect="rank0")
    finally:
        group.shutdown()
        pool.remove()
    reference = run_case(cfg, CASE, batch, strategy="none")
    assert reference is not None
    diffs = compare(outcome, reference)
    assert max(diffs.values()) < 1e-9, diffs


def test_a_split_run_over_two_nodes_syncs_weights_to_a_rollout_worker_on_each(
    tmp_path: Path,
) -> None:
    """GRPO with 2 actor workers and 1 rollout worker per node: the weights published on the
    first node reach the rollout worker of the second through the object store, checked."""
    import json

    from verlite.driver.preflight import RunInputs
    from verlite.driver.run import run

    cfg = load_config(
        ROOT / "configs" / "grpo_tiny.yaml",
        [
            "trainer.nnodes=2",
            "trainer.cpus_per_worker=0.5",
            "actor.workers_per_node=2",
            "actor.micro_batch_size_per_worker=16",
            "rollout.placement=split",
            "rollout.workers_per_node=1",
            "rollout.max_staleness=1",
            "data.train_batch_size=8",
            "actor.ppo_mini_batch_size=64",
            "trainer.total_steps=3",
            "trainer.val_freq=0",
            "trainer.loggers=[jsonl]",
            f"trainer.output_dir={tmp_path}",
        ],
    )
    run(cfg, RunInputs.load(cfg))
    placement = json.loads((tmp_path / "workers.json").read_text())
    nodes = sorted_node_ids()[:2]
    by_role = {
        role: Counter(w["node_id"] for w in placement if w["role"] == role)
        for role in ("actor", "rollout")
    }
    assert by_role == {"actor": Counter(dict.fromkeys(nodes, 2)), "rollout": Counter(nodes)}
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout/staleness/max"] for r in records] == [0, 1, 1]
    # step 1 reports the first sync, step 3 the one after step 1 (step 2's batch was
    # generated ahead by the first weights, with no sync of its own)
    synced = [r["step"] for r in records if r.get("perf/weight_sync_bytes", 0) > 0]
    assert synced == [1, 3]


def test_workers_of_a_cluster_get_their_environment_through_the_runtime_env() -> None:
    """A session joined by address: its nodes' environment is not the driver's, so the
    workers get WORKER_ENV through their runtime_env."""
    pool = ResourcePool(
        "env", nnodes=1, workers_per_node=1, cpus_per_worker=1.0, gpus_per_worker=0.0, timeout_s=30
    )
    group = WorkerGroup(
        "env", EnvironmentWorker, pool, share=1.0, worker_kwargs={}, torch_threads=1, run_id="env"
    )
    try:
        [(seen, runtime_env)] = group.call("environment")
    finally:
        release([group], [pool])
    assert seen == "1"
    assert runtime_env["env_vars"] == WORKER_ENV
