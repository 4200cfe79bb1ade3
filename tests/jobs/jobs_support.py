"""Helpers of the job tests: the installed ``verlite`` command run as a subprocess, and a real
Ray cluster started with ``ray start`` (token authentication on) and stopped without
touching any other Ray.

Ray reads its authentication settings from the environment of a process once, so every client
call runs in a fresh ``verlite`` process with the environment under test.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
# Settings that would point a client at another cluster or token than the test's own.
RAY_CLIENT_ENV = (
    "RAY_ADDRESS",
    "RAY_API_SERVER_ADDRESS",
    "RAY_AUTH_MODE",
    "RAY_AUTH_TOKEN",
    "RAY_AUTH_TOKEN_PATH",
)
START_TIMEOUT_S = 120.0


def path_without_verlite() -> str:
    """This PATH without the folders that hold a ``verlite`` command: the PATH of a head started
    as ``/venv/bin/ray start`` from a shell that did not activate the virtualenv."""
    folders = os.environ.get("PATH", os.defpath).split(os.pathsep)
    return os.pathsep.join(f for f in folders if not shutil.which("verlite", path=f))


def client_env(**changes: str) -> dict[str, str]:
    """This process's environment without Ray client settings, plus ``changes``."""
    env = {k: v for k, v in os.environ.items() if k not in RAY_CLIENT_ENV}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return {**env, **changes}


