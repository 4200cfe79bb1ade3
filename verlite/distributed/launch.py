"""Run a function on N freshly spawned ranks joined in one process group (tests, benchmarks).

Failures surface as exceptions in the caller, never as a hang: a rank that raises, dies,
or outlives the timeout stops the whole launch, and every spawned process is reaped.
"""

from __future__ import annotations

import os
import pickle
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from multiprocessing.context import ForkServerContext, SpawnContext
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.multiprocessing as mp

from verlite.distributed.process_group import (
    destroy_process_group,
    find_free_port,
    init_process_group,
)

_HOST = "127.0.0.1"
# Grace period for ranks that already returned their result to tear down their group.
_EXIT_GRACE_S = 30.0
_KILL_GRACE_S = 5.0


class RankFailedError(RuntimeError):
    """A rank raised, or exited without returning a result."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(message)
        self.rank = rank


class RankTimeoutError(RankFailedError, TimeoutError):
    """Ranks were still running when the launch timeout passed."""


def _exit_with_parent(launcher_pid: int) -> None:
    # A rank orphaned by a killed launcher would otherwise block in a collective until the
    # process-group timeout; poll and leave at once. The rank's parent is the launcher's fork
    # server, which ends with the launcher (then the rank is re-parented).
    parent = os.getppid()
    while True:
        time.sleep(1.0)
        if os.getppid() != parent or not _alive(launcher_pid):
            os._exit(1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    return True


def rank_gpus(backend: str, world_size: int) -> list[str | None]:
    """The GPU each rank runs on: with NCCL one visible GPU per rank (the rank then sees only
    it, as cuda:0, like a Ray worker given one GPU); none with gloo alone."""
    if "nccl" not in backend:
        return [None] * world_size
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = listed.split(",") if listed else [str(i) for i in range(torch.cuda.device_count())]
    if world_size > len(visible):
        raise ValueError(
            f"NCCL needs one GPU per rank: {world_size} rank{'s' * (world_size != 1)}, "
            f"{len(visible)} GPU{'s' * (len(visible) != 1)} visible"
        )
    return [visible[rank] for rank in range(world_size)]


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    args: tuple[Any, ...],
    backend: str,
    gpu: str | None,
    master_port: int,
    timeout_s: float,
    num_threads: int,
    parent_pid: int,
    conn: Connection,
) -> None:
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    torch.set_num_threads(num_threads)
    if gpu is not None:  # before CUDA starts in this process
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
        torch.cuda.set_device(0)
    try:
        init_process_group(
            rank=rank,
            world_size=world_size,
            master_addr=_HOST,
            master_port=master_port,
            backend=backend,
            timeout_s=timeout_s,
        )
        payload: tuple[str, Any] = ("ok", fn(rank, world_size, *args))
    except BaseException:
        payload = ("error", traceback.format_exc())
    try:
        # Plain pickle, not torch's multiprocessing reductions: those pass tensors through
        # shared-memory handles that die with this process, before the launcher reads them.
        try:
            data = pickle.dumps(payload)
        except Exception:
            data = pickle.dumps(("error", f"result is not picklable:\n{traceback.format_exc()}"))
        # Send before teardown so the launcher has the answer even if teardown stalls.
        conn.send_bytes(data)
    finally:
        conn.close()
        destroy_process_group()


def _reap(procs: list[BaseProcess], grace_s: float) -> None:
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(_KILL_GRACE_S)
        if p.is_alive():
            p.kill()
            p.join()


def _context(backend: str) -> SpawnContext | ForkServerContext:
    """Ranks start as forks of one server process that has imported torch, transformers and
    verlite's training engine once, and nothing else: no threads, process group or CUDA state
    are inherited, as with spawn. A rank imported what the server had not: ``transformers``
    imports its model classes lazily, and the engine (tensordict, the models, the losses) cost
    each rank of the invariance audit 2-4 s, a 4-rank start 15-20 s on a busy 2-core machine,
    0.3 s with it preloaded. NCCL ranks are spawned: an import in the server that asked CUDA
    anything would break CUDA in its forks."""
    if "nccl" in backend:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(
        ["torch", "transformers", "verlite.distributed", "verlite.workers.train_engine"]
    )
    return ctx


def run_on_ranks(
    fn: Callable[..., Any],
    *,
    world_size: int,
    args: tuple[Any, ...] = (),
    backend: str = "gloo",
    timeout_s: float = 600,
    num_threads: int = 1,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; results by rank.

    With NCCL in ``backend`` each rank gets one of the visible GPUs (``rank_gpus``).

    ``fn`` and ``args`` must be picklable (a module-level function), and so must the
    results. Raises ``RankFailedError`` naming the first rank that raised (with its
    traceback) or died, and ``RankTimeoutError`` when ``timeout_s`` passes first.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    gpus = rank_gpus(backend, world_size)
    deadline = time.monotonic() + timeout_s
    ctx = _context(backend)
    port = find_free_port(_HOST)
    procs: list[BaseProcess] = []
    conns: list[Connection] = []
    results: dict[int, Any] = {}
    ok = False
    try:
        for rank in range(world_size):
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_rank_main,
                args=(
                    fn,
                    rank,
                    world_size,
                    args,
                    backend,
                    gpus[rank],
                    port,
                    timeout_s,
                    num_threads,
                    os.getpid(),
                    send,
                ),
                name=f"verlite-rank-{rank}",
            )
            proc.start()
            # Only the child may hold the write end, so its death reads as EOF here.
            send.close()
            procs.append(proc)
            conns.append(recv)

        waiting: dict[Any, int] = {}
        for rank in range(world_size):
            waiting[conns[rank]] = rank
            waiting[procs[rank].sentinel] = rank
        while len(results) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                pending = sorted(set(range(world_size)) - set(results))
                raise RankTimeoutError(
                    pending[0],
                    f"run_on_ranks timed out after {timeout_s}s; ranks {pending} still running",
                )
            for ready in wait(list(waiting), timeout=remaining):
                rank = waiting.pop(ready)
                if rank in results:
                    continue
                _collect(rank, conns[rank], procs[rank], results)
        ok = True
    finally:
        for c in conns:
            c.close()
        _reap(procs, _EXIT_GRACE_S if ok else 0.0)
    return [results[rank] for rank in range(world_size)]


def _collect(rank: int, conn: Connection, proc: BaseProcess, results: dict[int, Any]) -> None:
    # Reached when either the pipe or the process sentinel is ready; a dead process may
    # still have left its answer in the pipe, so read that first.
    try:
        status, payload = pickle.loads(conn.recv_bytes()) if conn.poll() else ("died", None)
    except EOFError:
        status, payload = "died", None
    if status == "ok":
        results[rank] = payload
        return
    if status == "error":
        raise RankFailedError(rank, f"rank {rank} raised:\n{payload}")
    proc.join(_KILL_GRACE_S)
    raise RankFailedError(
        rank, f"rank {rank} exited with code {proc.exitcode} before returning a result"
    )
