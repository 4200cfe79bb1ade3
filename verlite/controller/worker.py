"""Worker: the plain-Python base class of every Ray worker of a worker group, the member's side
of the group protocol.

A :class:`verlite.controller.worker_group.WorkerGroup` wraps a subclass with ``ray.remote``
and creates one per bundle, passing ``role``, ``rank``, ``world_size``, ``torch_threads``,
the driver's working directory and the subclass's own keyword arguments. The group then asks rank 0 for a rendezvous
address and has every rank join the process group concurrently (as Ray Train does).
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable
from typing import Any

import ray
import torch

from verlite.distributed import (
    default_backend,
    destroy_process_group,
    find_free_port,
    init_process_group,
)
from verlite.memory import retain_freed_memory
from verlite.package_versions import package_versions
from verlite.redaction import redact_exception, redact_process_output


def _masking_errors(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method``, raising what it raises with credentials masked (:func:`redact_exception`)."""

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except Exception as error:
            masked = redact_exception(error)
            if masked is error:
                raise
        raise masked

    return call


def _masked_raises(cls: type[Worker]) -> type[Worker]:
    """``cls`` with the constructor and public methods it defines itself wrapped by
    :func:`_masking_errors` (what it inherits is wrapped where it is defined: a copy here
    would shadow the classes after it in a subclass's method order)."""
    for name, method in list(vars(cls).items()):
        if (name == "__init__" or not name.startswith("_")) and inspect.isfunction(method):
            setattr(cls, name, _masking_errors(method))
    return cls


@_masked_raises
class Worker:
    """One rank of a worker group; subclasses add the role's methods (e.g. ``update_actor``).

    What its constructor and public methods (those a group calls) raise leaves them with
    credentials masked (:func:`verlite.redaction.redact_exception`): Ray keeps a failed
    call's exception and traceback as the worker raised them, carries them to the driver and
    shows them in its dashboard, past every stream and log record the worker masks.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _masked_raises(cls)

    def __init__(
        self,
        *,
        role: str,
        rank: int,
        world_size: int,
        torch_threads: int,
        cwd: str | None = None,
        **_: Any,
    ) -> None:
        # Relative paths of the config (output folder, model, data) mean what they mean on
        # the driver, also in a Ray session opened elsewhere (a notebook's); a node where the
        # driver's folder does not exist keeps its own.
        if cwd is not None and os.path.isdir(cwd):
            os.chdir(cwd)
        # Several workers share the node's cores; torch's default of one thread per core
        # would oversubscribe them.
        torch.set_num_threads(torch_threads)
        retain_freed_memory()
        # Ray writes an actor's stdout and stderr to log files on its node (which a cluster's
        # dashboard shows) besides forwarding them to the driver, which masks only its copy.
        # (Asked only where Ray runs: get_runtime_context would start one.)
        if ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:
            redact_process_output()
        self.role = role
        self.rank = rank
        self.world_size = world_size

    def node_info(self) -> dict[str, Any]:
        """Where this worker runs: node id and IP, process id, the GPUs Ray gave it, and the
        versions of its packages that shape the numbers (peft's where installed)."""
        context = ray.get_runtime_context()
        return {
            "node_id": context.get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
            "gpu_ids": [str(i) for i in context.get_accelerator_ids().get("GPU", [])],
            "versions": package_versions(peft=True),
        }

    def master_address(self) -> tuple[str, int]:
        """This node's IP and a port free on it: the rendezvous of the process group."""
        ip = ray.util.get_node_ip_address()
        return ip, find_free_port(ip)

    def init_distributed(self, master_addr: str, master_port: int) -> None:
        """Join the group's process group; a single worker needs none and skips it."""
        if self.world_size == 1:
            return
        init_process_group(
            rank=self.rank,
            world_size=self.world_size,
            master_addr=master_addr,
            master_port=master_port,
            backend=self.backend(),
        )

    def backend(self) -> str:
        """The backend of the group's process group: NCCL where a GPU is visible, gloo
        otherwise; a worker that knows where its tensors are says so (``TrainingWorker``)."""
        return default_backend()

    def shutdown(self) -> None:
        """Leave the process group (the group kills the process afterwards)."""
        destroy_process_group()

    def ping(self) -> bool:
        return True
