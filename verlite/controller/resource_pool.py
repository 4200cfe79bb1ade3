"""Resource pools: one placement group per pool, its bundles pinned node by node to distinct
nodes, and the mapping of roles onto pools (colocated or split).

A pool of ``nnodes x workers_per_node`` bundles reserves the same slice of every node it
spans, all at once: Ray places a placement group whole or not at all, so two runs waiting for
the same nodes never each hold half of one pool. (A run with several pools, split placement,
reserves them one after another.) Ranks are numbered by node
(node ids sorted) and then by bundle, so a pool built again on the same cluster gives every
rank the same node.

Colocation: several worker groups may share one pool; each then takes ``share = 1/k`` of
every bundle's CPU and GPU, so k workers (actor and critic) sit in each bundle.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import ray
import torch

# A DeveloperAPI: the public per-node view (ray.util.state) needs the dashboard, which the
# embedded Ray does not start.
from ray._private.state import available_resources_per_node
from ray._private.utils import get_num_cpus
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from verlite.config import Config
from verlite.errors import RunFailure, UserError

# Ray's label for the node a bundle may go to; every node carries it by default.
NODE_ID_LABEL = "ray.io/node-id"
# Ray rounds resource amounts to 1e-4; compare with that slack.
_EPS = 1e-4
_POLL_S = 0.5


class PlacementError(RunFailure):
    """The pool's bundles could not be reserved within the timeout."""


@dataclass(frozen=True)
class Slot:
    """Where one rank of a pool runs: a bundle of a placement group on a known node."""

    placement_group: PlacementGroup
    bundle_index: int
    node_id: str
    node_ip: str


@dataclass(frozen=True)
class _Node:
    node_id: str
    node_ip: str
    total: dict[str, float]
    available: dict[str, float]


def _alive_nodes() -> list[_Node]:
    available = available_resources_per_node()
    return sorted(
        (
            _Node(
                node_id=n["NodeID"],
                node_ip=n["NodeManagerAddress"],
                total=dict(n["Resources"]),
                available=dict(available.get(n["NodeID"], {})),
            )
            for n in ray.nodes()
            if n["Alive"]
        ),
        key=lambda n: n.node_id,
    )


