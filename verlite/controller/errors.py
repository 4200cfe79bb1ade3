"""The error a worker-group call raises on the driver when one of its workers fails."""

from __future__ import annotations

from ray.exceptions import RayActorError, RayTaskError

from verlite.errors import RunFailure


class WorkerGroupError(RunFailure):
    """A worker raised or died during a call; names the group, rank, node and cause."""

    def __init__(
        self, *, group: str, rank: int, node_id: str, node_ip: str, method: str, cause: str
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
