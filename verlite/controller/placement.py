"""The placement report of a run: ``workers.json`` (one record per worker) and a summary line."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from verlite.controller.worker_group import WorkerGroup
from verlite.package_versions import package_versions, version_changes

# The placement report (workers.json): the file a run writes first in its output folder, as
# it is being written and once whole.
PLACEMENT_FILES = ("workers.json.tmp", "workers.json")


def _layout(groups: Sequence[WorkerGroup]) -> str:
    by_pool: dict[int, list[str]] = {}
    for group in groups:
        by_pool.setdefault(id(group.pool), []).append(group.name)
    if len(groups) < 2:
        return ""
    if len(by_pool) == 1:
        return " (colocated)"
    if len(by_pool) == len(groups):
        return " (split)"
    shared = ", ".join("+".join(names) for names in by_pool.values() if len(names) > 1)
    return f" (colocated: {shared})"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def write_placement_report(groups: Sequence[WorkerGroup], out_dir: str | Path) -> str:
    """Write ``out_dir/workers.json`` and return a one-line summary such as
    ``placed 8 workers in 4 bundles on 2 nodes: actor 2x2, critic 2x2 (colocated)``
    (``nnodes x workers_per_node`` per role; colocated roles share bundles)."""
    records = [record for group in groups for record in group.placement()]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # Written whole, then renamed: a reader (a restarted run rewrites it) never sees half.
    partial, whole = (out / name for name in PLACEMENT_FILES)
    partial.write_text(json.dumps(records, indent=2) + "\n")
    partial.replace(whole)
    pools = {id(group.pool): group.pool for group in groups}
    bundles = sum(pool.world_size for pool in pools.values())
    nodes = {record["node_id"] for record in records}
    roles = ", ".join(
        f"{group.name} {group.pool.nnodes}x{group.pool.workers_per_node}" for group in groups
    )
    return (
        f"placed {_count(len(records), 'worker')} in {_count(bundles, 'bundle')} "
        f"on {_count(len(nodes), 'node')}: "
        f"{roles}{_layout(groups)}"
    )


def other_versions(records: Sequence[Mapping[str, Any]], *, lora: bool) -> str | None:
    """One line naming the workers of placement ``records`` (``WorkerGroup.placement``) whose
    packages that shape the numbers (peft's with ``lora``: the policy has adapters) are at
    other versions than the driver's, by node IP, or None: ranks of other versions may compute
    other numbers, and a checkpoint records the driver's versions (``package_versions``)."""
    here = package_versions(peft=lora)  # without peft's: a worker's is then not compared
    by_node: dict[tuple[str, tuple[str, ...]], list[str]] = {}
    for record in records:
        if changes := version_changes(record["versions"], here):
            key = (record["node_ip"], tuple(changes))
            by_node.setdefault(key, []).append(f"{record['role']} {record['rank']}")
    if not by_node:
        return None
    found = "; ".join(
        f"{', '.join(workers)} on {node}: {', '.join(changes)}"
        for (node, changes), workers in by_node.items()
    )
    return (
        f"workers run other package versions than the driver (the worker's -> the driver's): "
        f"{found}; they may compute other numbers than the driver's packages would, and a "
        "checkpoint records the driver's"
    )
