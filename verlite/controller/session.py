"""Starting and stopping the Ray session of the driver: an embedded local Ray, or a connection
to an existing cluster."""

from __future__ import annotations

import contextlib
import ipaddress
import logging
from collections.abc import Iterator

import ray
from ray._private import ray_constants

LOOPBACK = "127.0.0.1"
# Named actors (``verlite:<run_id>:<group>:<rank>``) are looked up in this namespace.
NAMESPACE = "verlite"


def _is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@contextlib.contextmanager
def _keep_loopback() -> Iterator[None]:
    # On Linux ray.init turns a loopback address (the node IP it is given, and the host of
    # a cluster address) into the machine's routable IP (services.resolve_ip_for_localhost),
    # so an embedded node asked for 127.0.0.1 would advertise the public interface and bind
    # its servers to it. Ray keeps loopback only while it believes multi-node clusters are
    # off; it reads that flag at call time, so the flag is lowered for ray.init alone. Once
    # connected, Ray takes the node IP from the started node, not from this flag.
    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


def start_ray(address: str | None, *, num_cpus: int | None = None) -> None:
    """Connect the driver to Ray.

    ``None`` starts an embedded single-node Ray reachable on 127.0.0.1 only, with no
    dashboard and with ``num_cpus`` CPUs (all of the machine's when None). Any other address
    (``host:port``, ``auto``, ``ray://...``) connects to that cluster with the user's own
    authentication settings; ``num_cpus`` must then be None.
    """
    if ray.is_initialized():
        raise RuntimeError("Ray is already initialized in this process; call stop_ray() first")
    if address is None:
        with _keep_loopback():
            ray.init(
                # "local" rather than None: None would join a cluster named by RAY_ADDRESS
                # or by the last `ray start` on this machine.
                address="local",
                num_cpus=num_cpus,
                namespace=NAMESPACE,
                include_dashboard=False,
                _node_ip_address=LOOPBACK,
                logging_level=logging.WARNING,
            )
        return
    if num_cpus is not None:
        raise ValueError("num_cpus applies to an embedded Ray only, not to a cluster address")
    loopback = _is_loopback(address)
    with _keep_loopback() if loopback else contextlib.nullcontext():
        ray.init(
            address=address,
            namespace=NAMESPACE,
            logging_level=logging.WARNING,
            # A driver next to a loopback-only cluster must join it on loopback too.
            _node_ip_address=LOOPBACK if loopback else None,
        )


def stop_ray() -> None:
    """Disconnect from Ray, stopping the embedded Ray if this process started one."""
    ray.shutdown()


@contextlib.contextmanager
def ray_session(address: str | None, *, num_cpus: int | None = None) -> Iterator[None]:
    """:func:`start_ray`, and :func:`stop_ray` however the block ends."""
    start_ray(address, num_cpus=num_cpus)
    try:
        yield
    finally:
        stop_ray()