class ResourcePool:
    """``nnodes`` placement groups of ``workers_per_node`` bundles, each on its own node.

    Nothing is reserved until :meth:`ready`, which picks the nodes and waits for the groups.
    """

    def __init__(
        self,
        name: str,
        *,
        nnodes: int,
        workers_per_node: int,
        cpus_per_worker: float,
        gpus_per_worker: float,
        timeout_s: float,
    ) -> None:
        if nnodes < 1 or workers_per_node < 1:
            raise ValueError(
                f"pool {name!r} needs nnodes >= 1 and workers_per_node >= 1, "
                f"got {nnodes} and {workers_per_node}"
            )
        self.name = name
        self.nnodes = nnodes
        self.workers_per_node = workers_per_node
        self.cpus_per_worker = cpus_per_worker
        self.gpus_per_worker = gpus_per_worker
        self.timeout_s = timeout_s
        self._group: PlacementGroup | None = None
        self._slots: list[Slot] = []

    @property
    def world_size(self) -> int:
        return self.nnodes * self.workers_per_node

    @property
    def bundle(self) -> dict[str, float]:
        """The resources of one bundle (GPU left out when none is asked for)."""
        bundle = {"CPU": self.cpus_per_worker}
        if self.gpus_per_worker > 0:
            bundle["GPU"] = self.gpus_per_worker
        return bundle

    @property
    def slots(self) -> list[Slot]:
        """One slot per rank, in rank order; empty before :meth:`ready`."""
        return list(self._slots)

    def ready(self) -> list[Slot]:
        """Reserve the bundles (once) and return the slots; raises :class:`PlacementError`
        when that does not happen within ``timeout_s``, leaving nothing reserved.

        Nodes may still be joining (a cluster starting up, an autoscaler, a replacement for
        a lost node), and a node chosen may leave before its bundles are reserved (Ray notices
        a lost node seconds after it is gone): the nodes are chosen again then.
        """
        if self._slots:
            return self.slots
        deadline = time.monotonic() + self.timeout_s
        while True:
            targets = self._wait_for_nodes(deadline)
            # Named for `ray list placement-groups`; names are unique within the namespace.
            self._group = placement_group(
                [self.bundle] * self.world_size,
                strategy="PACK",
                name=f"verlite:{self.name}:{uuid.uuid4().hex[:8]}",
                bundle_label_selector=[
                    {NODE_ID_LABEL: node.node_id}
                    for node in targets
                    for _ in range(self.workers_per_node)
                ],
            )
            if self._wait_for_group(targets, deadline):
                break
            self.remove()
            if time.monotonic() >= deadline:
                raise PlacementError(
                    self._describe(_alive_nodes(), "the placement group was not placed in time")
                )
        group = self._group
        self._slots = [
            Slot(group, index, node.node_id, node.node_ip)
            for index, node in enumerate(
                node for node in targets for _ in range(self.workers_per_node)
            )
        ]
        return self.slots

    def _wait_for_nodes(self, deadline: float) -> list[_Node]:
        """The nodes to place on, once enough alive nodes can hold a node group."""
        while True:
            nodes = _alive_nodes()
            targets = self._pick_nodes(nodes)
            if targets is not None:
                return targets
            if time.monotonic() >= deadline:
                raise PlacementError(
                    self._describe(nodes, "not enough alive nodes can hold a node group")
                )
            time.sleep(_POLL_S)

    def _wait_for_group(self, targets: Sequence[_Node], deadline: float) -> bool:
        """Whether the placement group was placed before ``deadline``; False as soon as a
        target node has left the cluster (the group could never be placed)."""
        assert self._group is not None
        pending = [self._group.ready()]
        wanted = {node.node_id for node in targets}
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            _, pending = ray.wait(pending, timeout=min(_POLL_S, remaining))
            if pending and not wanted <= {node.node_id for node in _alive_nodes()}:
                return False
        return True

    def remove(self) -> None:
        """Release the placement group (idempotent); shut the worker groups down first."""
        if self._group is not None:
            remove_placement_group(self._group)
        self._group = None
        self._slots = []

    def _fits(self, resources: dict[str, float]) -> bool:
        return all(
            resources.get(key, 0.0) + _EPS >= amount * self.workers_per_node
            for key, amount in self.bundle.items()
        )

    def _pick_nodes(self, nodes: Sequence[_Node]) -> list[_Node] | None:
        # Nodes with room now come first, then nodes that could hold a node group once
        # freed; within each, node id order keeps the choice deterministic.
        able = [n for n in nodes if self._fits(n.total)]
        if len(able) < self.nnodes:
            return None
        able.sort(key=lambda n: (not self._fits(n.available), n.node_id))
        return sorted(able[: self.nnodes], key=lambda n: n.node_id)

    def _describe(self, nodes: Sequence[_Node], reason: str) -> str:
        asked = ", ".join(f"{key} {amount:g}" for key, amount in self.bundle.items())
        lines = [
            f"cannot place pool {self.name!r} within {self.timeout_s:g}s: {reason}.",
            f"asked for {self.nnodes} node(s) x {self.workers_per_node} bundle(s) of "
            f"{{{asked}}}, each node group on a distinct node",
            f"the cluster has {len(nodes)} alive node(s):",
        ]
        for n in nodes:
            have = ", ".join(
                f"{key} {n.total.get(key, 0.0):g} total / {n.available.get(key, 0.0):g} available"
                for key in ("CPU", "GPU")
            )
            lines.append(f"  node {n.node_id[:12]} ({n.node_ip}): {have}")
        return "\n".join(lines)