def run_verlite(
    args: list[str], env: Mapping[str, str], timeout: float = 300.0
) -> subprocess.CompletedProcess[str]:
    """The installed ``verlite ARGS`` command (the console script, as a user runs it), in a
    fresh process, from the repository root."""
    return subprocess.run(
        [str(BIN / "verlite"), *args],
        cwd=REPO,
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


@dataclass
class RayCluster:
    """A head (and optional worker nodes) started by ``ray start --block`` in their own
    sessions, so that stopping it ends these processes only, never another Ray on the machine
    (``ray stop`` would end every Ray of the user here)."""

    token: str
    token_path: Path
    url: str = ""
    gcs_address: str = ""
    nodes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    temp_dirs: list[Path] = field(default_factory=list)

    def env(self, **changes: str) -> dict[str, str]:
        """A client environment holding this cluster's token, the way a user would."""
        return client_env(
            RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(self.token_path), **changes
        )

    def start_head(self, num_cpus: int) -> None:
        """The head, started without a ``verlite`` command on its PATH, as a user who runs
        ``/venv/bin/ray start --head`` unactivated does: jobs must find verlite anyway."""
        dashboard_port = free_port()
        self.gcs_address = f"127.0.0.1:{free_port()}"
        self.url = f"http://127.0.0.1:{dashboard_port}"
        self._start_node(
            "--head",
            f"--port={self.gcs_address.rsplit(':', 1)[1]}",
            "--include-dashboard=true",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dashboard_port}",
            f"--ray-client-server-port={free_port()}",
            num_cpus=num_cpus,
            env=self.env(PATH=path_without_verlite()),
        )
        self._wait(lambda: self.get("/api/version").status_code == 200, "the dashboard")

    def add_node(self, num_cpus: int, *, wait: bool = True) -> None:
        """Start a node; ``wait``: until the cluster counts it among its alive nodes."""
        # Each node gets its own temp dir: nodes sharing one would unpack jobs' working
        # directories over each other, deleting a running driver's current directory.
        alive = len(self.alive_nodes())
        self._start_node(f"--address={self.gcs_address}", num_cpus=num_cpus, env=self.env())
        if wait:
            self._wait(lambda: len(self.alive_nodes()) > alive, "the new node")

    def _start_node(self, *args: str, num_cpus: int, env: dict[str, str]) -> None:
        temp_dir = Path(tempfile.mkdtemp(prefix="vlj", dir="/tmp"))  # short: socket paths
        self.temp_dirs.append(temp_dir)
        command = [
            str(BIN / "ray"),
            "start",
            "--block",
            *args,
            "--node-ip-address=127.0.0.1",
            f"--num-cpus={num_cpus}",
            f"--temp-dir={temp_dir}",
            f"--dashboard-agent-listen-port={free_port()}",
            "--disable-usage-stats",
        ]
        with (temp_dir / "ray-start.log").open("wb") as log:
            self.nodes.append(
                subprocess.Popen(
                    command,
                    env=env,
                    cwd=temp_dir,
                    start_new_session=True,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )

    def kill_raylet(self, node_id: str) -> None:
        """Kill node ``node_id``'s raylet (SIGKILL), as a lost machine would lose it: its
        workers then end, and the cluster learns the node is gone only when its heartbeats
        stop."""
        for proc in Path("/proc").iterdir():
            try:
                argv = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if argv[0].endswith(b"/raylet") and any(node_id.encode() in a for a in argv):
                os.kill(int(proc.name), signal.SIGKILL)
                return
        raise LookupError(f"no raylet of node {node_id} runs here")

    def head_path(self) -> str:
        """The PATH the head's processes (and so its jobs' entrypoints) run with."""
        environ = Path(f"/proc/{self.nodes[0].pid}/environ").read_bytes().split(b"\0")
        (path,) = (v[5:].decode() for v in environ if v.startswith(b"PATH="))
        return path

    def get(self, path: str) -> requests.Response:
        return requests.get(
            self.url + path, headers={"Authorization": f"Bearer {self.token}"}, timeout=5
        )

    def job(self, job_id: str) -> dict[str, Any]:
        info: dict[str, Any] = self.get(f"/api/jobs/{job_id}").json()
        return info

    def wait_for_status(self, job_id: str, wanted: set[str], timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while (status := self.job(job_id)["status"]) not in wanted:
            assert time.monotonic() < deadline, f"{job_id} still {status} after {timeout:.0f} s"
            time.sleep(1)
        return str(status)

    def logs_of(self, job_id: str) -> str:
        return str(self.get(f"/api/jobs/{job_id}/logs").json()["logs"])

    def alive_nodes(self) -> list[dict[str, Any]]:
        nodes = self.get("/api/v0/nodes").json()["data"]["result"]["result"]
        return [n for n in nodes if n["state"] == "ALIVE"]

    def _wait(self, ready: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            for node in {self.nodes[0], self.nodes[-1]}:  # the head, and the node starting
                if node.poll() is not None:
                    raise RuntimeError(f"`ray start` exited with {node.returncode}: {self.logs()}")
            try:
                if ready():
                    return
            except (requests.RequestException, ValueError, KeyError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{what} was not up within {START_TIMEOUT_S:.0f} s: {self.logs()}")

    def logs(self) -> str:
        logs = (d / "ray-start.log" for d in self.temp_dirs)
        return "\n".join(log.read_text(errors="replace")[-2000:] for log in logs if log.exists())

    def stop(self) -> None:
        """End every process of this cluster: its nodes, and what runs in its temp dirs."""
        for node in reversed(self.nodes):
            node.send_signal(signal.SIGTERM)  # `ray start --block` then stops its node's processes
        for node in reversed(self.nodes):
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.wait(timeout=30)
            # Whatever survived in the node's own session (process group) is killed.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.pid, signal.SIGKILL)
        # Job drivers run in sessions of their own, inside the job's working directory here.
        roots = tuple(f"{d}{os.sep}" for d in self.temp_dirs)
        for proc in Path("/proc").iterdir():
            try:
                cwd = os.readlink(proc / "cwd")
            except OSError:  # not a process, gone, or not ours to read
                continue
            if f"{cwd}{os.sep}".startswith(roots):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(proc.name), signal.SIGKILL)
        for temp_dir in self.temp_dirs:
            shutil.rmtree(temp_dir, ignore_errors=True)


def started_cluster(head_cpus: int, node_cpus: Sequence[int]) -> Iterator[RayCluster]:
    """A head with ``head_cpus`` CPUs and a node per ``node_cpus``, token authentication on
    (RAY_AUTH_MODE=token, the token in a file named by RAY_AUTH_TOKEN_PATH, as the nodes and
    clients read it); stopped when the test module is done, so that two never run at once."""
    token_dir = Path(tempfile.mkdtemp(prefix="vljtok", dir="/tmp"))
    token = secrets.token_hex(32)
    token_path = token_dir / "auth_token"
    token_path.write_text(token)
    token_path.chmod(0o600)
    cluster = RayCluster(token=token, token_path=token_path)
    cluster.temp_dirs.append(token_dir)
    try:
        cluster.start_head(num_cpus=head_cpus)
        for cpus in node_cpus:
            cluster.add_node(num_cpus=cpus)
        yield cluster
    finally:
        cluster.stop()
