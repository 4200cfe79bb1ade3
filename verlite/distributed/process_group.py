"""Process-group lifecycle: free ports, Ray-Train-style init, env init, teardown, rank queries."""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket

import torch
import torch.distributed as dist

_ENV_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def find_free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that is free on ``host`` right now (the OS picks it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def backend_for(device: torch.device, *, host_shards: bool = False) -> str:
    """The backend of a process group whose ranks reduce tensors on ``device``: ``nccl`` on
    cuda (it reduces device tensors only), ``gloo`` on the CPU. ``host_shards``: ranks on
    cuda that also hold FSDP2 shards on the host (``offload=all``), which DTensor reduces
    where they are (the gradient norm of ``clip_grad_norm``): NCCL for the device's
    tensors and gloo for the host's (``cuda:nccl,cpu:gloo``, as torchtitan joins with CPU
    offload); with NCCL alone such a reduction fails ("No backend type associated with
    device type cpu")."""
    if device.type != "cuda":
        return "gloo"
    return "cuda:nccl,cpu:gloo" if host_shards else "nccl"


def default_backend() -> str:
    """``nccl`` when a GPU is visible, ``gloo`` otherwise."""
    return backend_for(torch.device("cuda" if torch.cuda.is_available() else "cpu"))


def init_process_group(
    *,
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    backend: str | None = None,
    timeout_s: float = 300,
) -> None:
    """Join the default process group; every rank calls this concurrently.

    Rank 0 hosts the TCP store at ``master_addr:master_port`` (as in Ray Train, the driver
    asks rank 0 for its address and a free port and hands both to every rank), listening on
    that address only when it is an IP address (torch's own store listens on every interface
    of the machine, a loopback run's too); a host name (``MASTER_ADDR`` may hold one, which
    may resolve to an address of another machine, a Kubernetes service's) is left to torch.
    No environment variable is read or written.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if dist.is_initialized():
        raise RuntimeError("the default process group is already initialized")
    timeout = datetime.timedelta(seconds=timeout_s)
    listening = _listen(master_addr, master_port) if rank == 0 and _is_ip(master_addr) else None
    store = dist.TCPStore(
        master_addr, master_port, world_size, rank == 0, timeout, master_listen_fd=listening
    )
    dist.init_process_group(
        backend=backend or default_backend(),
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )


def _is_ip(address: str) -> bool:
    try:
        ipaddress.ip_address(address)
    except ValueError:
        return False
    return True


def _listen(address: str, port: int) -> int:
    """A socket listening on ``address:port`` alone, its descriptor handed over (the store
    closes it)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
        sock.listen()
    except OSError:
        sock.close()
        raise
    return sock.detach()


def init_from_env() -> None:
    """Join the default process group from RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT."""
    missing = [name for name in _ENV_VARS if not os.environ.get(name)]
    if missing:
        raise ValueError(
            f"cannot init the process group from the environment: missing {', '.join(missing)}"
        )
    init_process_group(
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        master_addr=os.environ["MASTER_ADDR"],
        master_port=int(os.environ["MASTER_PORT"]),
    )


def destroy_process_group() -> None:
    """Tear down the default process group; a no-op when there is none."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def is_initialized() -> bool:
    """Whether this process has joined a default process group."""
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    """This process's rank, 0 when no group is initialized."""
    return dist.get_rank() if is_initialized() else 0


def get_world_size() -> int:
    """Number of ranks, 1 when no group is initialized."""
    return dist.get_world_size() if is_initialized() else 1
