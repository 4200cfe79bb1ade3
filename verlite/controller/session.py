"""Starting and stopping the Ray session of the driver: an embedded local Ray, or a connection
to an existing cluster."""

from __future__ import annotations

import _thread
import atexit
import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
from ray._private import ray_constants

from verlite.errors import UserError
from verlite.reachable import connection_problem, is_loopback_host

if TYPE_CHECKING:
    from ray._private.node import Node

LOOPBACK = "127.0.0.1"
# How long a cluster address may take to accept a connection, and Ray to join the cluster.
CONNECT_TIMEOUT_S = 5.0
JOIN_TIMEOUT_S = 30.0
# Named actors (``verlite:<run_id>:<group>:<rank>``) are looked up in this namespace.
NAMESPACE = "verlite"
# Ray's notes at ray.init that are not the run's business on its console (that token
# authentication is on: the cluster's setting, not a problem of the run).
CHATTY_LOGGERS = ("ray._private.authentication.authentication_token_setup",)
# The processes an embedded node cannot run without; "{gone}" in NODE_GONE names those exited.
VITAL = (ray_constants.PROCESS_TYPE_RAYLET, ray_constants.PROCESS_TYPE_GCS_SERVER)
NODE_GONE = "the embedded Ray's node is gone (its {gone} exited)"
# The watcher of this process's embedded node (node_watch.py), while there is one.
_watcher: subprocess.Popen[bytes] | None = None
# Set in every worker before it imports anything: Hugging Face's progress bars ("Loading
# weights", "Writing model shards" at every load and export) would reach the run's console
# through Ray's log forwarding. An embedded Ray started here has its node's processes, and so
# every worker process, inherit them: Ray then hands a group the idle worker processes it
# started ahead. In any other session the workers get them through their runtime_env
# (merged into a job's, key by key), for which Ray starts a process of their own each.
WORKER_ENV = {"HF_HUB_DISABLE_PROGRESS_BARS": "1"}
# The session (its name) of the embedded Ray this process started with WORKER_ENV.
_inheriting_session: str | None = None


def _is_loopback(address: str) -> bool:
    return is_loopback_host(address.rsplit(":", 1)[0].strip("[]"))


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


class ClusterUnreachable(UserError):
    """Nothing accepts connections at the configured Ray address."""


