"""Connecting to a cluster is bounded: a closed port fails in seconds, and an address that
accepts connections but is no Ray head fails once the join timeout has passed (not minutes
of Ray's retries later), each in one line naming the address."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from verlite.controller import session
from verlite.controller.session import CONNECT_TIMEOUT_S, ClusterUnreachable, _check_reachable
from verlite.reachable import connection_problem


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize("scheme", ["", "ray://"])
def test_a_closed_port_fails_in_seconds_naming_the_address(
    scheme: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = closed_port()
    checks = []

    def counted(host: str, port: int, timeout_s: float) -> str | None:
        checks.append((host, port, timeout_s))
        return connection_problem(host, port, timeout_s)

    monkeypatch.setattr(session, "connection_problem", counted)
    with pytest.raises(
        ClusterUnreachable,
        match=rf"trainer.ray_address='{scheme}127.0.0.1:{port}': nothing accepts .* "
        rf"\(Connection refused within {CONNECT_TIMEOUT_S:g} s\)",
    ):
        _check_reachable(f"{scheme}127.0.0.1:{port}")
    # In seconds: one TCP connection tried within CONNECT_TIMEOUT_S, not ray.init's retries.
    assert checks == [("127.0.0.1", port, CONNECT_TIMEOUT_S)]


def test_auto_and_unparsable_addresses_are_left_to_ray() -> None:
    _check_reachable("auto")
    _check_reachable("localhost")


@pytest.fixture
def http_port() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield int(server.server_address[1])
    server.shutdown()
    server.server_close()


@pytest.mark.cluster  # Ray's own join attempt takes ~40 s: run with the cluster tests
def test_an_address_that_is_not_a_ray_head_fails_after_the_join_timeout(http_port: int) -> None:
    code = (
        "import verlite.controller.session as s\n"
        "s.JOIN_TIMEOUT_S = 1.0\n"
        "try:\n"
        f"    s.start_ray('127.0.0.1:{http_port}')\n"
        "except s.ClusterUnreachable as e:\n"
        "    print('ERROR', e)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert (
        f"ERROR trainer.ray_address='127.0.0.1:{http_port}': connected, but no Ray cluster answered within 1 s"
        in proc.stdout
    ), proc.stderr[-2000:]


def test_the_ray_switch_that_lets_python_handle_sigterm_still_exists() -> None:
    # start_ray sets this private constant so that a SIGTERM raises SystemExit in the driver
    # instead of aborting it inside a Ray call (tests/e2e: SIGTERM stops a run in one line);
    # if Ray renames it, setting it would silently do nothing.
    from ray._private import ray_constants

    assert isinstance(ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER, bool)


@pytest.mark.cluster  # an embedded Ray of its own, in a fresh process: run with the cluster tests
def test_an_embedded_rays_workers_get_worker_env_and_the_driver_keeps_its_own() -> None:
    """start_ray(None) has the embedded node's processes inherit WORKER_ENV, whatever the
    driver's environment says (a user's HF_HUB_DISABLE_PROGRESS_BARS=0 keeps the driver's
    bars, not the workers'), and leaves the driver's environment as it was."""
    code = (
        "import os, ray\n"
        "from verlite.controller import ResourcePool, Worker, WorkerGroup, start_ray, stop_ray\n"
        "class Probe(Worker):\n"
        "    def environment(self):\n"
        "        return (os.environ.get('HF_HUB_DISABLE_PROGRESS_BARS'),\n"
        "                ray.get_runtime_context().get_runtime_env_string())\n"
        "ray.cloudpickle.register_pickle_by_value(__import__('__main__'))\n"
        "os.environ['HF_HUB_DISABLE_PROGRESS_BARS'] = '0'\n"
        "start_ray(None, num_cpus=1)\n"
        "pool = ResourcePool('p', nnodes=1, workers_per_node=1, cpus_per_worker=1.0,\n"
        "                    gpus_per_worker=0.0, timeout_s=30)\n"
        "group = WorkerGroup('p', Probe, pool, share=1.0, worker_kwargs={}, torch_threads=1,\n"
        "                    run_id='env')\n"
        "print('WORKERS', group.call('environment'))\n"
        "print('DRIVER', os.environ['HF_HUB_DISABLE_PROGRESS_BARS'])\n"
        "group.shutdown(); pool.remove(); stop_ray()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "WORKERS [('1', '{}')]\nDRIVER 0\n" in proc.stdout, proc.stdout
