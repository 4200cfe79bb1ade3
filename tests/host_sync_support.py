"""Counting host syncs without a GPU: :class:`DeviceSyncs` tracks which tensors would be on
the device (the ones it is told of with :meth:`DeviceSyncs.put`, and every tensor an op
computes from one of them) and records each sync on one of them while ``in_loop`` is set.

A sync is an op whose result the host reads (``.item()``, ``bool()``, ``int()`` and
``.tolist()``), or whose result's size depends on the values (``nonzero``, a boolean mask
as an index, ``masked_select``, ``unique``, ``torch.isin``, which on a GPU takes
``unique`` past a few elements), and a tensor built from host values while ``in_loop``
and not ``in_micro_batch`` (``torch.tensor``: a blocking copy to a GPU). On a GPU each
waits for the device to finish its queue.
"""

from __future__ import annotations

import traceback
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten
# Ops whose result the host reads, or whose size depends on the values.
SYNCS = {
    aten._local_scalar_dense.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten.masked_scatter_backward.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.repeat_interleave.Tensor,
    aten.equal.default,
    aten.is_nonzero.default,
    # On cuda, for more elements than about 10 x (test elements)^0.145, isin sorts them
    # through torch.unique, whose size the host reads.
    aten.isin.Tensor_Tensor,
    aten.isin.Tensor_Scalar,
    aten.isin.Scalar_Tensor,
}
INDEXING = {
    aten.index.Tensor,
    aten.index_put.default,
    aten.index_put_.default,
    aten._index_put_impl_.default,
}
# Tensor methods that read the values on the host without dispatching an op on a CPU tensor
# (on a GPU they copy it to the host, waiting for the device).
HOST_READS = {"tolist", "numpy", "__array__", "cpu"}


class DeviceSyncs(TorchDispatchMode):
    """Records the host syncs on (would-be) device tensors while ``in_loop`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.on_device: dict[int, torch.Tensor] = {}  # by id, kept alive: ids stay unique
        self.in_loop = False
        self.in_micro_batch = False
        # Whether a tensor an op allocates while ``in_loop`` from no tensor is on the device
        # (``torch.zeros(..., device=...)`` in a loop that allocates only there).
        self.allocates = False
        # Whether every tensor is on the device (a step captured as a CUDA graph, say).
        self.everything = False
        self.hits: list[tuple[str, list[traceback.FrameSummary]]] = []
        self._reads = _HostReads(self)

    def put(self, value: Any) -> Any:
        for leaf in tree_flatten(value)[0]:
            if isinstance(leaf, torch.Tensor):
                self.on_device[id(leaf)] = leaf
        return value

    def reads_device(self, args: Any, kwargs: Any) -> bool:
        if self.everything:
            return _any_tensor(args, kwargs)
        leaves = tree_flatten((args, kwargs))[0]
        return any(isinstance(x, torch.Tensor) and id(x) in self.on_device for x in leaves)

    def hit(self, op: str) -> None:
        self.hits.append((op, traceback.extract_stack()[:-2]))

    def __enter__(self) -> DeviceSyncs:
        self._reads.__enter__()
        return super().__enter__()  # type: ignore[no-any-return]

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._reads.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        device = self.reads_device(args, kwargs)
        out = func(*args, **kwargs)
        if device or (self.allocates and self.in_loop and not _any_tensor(args, kwargs)):
            self.put(out)
        if self.in_loop and self._syncs(func, args, device):
            self.hit(str(func))
        return out

    def _syncs(self, func: Any, args: Any, device: bool) -> bool:
        if func is aten.lift_fresh.default:  # torch.tensor(...): a copy from the host
            return not self.in_micro_batch
        if func in INDEXING:
            return device and any(i is not None and i.dtype == torch.bool for i in args[1])
        return device and func in SYNCS


def _any_tensor(args: Any, kwargs: Any) -> bool:
    return any(isinstance(x, torch.Tensor) for x in tree_flatten((args, kwargs))[0])


class _HostReads(TorchFunctionMode):
    """The reads of :data:`HOST_READS`, which dispatch no op :class:`DeviceSyncs` would see."""

    def __init__(self, syncs: DeviceSyncs) -> None:
        super().__init__()
        self.syncs = syncs

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if self.syncs.in_loop and name in HOST_READS and self.syncs.reads_device(args, kwargs):
            self.syncs.hit(name)
        return func(*args, **kwargs)


def described(hits: list[tuple[str, list[traceback.FrameSummary]]]) -> list[str]:
    """The hits, each with the last frames of verlite or the test."""
    found = []
    for op, stack in hits:
        ours = [
            f
            for f in stack
            if ("/verlite/" in f.filename or "/tests/" in f.filename)
            and not f.filename.endswith("/host_sync_support.py")
        ]
        found.append(op + " at " + " <- ".join(f"{f.name}:{f.lineno}" for f in reversed(ours[-4:])))
    return found