def _check_reachable(address: str) -> None:
    """Fail within :data:`CONNECT_TIMEOUT_S` when nothing listens at ``host:port`` (or
    ``ray://host:port``): ``ray.init`` would otherwise retry for minutes. ``auto`` is left to
    Ray, which finds a local cluster or says there is none."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return
    reason = connection_problem(host.strip("[]"), int(port), CONNECT_TIMEOUT_S)
    if reason is not None:
        raise ClusterUnreachable(
            f"trainer.ray_address={address!r}: nothing accepts connections at {host}:{port} "
            f"({reason} within {CONNECT_TIMEOUT_S:g} s); start the cluster (ray start --head) or "
            "give its head's address (the GCS port, 6379 unless set)"
        )


@contextlib.contextmanager
def _bounded_connect(address: str) -> Iterator[None]:
    """Stop a ``ray.init`` that is still connecting after :data:`JOIN_TIMEOUT_S`: something
    that accepts connections but is not a Ray head (the dashboard's port given for the
    GCS's) has Ray retry for minutes. The main thread is interrupted; Ray notices between
    its attempts, so the bound holds to within one attempt (about 30 s)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired = threading.Event()

    def interrupt() -> None:
        fired.set()
        _thread.interrupt_main()

    timer = threading.Timer(JOIN_TIMEOUT_S, interrupt)
    timer.start()
    try:
        yield
    except KeyboardInterrupt:
        if not fired.is_set():
            raise
        raise ClusterUnreachable(
            f"trainer.ray_address={address!r}: connected, but no Ray cluster answered within "
            f"{JOIN_TIMEOUT_S:g} s; is it the head's GCS port (6379 unless set), not the "
            "dashboard's (8265)?"
        ) from None
    finally:
        timer.cancel()


def _refused_authentication(exc: BaseException) -> bool:
    """Whether Ray's connection error came from the cluster refusing the driver's token
    (Ray passes the GCS client's error on as text, inside its causes' messages)."""
    cause: BaseException | None = exc
    while cause is not None:
        if "InvalidAuthToken" in str(cause):
            return True
        cause = cause.__cause__
    return False


def start_ray(address: str | None, *, num_cpus: int | None = None) -> None:
    """Connect the driver to Ray.

    ``None`` starts an embedded single-node Ray reachable on 127.0.0.1 only, with no
    dashboard and with ``num_cpus`` CPUs (all of the machine's when None). Any other address
    (``host:port``, ``auto``, ``ray://...``) connects to that cluster with the user's own
    authentication settings; ``num_cpus`` must then be None.
    """
    global _inheriting_session
    if ray.is_initialized():
        raise RuntimeError("Ray is already initialized in this process; call stop_ray() first")
    # The driver's Ray core installs a C++ handler for SIGTERM (and crash signals) that dumps
    # a stack and aborts the process when the signal lands inside a Ray call: a `verlite stop`
    # or a preemption then skipped every cleanup. Without it, Python's own handler (which Ray
    # sets to raise SystemExit) stops the run between two statements. Read at ray.init;
    # workers keep theirs.
    ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True
    for name in CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    if address is None:
        with _keep_loopback(), _environment(WORKER_ENV):
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
        node = ray._private.worker._global_node
        assert node is not None  # the node ray.init(address="local") just started here
        _inheriting_session = node.session_name
        _watch_embedded_node(node)
        return
    if num_cpus is not None:
        raise ValueError("num_cpus applies to an embedded Ray only, not to a cluster address")
    _check_reachable(address)
    # A loopback address stays loopback (a cluster whose head listens there only). The driver
    # then attaches to whichever raylet runs on this machine, whatever address it registered:
    # `ray start --node-ip-address=127.0.0.1` registers the machine's routable IP, a
    # loopback-only cluster 127.0.0.1, and naming either here would wait for the other.
    with (
        _keep_loopback() if _is_loopback(address) else contextlib.nullcontext(),
        _bounded_connect(address),
    ):
        try:
            ray.init(address=address, namespace=NAMESPACE, logging_level=logging.WARNING)
        except ConnectionError as exc:
            if not _refused_authentication(exc):
                raise
            raise ClusterUnreachable(
                f"trainer.ray_address={address!r}: the cluster refused this driver's "
                "authentication token (missing or not the cluster's); give its token as the "
                "cluster's nodes have it (RAY_AUTH_MODE=token with RAY_AUTH_TOKEN_PATH or "
                "RAY_AUTH_TOKEN)"
            ) from None


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` in this process's environment for the block alone (the processes it starts
    inherit them); what was there before is restored."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def worker_runtime_env() -> dict[str, Any] | None:
    """The runtime_env of a worker group's actors: none in the embedded Ray this process
    started (its workers inherit :data:`WORKER_ENV`, and Ray may reuse its idle worker
    processes), WORKER_ENV as env_vars in any other session."""
    node = ray._private.worker._global_node
    if node is not None and _inheriting_session == node.session_name:
        return None
    return {"env_vars": dict(WORKER_ENV)}


def lost_embedded_node() -> str | None:
    """When this process started its Ray session (embedded) and a process its only node
    cannot run without has exited, a sentence saying which ("the embedded Ray's node is gone
    (its raylet (exit code -9) exited)"): no worker can be placed in that session again. None
    while they run, and for a session joined elsewhere (this process started none of them)."""
    node = ray._private.worker._global_node
    if node is None:
        return None
    dead = [
        f"{kind} (exit code {process.returncode})"
        for kind, process in node.dead_processes()
        if kind in VITAL
    ]
    return NODE_GONE.format(gone=", ".join(dead)) if dead else None


def _watch_embedded_node(node: Node) -> None:
    """Start node_watch.py on this process's embedded ``node``: when its raylet or GCS exits,
    Ray may end this process at once with a bare exit code 1, and the watcher says why."""
    global _watcher
    _stop_watching()  # a watcher left from a session ended by a bare ray.shutdown()
    if not hasattr(os, "pidfd_open"):  # not Linux: Ray's exit stays unexplained
        return
    vital = [f"{kind}={info.process.pid}" for kind in VITAL for info in node.all_processes[kind]]
    message = f"verlite: error: {NODE_GONE} and Ray ended this run's driver with it"
    script = Path(__file__).with_name("node_watch.py")
    _watcher = subprocess.Popen(
        [sys.executable, "-I", str(script), str(os.getpid()), message, *vital],
        stdin=subprocess.PIPE,
        start_new_session=True,
    )
    atexit.register(_stop_watching)  # before Ray's own exit handler, which stops the node


def say_after_node_loss(
    next_step: str, once: tuple[Sequence[Path], bool, str] | None = None
) -> None:
    """What the watcher of this process's embedded node adds to its line if Ray ends the
    driver: what a new run of the output folder does, which the driver says again as that
    changes (a run starting, a checkpoint saved). ``once``: said before the driver changes the
    folder, ``(marks, present, then)``: the watcher says ``then`` instead once any of the paths
    ``marks`` exists (``present``), or once none does: the change was made. Nothing without a
    watcher."""
    if _watcher is None:
        return
    told: str | dict[str, object] = next_step
    if once is not None:
        marks, present, then = once
        told = {"now": next_step, "once": [str(p) for p in marks], "present": present, "then": then}
    # One JSON line: a folder's name may hold a newline.
    with contextlib.suppress(BrokenPipeError):
        _watcher.stdin.write(json.dumps(told).encode() + b"\n")  # type: ignore[union-attr]
        _watcher.stdin.flush()  # type: ignore[union-attr]


def _stop_watching() -> None:
    """Tell the watcher that this process stops its Ray on purpose, and wait for it."""
    global _watcher
    if _watcher is None:
        return
    watcher, _watcher = _watcher, None
    atexit.unregister(_stop_watching)
    with contextlib.suppress(BrokenPipeError):
        watcher.stdin.write(b"stop")  # type: ignore[union-attr]
        watcher.stdin.close()  # type: ignore[union-attr]
    watcher.wait()


def stop_ray() -> None:
    """Disconnect from Ray, stopping the embedded Ray if this process started one."""
    global _inheriting_session
    _stop_watching()
    _inheriting_session = None
    ray.shutdown()


@contextlib.contextmanager
def ray_session(address: str | None, *, num_cpus: int | None = None) -> Iterator[None]:
    """:func:`start_ray`, and :func:`stop_ray` however the block ends."""
    start_ray(address, num_cpus=num_cpus)
    try:
        yield
    finally:
        stop_ray()
