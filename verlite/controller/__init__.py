"""The Ray side of the driver: the Ray session, resource pools (placement groups per node),
worker groups, explicit dispatch/collect, failures, and the placement report."""

from verlite.controller.dispatch import Collect, Dispatch, DpSplit
from verlite.controller.failures import WorkerGroupError
from verlite.controller.placement import PLACEMENT_FILES, other_versions, write_placement_report
from verlite.controller.resource_pool import (
    ClusterTooSmall,
    PlacementError,
    ResourcePool,
    build_pools,
    check_device,
    check_fits_machine,
    check_fits_session,
    resources_asked,
    run_pools,
)
from verlite.controller.session import (
    lost_embedded_node,
    ray_session,
    say_after_node_loss,
    start_ray,
    stop_ray,
)
from verlite.controller.worker import Worker
from verlite.controller.worker_group import PendingCall, WorkerGroup, completed

__all__ = [
    "PLACEMENT_FILES",
    "ClusterTooSmall",
    "Collect",
    "Dispatch",
    "DpSplit",
    "PendingCall",
    "PlacementError",
    "ResourcePool",
    "Worker",
    "WorkerGroup",
    "WorkerGroupError",
    "build_pools",
    "check_device",
    "check_fits_machine",
    "check_fits_session",
    "completed",
    "lost_embedded_node",
    "other_versions",
    "ray_session",
    "resources_asked",
    "run_pools",
    "say_after_node_loss",
    "start_ray",
    "stop_ray",
    "write_placement_report",
]