def build_pools(cfg: Config, roles: Sequence[str]) -> dict[str, tuple[ResourcePool, float]]:
    """A pool and a share of each bundle for every role in ``roles`` (actor, critic, reward).

    ``trainer.placement=split`` gives each role its own pool (share 1). ``colocate`` puts
    roles in one pool and gives each ``1/k`` of every bundle, except that roles with
    different ``workers_per_node`` cannot share bundles: roles are grouped by their
    ``workers_per_node`` and each group gets its own pool.
    """
    trainer = cfg.trainer
    per_node = {role: _workers_per_node(cfg, role) for role in roles}
    if trainer.placement == "split":
        groups = [[role] for role in roles]
    else:
        by_size: dict[int, list[str]] = {}
        for role in roles:
            by_size.setdefault(per_node[role], []).append(role)
        groups = list(by_size.values())
    pools: dict[str, tuple[ResourcePool, float]] = {}
    for members in groups:
        pool = ResourcePool(
            "+".join(members),
            nnodes=trainer.nnodes,
            workers_per_node=per_node[members[0]],
            cpus_per_worker=trainer.cpus_per_worker,
            gpus_per_worker=trainer.gpus_per_worker,
            timeout_s=trainer.resource_timeout_s,
        )
        for role in members:
            pools[role] = (pool, 1.0 / len(members))
    return pools


def build_rollout_pool(cfg: Config) -> ResourcePool:
    """The rollout group's own pool (``rollout.placement=split``): ``rollout.workers_per_node``
    bundles of the rollout's CPUs and GPUs on each of the run's nodes."""
    rollout = cfg.rollout
    # Config validation fills them from the trainer's settings.
    assert rollout.workers_per_node is not None and rollout.cpus_per_worker is not None
    return ResourcePool(
        "rollout",
        nnodes=cfg.trainer.nnodes,
        workers_per_node=rollout.workers_per_node,
        cpus_per_worker=rollout.cpus_per_worker,
        gpus_per_worker=rollout.gpus_per_worker or 0.0,
        timeout_s=cfg.trainer.resource_timeout_s,
    )


def run_pools(cfg: Config) -> dict[str, tuple[ResourcePool, float]]:
    """The pool and bundle share of every group of a run: its trainer roles' and, with
    ``reward.model.path``, the reward model's (:func:`build_pools`), and with
    ``rollout.placement=split`` the rollout's own."""
    reward = ["reward"] if cfg.reward.model.path is not None else []
    pools = build_pools(cfg, [*cfg.roles, *reward])
    if cfg.rollout.placement == "split":
        pools["rollout"] = (build_rollout_pool(cfg), 1.0)
    return pools


class ClusterTooSmall(UserError):
    """The run's workers cannot fit the machine an embedded Ray would run on."""


def check_fits_machine(cfg: Config, *, cpus: int | None = None) -> None:
    """Before an embedded Ray starts on this machine: one node, and room for every pool's
    bundles at once (the CPUs Ray will have: ``cpus``, or the machine's when None; the GPUs
    torch sees); names what was asked and what there is."""
    if cfg.trainer.nnodes > 1:
        raise ClusterTooSmall(
            f"trainer.nnodes={cfg.trainer.nnodes}, but without trainer.ray_address the run "
            "starts an embedded Ray of one node; give the address of a cluster with "
            f"{cfg.trainer.nnodes} nodes"
        )
    gpus = torch.cuda.device_count()
    check_device(cfg, gpus=gpus, where="this machine")
    where = "this machine" if cpus is None else "the embedded Ray"
    _check_room(cfg, {"CPU": get_num_cpus() if cpus is None else cpus, "GPU": gpus}, where)


def check_fits_session(cfg: Config) -> None:
    """In the Ray session this process opened before (a notebook's ``ray.init``): enough
    alive nodes, and room for every pool's bundles in the session's resources."""
    nodes = sum(1 for node in ray.nodes() if node["Alive"])
    if cfg.trainer.nnodes > nodes:
        raise ClusterTooSmall(
            f"trainer.nnodes={cfg.trainer.nnodes}, but the Ray session this process has open "
            f"has {nodes} alive node{'s' * (nodes != 1)}"
        )
    total = ray.cluster_resources()
    check_device(cfg, gpus=total.get("GPU", 0.0), where="the open Ray session")
    _check_room(cfg, {key: total.get(key, 0.0) for key in ("CPU", "GPU")}, "the open Ray session")


