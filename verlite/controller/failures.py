"""The error a worker-group call raises on the driver when one of its workers fails, and
which failures a restart can mend (docs/design.md, "Restarts")."""

from __future__ import annotations

import time

from ray.exceptions import (
    NodeDiedError,
    ObjectLostError,
    OutOfMemoryError,
    RayActorError,
    RayTaskError,
    WorkerCrashedError,
)
from torch.distributed import DistBackendError, DistNetworkError

from verlite.errors import RunFailure, UserError

# Where gloo's transport raises: what a live rank sees when a peer's process or node is gone.
_GLOO_TRANSPORT = "gloo/transport/"


class WorkerGroupError(RunFailure):
    """A worker raised or died during a call; names the group, rank, node and cause.

    ``lost`` says whether the worker was lost rather than wrong (:func:`is_lost`): only then
    can a restart on fresh workers go on where a raise would repeat. ``detected_at`` is when
    the driver learnt of it (``time.monotonic``).
    """

    def __init__(
        self,
        *,
        group: str,
        rank: int,
        node_id: str,
        node_ip: str,
        method: str,
        cause: str,
        lost: bool,
    ) -> None:
        super().__init__(
            f"worker group {group!r}: rank {rank} on node {node_id[:12]} ({node_ip}) "
            f"failed in {method}(): {cause}"
        )
        self.group = group
        self.rank = rank
        self.node_id = node_id
        self.node_ip = node_ip
        self.method = method
        self.cause = cause
        self.lost = lost
        self.detected_at = time.monotonic()


class WorkerInputError(UserError):
    """Bad input a worker found (a :class:`UserError` it raised: what only it can see, as
    its GPU's abilities on a cluster): reported as any bad input is, its own message first
    (the setting), then where, as :class:`WorkerGroupError` names it."""


def input_error(err: BaseException | None) -> UserError | None:
    """The user error a failed remote call raised in its worker; None for any other failure."""
    cause = err.cause if isinstance(err, RayTaskError) else None
    return cause if isinstance(cause, UserError) else None


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else text


def describe_failure(err: BaseException) -> str:
    """The cause of a failed remote call in one line: the remote exception, or the death."""
    if isinstance(err, RayTaskError):
        return f"{type(err.cause).__name__}: {err.cause}"
    if isinstance(err, RayActorError):
        if err.actor_init_failed:
            # The message ends with the remote traceback's last line, the exception itself.
            return f"worker constructor raised {_last_line(str(err))}"
        return "worker process died"
    return f"{type(err).__name__}: {err}"


def is_lost(err: BaseException) -> bool:
    """Whether a failed remote call lost its worker rather than raised in it.

    Lost: the process died or was killed (by the OS or Ray's memory monitor), its node left
    the cluster, a result died with its node, or a collective failed in transport, which is
    how the live ranks of a group see a peer that is gone. Everything else a worker raises
    (its constructor included) is the code or the input, which a restart would only repeat.
    """
    if isinstance(err, RayActorError):
        return not err.actor_init_failed
    if isinstance(err, NodeDiedError | WorkerCrashedError | ObjectLostError | OutOfMemoryError):
        return True
    if isinstance(err, RayTaskError):
        cause = err.cause
        if isinstance(cause, DistNetworkError | DistBackendError):
            return True
        return isinstance(cause, RuntimeError) and _GLOO_TRANSPORT in str(cause)
    return False
