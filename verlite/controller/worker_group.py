"""WorkerGroup: one Ray actor per bundle of a resource pool, joined in one process group,
and called with an explicit dispatch and collect (``verlite.controller.dispatch``).

TensorDicts travel both ways as raw byte arrays (``verlite.controller.transport``).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Hashable, Iterator, Mapping, Sequence
from typing import Any, NoReturn, TypeVar

import ray
from ray.exceptions import RayActorError, RayError, RayTaskError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from verlite.controller import dispatch as dispatching
from verlite.controller.dispatch import Collect, Dispatch
from verlite.controller.failures import (
    WorkerGroupError,
    WorkerInputError,
    describe_failure,
    input_error,
    is_lost,
)
from verlite.controller.resource_pool import ResourcePool
from verlite.controller.session import worker_runtime_env
from verlite.controller.transport import install_in_worker, use_tensordict_transport
from verlite.controller.worker import Worker

# Arguments of these types are sent inline with each call; an object reference (another
# call's result, see ``PendingCall.ref``) is passed as it is, and Ray hands the rank its
# value once it exists. Anything else that several
# ranks receive (a broadcast) is put in the object store once and passed by reference, so
# it is serialized once, not once per rank; what one rank alone receives (its share of a
# dp_split) goes with its call, which Ray sends inline when small and through the object
# store when large — a ray.put of its own would only add a round trip.
_INLINE = (type(None), bool, int, float, str)
# How long a graceful shutdown may take before the workers are killed regardless.
_SHUTDOWN_GRACE_S = 10.0
# How long a rank's transport error waits for the death of the peer that caused it.
_PEER_DEATH_GRACE_S = 2.0

K = TypeVar("K", bound=Hashable)


class PendingCall:
    """A call in flight on every rank of a group; :meth:`result` waits and collects."""

    def __init__(
        self,
        group: WorkerGroup,
        method: str,
        refs: list[ray.ObjectRef[Any]],
        mode: Collect,
        restore: list[int] | None,
    ) -> None:
        self._group = group
        self._method = method
        self._refs = refs
        self._mode = mode
        self._restore = restore

    def ref(self, rank: int) -> ray.ObjectRef[Any]:
        """One rank's result, unresolved: passed to another call, it reaches that call's
        ranks without passing through the driver."""
        return self._refs[rank]

    def result(self) -> Any:
        """The collected result; raises :class:`WorkerGroupError` at the first failed rank."""
        ((_, result),) = completed({0: self})
        return result


def completed(calls: Mapping[K, PendingCall]) -> Iterator[tuple[K, Any]]:
    """Each call's key and collected result as soon as every rank of it has returned, in the
    order the calls complete: calls in flight side by side (on separate groups) are each seen
    when they end, not when the slowest does. All their ranks are waited on at once, and the
    first failure of any rank raises at once, as :meth:`PendingCall.result` raises it
    (:class:`WorkerGroupError`, or :class:`WorkerInputError`): ranks that are fine may be
    blocked in a collective with the failed one, so a rank-order ``ray.get`` could hang. The
    other calls still in flight then run on until their groups are shut down (a run's groups
    are, without waiting, after any failure: ``driver.run.start_groups``)."""
    owner = {ref: (key, rank) for key, call in calls.items() for rank, ref in enumerate(call._refs)}
    results: dict[K, list[Any]] = {key: [None] * len(call._refs) for key, call in calls.items()}
    left = {key: len(call._refs) for key, call in calls.items()}
    pending = list(owner)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        for ref in done:
            key, rank = owner[ref]
            call = calls[key]
            try:
                results[key][rank] = ray.get(ref)
            except RayError as err:
                same_call = [other for other in pending if owner[other][0] == key]
                call._group._fail(call, rank, err, same_call)
            left[key] -= 1
            if not left[key]:
                yield key, dispatching.collect(call._mode, results[key], call._restore)


class WorkerGroup:
    """``worker_cls`` on every slot of ``pool``, each with ``share`` of its bundle.

    Worker ``rank`` is the actor ``verlite:<run_id>:<name>:<rank>``; ``name`` is also the
    role the workers receive. Construction reserves the pool, starts the workers and
    (:meth:`join`) joins them in one process group; a failure on the way shuts down what was
    started. With ``join=False`` the caller joins later: groups constructed one after another
    that way start their processes (seconds of imports each) side by side, and a call made
    before :meth:`join` runs once the workers have joined.
    """

    def __init__(
        self,
        name: str,
        worker_cls: type[Worker],
        pool: ResourcePool,
        *,
        share: float,
        worker_kwargs: dict[str, Any],
        torch_threads: int,
        run_id: str,
        join: bool = True,
    ) -> None:
        if not issubclass(worker_cls, Worker):
            raise TypeError(f"{worker_cls.__name__} must subclass verlite.controller.Worker")
        if not 0.0 < share <= 1.0:
            raise ValueError(f"share must be in (0, 1], got {share}")
        self.name = name
        self.pool = pool
        self.share = share
        self._slots = pool.ready()
        self.world_size = len(self._slots)
        self.resources = {key: amount * share for key, amount in pool.bundle.items()}
        self._failed = False
        remote_cls = ray.remote(worker_cls)
        # Actor handles are typed loosely: Ray's stubs do not see the remote methods.
        self._workers: list[Any] = []
        try:
            for rank, slot in enumerate(self._slots):
                options = remote_cls.options(
                    name=f"verlite:{run_id}:{name}:{rank}",
                    runtime_env=worker_runtime_env(),
                    num_cpus=self.resources["CPU"],
                    num_gpus=self.resources.get("GPU", 0.0),
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=slot.placement_group,
                        placement_group_bundle_index=slot.bundle_index,
                    ),
                )
                self._workers.append(
                    options.remote(
                        role=name,
                        rank=rank,
                        world_size=self.world_size,
                        torch_threads=torch_threads,
                        cwd=os.getcwd(),
                        **worker_kwargs,
                    )
                )
            # The whole start is queued now: a worker runs its calls in the order they were
            # submitted, so :meth:`join` only waits, and no round trip of the driver's delays
            # a group that the caller joins after another.
            self._started = [w.node_info.remote() for w in self._workers]
            self._installed = [w.__ray_call__.remote(install_in_worker) for w in self._workers]
            # Rank 0's address goes to every rank as object refs, so all init calls are
            # submitted together and the ranks rendezvous concurrently.
            addr, port = self._workers[0].master_address.options(num_returns=2).remote()
            self._joined = [w.init_distributed.remote(addr, port) for w in self._workers]
        except BaseException:
            self.shutdown()
            raise
        if join:
            self.join()

    def join(self) -> None:
        """Wait for every worker to start and to join the group's process group (both
        submitted at construction)."""
        try:
            self._infos: list[dict[str, Any]] = self._wait(self._started, "node_info")
            # Batches go out and results come back as raw byte arrays: the driver's and
            # every worker's Ray serializer learn the TensorDict transport.
            use_tensordict_transport()
            self._wait(self._installed, "install_in_worker")
            self._wait(self._joined, "init_distributed")
        except BaseException:
            self.shutdown()
            raise

    def call(
        self,
        method: str,
        *args: Any,
        dispatch: Dispatch = "broadcast",
        collect: Collect = "list",
        **kwargs: Any,
    ) -> Any:
        """Call ``method`` on every rank and wait for the collected result."""
        return self.call_async(method, *args, dispatch=dispatch, collect=collect, **kwargs).result()

    def call_async(
        self,
        method: str,
        *args: Any,
        dispatch: Dispatch = "broadcast",
        collect: Collect = "list",
        **kwargs: Any,
    ) -> PendingCall:
        """Start ``method`` on every rank; groups on separate pools then run side by side.
        Every rank's arguments are cut and serialized before this returns (Ray serializes a
        call's arguments as it is submitted): the caller may change them afterwards, in place
        too, and no rank sees it (``tests/test_concurrent_updates.py``)."""
        if not self._workers:
            raise RuntimeError(f"worker group {self.name!r} is shut down")
        dispatching.check_pairing(dispatch, collect)
        plan = dispatching.dispatch(dispatch, self.world_size, args, kwargs)
        receivers = Counter(
            key
            for rank_args, rank_kwargs in zip(plan.args, plan.kwargs, strict=True)
            for key in {id(v) for v in (*rank_args, *rank_kwargs.values())}
        )
        shared = {key for key, count in receivers.items() if count > 1}
        stored: dict[int, Any] = {}
        refs = [
            getattr(worker, method).remote(
                *(_transport(a, shared, stored) for a in rank_args),
                **{k: _transport(v, shared, stored) for k, v in rank_kwargs.items()},
            )
            for worker, rank_args, rank_kwargs in zip(
                self._workers, plan.args, plan.kwargs, strict=True
            )
        ]
        return PendingCall(self, method, refs, collect, plan.restore)

    def placement(self) -> list[dict[str, Any]]:
        """Where every rank runs: role, rank, pool, node, process, GPUs and resources, and the
        versions of its packages that shape the numbers."""
        return [
            {
                "role": self.name,
                "rank": rank,
                "pool": self.pool.name,
                "node_id": info["node_id"],
                "node_ip": info["node_ip"],
                "pid": info["pid"],
                "gpu_ids": info["gpu_ids"],
                "resources": dict(self.resources),
                "versions": info["versions"],
            }
            for rank, info in enumerate(self._infos)
        ]

    def shutdown(self, *, graceful: bool = True) -> None:
        """Leave the process groups, then kill every worker (idempotent). ``graceful=False``
        kills at once: after a failure, ranks may wait on a lost peer or node, and a run
        that restarts should not wait :data:`_SHUTDOWN_GRACE_S` for them."""
        workers, self._workers = self._workers, []
        if not workers:
            return
        if graceful and not self._failed:
            # A failed group may have ranks blocked in a collective with the dead one; they
            # would never run shutdown, so it is skipped and they are killed directly.
            refs = [w.shutdown.remote() for w in workers]
            ray.wait(refs, num_returns=len(refs), timeout=_SHUTDOWN_GRACE_S)
        for worker in workers:
            ray.kill(worker, no_restart=True)

    def _wait(self, refs: list[ray.ObjectRef[Any]], method: str) -> Any:
        """Every rank's result, by rank, of calls submitted to each directly (the start's)."""
        ((_, results),) = completed({0: PendingCall(self, method, refs, "list", None)})
        return results

    def _fail(
        self,
        call: PendingCall,
        rank: int,
        err: RayError,
        pending: Sequence[ray.ObjectRef[Any]],
    ) -> NoReturn:
        """Raise the failure of ``call``'s ``rank`` (``pending``: its ranks not yet returned),
        naming the group, rank, node and cause; the group is marked failed."""
        self._failed = True
        rank_of = {ref: i for i, ref in enumerate(call._refs)}
        rank, err = self._first_cause(rank, err, pending, rank_of)
        slot = self._slots[rank]
        if (bad := input_error(err)) is not None:
            raise WorkerInputError(
                f"{bad} (worker group {self.name!r}: rank {rank} on node "
                f"{slot.node_id[:12]} ({slot.node_ip}), in {call._method}())"
            ) from err
        raise WorkerGroupError(
            group=self.name,
            rank=rank,
            node_id=slot.node_id,
            node_ip=slot.node_ip,
            method=call._method,
            cause=describe_failure(err),
            lost=is_lost(err),
        ) from err

    @staticmethod
    def _first_cause(
        rank: int,
        err: RayError,
        pending: Sequence[ray.ObjectRef[Any]],
        rank_of: dict[ray.ObjectRef[Any], int],
    ) -> tuple[int, RayError]:
        """The failure to report. A live rank's transport error is what a lost peer causes,
        so the other ranks get :data:`_PEER_DEATH_GRACE_S` to show the cause: a peer that
        raised (a real error, which no restart mends) or died is named instead; otherwise
        (Ray takes longer to report a lost node) the live rank is."""
        if not (isinstance(err, RayTaskError) and is_lost(err)):
            return rank, err
        deadline = time.monotonic() + _PEER_DEATH_GRACE_S
        waiting = list(pending)
        while waiting and (left := deadline - time.monotonic()) > 0:
            done, waiting = ray.wait(waiting, num_returns=1, timeout=left)
            for ref in done:
                try:
                    ray.get(ref)
                except RayError as other:
                    if isinstance(other, RayActorError) or not is_lost(other):
                        return rank_of[ref], other
        return rank, err


def _transport(value: Any, shared: set[int], stored: dict[int, Any]) -> Any:
    """How ``value`` travels to a rank: inline, with the call, or as a reference to the one
    copy in the object store when several ranks receive it (see ``_INLINE``)."""
    if isinstance(value, (*_INLINE, ray.ObjectRef)) or id(value) not in shared:
        return value
    if id(value) not in stored:
        stored[id(value)] = ray.put(value)
    return stored[id(value)]