def check_device(cfg: Config, *, gpus: float | None = None, where: str = "") -> None:
    """``model.device=cuda`` (every role's model: actor, critic, rollout, reward model) needs
    a GPU in every worker: refused before Ray, naming the field, when ``where`` has no GPU
    (``gpus``; None: not known here, a cluster's) or a pool gives its workers none (Ray would
    hide every GPU from them, and the first ``.to("cuda")`` would fail inside a worker)."""
    if cfg.model.device != "cuda":
        return
    if gpus is not None and gpus < 1:
        raise ClusterTooSmall(
            f"model.device=cuda, but {where} has no GPU; set model.device=cpu (or auto, which "
            "uses a GPU where a worker has one), or give trainer.ray_address of a cluster with GPUs"
        )
    pools = {id(pool): pool for pool, _ in run_pools(cfg).values()}.values()
    without = [pool.name for pool in pools if not pool.bundle.get("GPU")]
    if without:
        raise ClusterTooSmall(
            f"model.device=cuda, but the {', '.join(without)} workers are given no GPU "
            f"(trainer.gpus_per_worker={cfg.trainer.gpus_per_worker:g}"
            + (
                f", rollout.gpus_per_worker={cfg.rollout.gpus_per_worker:g}"
                if cfg.rollout.placement == "split" and cfg.rollout.gpus_per_worker is not None
                else ""
            )
            + "); give each worker a GPU, or set model.device=auto or cpu"
        )


def resources_asked(cfg: Config, key: str) -> float:
    """How much of ``key`` (CPU, GPU) the run's workers ask for at once: every bundle of
    every pool (a pool that roles share, once)."""
    return sum(amount for _, amount in _asked(cfg, key))


def _asked(cfg: Config, key: str) -> list[tuple[ResourcePool, float]]:
    pools = {id(pool): pool for pool, _ in run_pools(cfg).values()}.values()
    return [(pool, pool.bundle.get(key, 0.0) * pool.world_size) for pool in pools]


def _check_room(cfg: Config, have: dict[str, float], where: str) -> None:
    for key, available in have.items():
        asked = _asked(cfg, key)
        total = sum(amount for _, amount in asked)
        if total > available + _EPS:
            parts = " + ".join(
                f"{pool.name} {pool.world_size}x{pool.bundle.get(key, 0.0):g}"
                for pool, amount in asked
                if amount
            )
            raise ClusterTooSmall(
                f"the workers ask for {total:g} {key}{'s' * (total != 1)} ({parts}: "
                f"{_per_worker_settings(cfg, key)}), {where} has {available:g}; "
                "lower the workers per node or the CPUs/GPUs per worker "
                "(trainer., actor., critic., reward.model., rollout.workers_per_node and "
                "*_per_worker)"
            )


def _per_worker_settings(cfg: Config, key: str) -> str:
    """The settings that size a worker's bundle in ``key`` (CPU, GPU), with their values:
    the trainer's, and a split rollout's own when set (None takes the trainer's)."""
    name = f"{key.lower()}s_per_worker"
    settings = [f"trainer.{name}={getattr(cfg.trainer, name):g}"]
    rollout = getattr(cfg.rollout, name)
    if cfg.rollout.placement == "split" and rollout is not None:
        settings.append(f"rollout.{name}={rollout:g}")
    return ", ".join(settings)


def _workers_per_node(cfg: Config, role: str) -> int:
    if role not in ("actor", "critic", "reward"):
        raise ValueError(f"unknown role {role!r}; roles are actor, critic and reward")
    section = cfg.reward.model if role == "reward" else getattr(cfg, role)
    value: int | None = section.workers_per_node
    # Config validation fills every role's workers_per_node (the trainer's by default).
    assert value is not None
    return value
