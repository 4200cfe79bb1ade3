"""Weight sync from the actor to the rollout workers: bucketed, pipelined, versioned, checked
where the weights land.

The actor's state is laid out in buckets of about ``bucket_bytes`` (a tensor larger than a
bucket travels alone; :func:`sync_layout`). A bucket's bytes travel as parts: each tensor of
at least ``OWN_PART_BYTES`` as a part of its own, a view of the actor's tensor, and the
smaller ones copied together into part 0, a staging buffer, at 64-byte aligned offsets
(:func:`make_bucket`, which also checksums them). A sync of version ``v`` (the actor's
update count) is one call per bucket on the actor, which puts the bucket in the object store
and returns the reference, and one on each rollout worker, which Ray hands that reference
once the actor's call is done: a worker loads bucket ``i`` while the actor prepares bucket
``i + 1``. The object store holds each bucket once per node; a rollout worker on the CPU
makes its model's own tensors views of it (no copy), one on a GPU copies them in.

A rollout worker then computes the checksum of the bytes *now in its model's tensors*, the
tensors its model holds (``state_dict(keep_vars=True)``, not detached aliases). On a GPU
that checks the copy; on the CPU, where the tensors are the received bytes, it checks what
arrived, and rebinding the model's own tensors is what puts it in the model. A tensor the
sync never sent is caught when the last bucket has landed. So a sync that delivered
nothing, the failure peers' users hit for weeks, fails as surely as a corrupted bucket.
Until every bucket of a sync has passed, the worker holds no valid version and generation
refuses to run on it; once one fails, the sync's later buckets are refused too.

The checksum is Fletcher-like over 64-bit words: the wrapping sum of the words, and the sum
of each 4 KiB block's word sum weighted by the block's place in the bucket (blocks counted
tensor by tensor). It changes with any single corrupted word or bit, a tensor left
unwritten, two tensors or two blocks swapped; it does not see words reordered within one
4 KiB block, nor tie a name to its bytes (the layout's order does), and it is not a
cryptographic digest (nothing here defends against someone who can write the object
store). It runs at memory speed (a CRC-32 costs 3 copies' time on this CPU, which made the
sync 3-4x a bare transfer). Non-persistent buffers (a rotary embedding's ``inv_freq``) are
not part of a model's state: each side computes its own.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from verlite.distributed import distinct_entries
from verlite.errors import RunFailure


class WeightSyncError(RunFailure):
    """A rollout worker's weights are not the version the trainer expects (a failed check,
    a missing tensor, or no sync yet): it refuses to generate."""


@dataclass(frozen=True)
class TensorSpec:
    """A tensor of a bucket: its name, dtype and shape, and where its bytes lie: at
    ``offset`` of the bucket's part ``part``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    part: int
    offset: int
    nbytes: int


ALIGN = 64  # bytes; every tensor of a staged part starts at a multiple
# A tensor at least this large travels as a part of its own, a view of the actor's tensor;
# smaller ones are copied together into part 0 (the object store's cost per part is
# about what copying 1 MiB costs).
OWN_PART_BYTES = 2**20


@dataclass(frozen=True)
class SyncLayout:
    """The tensors of each bucket of a sync, in order."""

    buckets: tuple[tuple[TensorSpec, ...], ...]

    @property
    def nbytes(self) -> int:
        """The bytes of the weights."""
        return sum(spec.nbytes for bucket in self.buckets for spec in bucket)

    @property
    def staging_bytes(self) -> int:
        """The size of the largest bucket's part 0, alignment gaps included."""
        return max(
            (
                spec.offset + spec.nbytes
                for bucket in self.buckets
                for spec in bucket
                if not spec.part
            ),
            default=0,
        )


@dataclass(frozen=True)
class WeightBucket:
    """Bucket ``index`` of the ``count`` of the sync of ``version``: its tensors' specs and
    bytes (flat arrays, the parts), the checksum the actor computed, and the seconds the
    actor took to prepare it."""

    version: int
    index: int
    count: int
    tensors: tuple[TensorSpec, ...]
    parts: list[np.ndarray]
    checksum: tuple[int, int]
    seconds: float
    # An adapters-only sync's bucket 0: the checksum of the actor's base weights, which
    # the sync does not send and the rollout model must hold alike.
    base_checksum: tuple[int, int] | None = None


MASK64 = 2**64 - 1


def byte_view(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as a flat uint8 array: a view of a contiguous CPU tensor, a copy
    only of a strided or device tensor."""
    return flat_bytes(tensor.detach().cpu()).numpy()


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor on its device (a view when contiguous)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


BLOCK_WORDS = 512  # 4 KiB: the granularity at which the checksum sees positions


def _block_sums(data: torch.Tensor) -> torch.Tensor:
    """The wrapping sums of the 4 KiB blocks of a flat uint8 tensor's 64-bit words (the last
    block shorter, its last word the tail of fewer than 8 bytes), on its device."""
    whole = data.numel() // 8 * 8
    head = data[:whole]
    if head.data_ptr() % 8:  # a word view needs aligned bytes
        head = head.clone()
    words = head.view(torch.int64)
    full = words.numel() // BLOCK_WORDS * BLOCK_WORDS
    sums = words[:full].view(-1, BLOCK_WORDS).sum(dim=1)
    if full == words.numel() and whole == data.numel():
        return sums
    tail = int.from_bytes(data[whole:].cpu().numpy().tobytes(), "little")
    rest = (int(words[full:].sum()) + tail) & MASK64
    signed = rest - 2**64 if rest >= 2**63 else rest
    return torch.cat([sums, torch.tensor([signed], dtype=torch.int64, device=data.device)])


def checksum(data: Iterable[torch.Tensor]) -> tuple[int, int]:
    """The checksum of the bytes of a bucket's tensors in order (flat uint8 tensors, all on
    one device; see the module docstring): the wrapping sum of every 4 KiB block's word
    sum, and of each block sum times the block's place in the bucket."""
    sums = torch.cat([_block_sums(tensor) for tensor in data])
    places = torch.arange(1, sums.numel() + 1, dtype=torch.int64, device=sums.device)
    return int(sums.sum()) & MASK64, int(sums.mul_(places).sum()) & MASK64


def sync_layout(
    state: Mapping[str, torch.Tensor],
    bucket_bytes: int,
    dtypes: Mapping[str, torch.dtype] | None = None,
) -> SyncLayout:
    """The buckets of a sync of ``state`` (whole or sharded tensors: their full shapes), each
    tensor sent in its ``dtypes`` entry (the receiving model's; ``verlite.models.precision.
    generation_dtypes``), else its own dtype."""
    buckets: list[tuple[TensorSpec, ...]] = []
    bucket: list[TensorSpec] = []
    size = staged = 0
    for name, tensor in state.items():
        sent = tensor.dtype if dtypes is None else dtypes[name]
        nbytes = math.prod(tensor.shape) * sent.itemsize
        if bucket and size + nbytes > bucket_bytes:
            buckets.append(tuple(bucket))
            bucket, size, staged = [], 0, 0
        dtype = str(sent).removeprefix("torch.")
        if nbytes >= OWN_PART_BYTES:
            parts = 1 + sum(1 for spec in bucket if spec.part)
            bucket.append(TensorSpec(name, dtype, tuple(tensor.shape), parts, 0, nbytes))
        else:
            bucket.append(TensorSpec(name, dtype, tuple(tensor.shape), 0, staged, nbytes))
            staged += -(-nbytes // ALIGN) * ALIGN
        size += nbytes
    if bucket:
        buckets.append(tuple(bucket))
    return SyncLayout(tuple(buckets))


def make_bucket(
    version: int,
    index: int,
    layout: SyncLayout,
    tensors: Sequence[torch.Tensor],
    *,
    staging: torch.Tensor,
    started: float,
    base_checksum: tuple[int, int] | None = None,
) -> WeightBucket:
    """Bucket ``index`` of ``layout`` from its whole ``tensors``: the small ones copied into
    ``staging`` (uint8 on the CPU, at least ``layout.staging_bytes``), which part 0 views
    and which must not be written again before the bucket was sent; the large ones viewed
    as they are (copied only off a device). ``started`` is the ``time.perf_counter()`` at
    which the actor began preparing it."""
    specs = layout.buckets[index]
    parts: list[np.ndarray] = [staging[:0].numpy()]
    regions = []
    for spec, tensor in zip(specs, tensors, strict=True):
        if spec.part:
            parts.append(byte_view(tensor))
            regions.append(torch.from_numpy(parts[-1]))
            continue
        region = staging[spec.offset : spec.offset + spec.nbytes]
        region.copy_(flat_bytes(tensor))
        regions.append(region)
        parts[0] = staging[: spec.offset + spec.nbytes].numpy()
    return WeightBucket(
        version,
        index,
        len(layout.buckets),
        specs,
        parts,
        checksum(regions),
        time.perf_counter() - started,
        base_checksum,
    )


def split_frozen(
    model: nn.Module, state: Mapping[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``state`` (keyed as ``model``'s own) cut in two: the entries of trainable parameters
    (a LoRA model's adapters: what an adapters-only sync sends) and the rest (its frozen
    base, which the sync only checks)."""
    trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    trained = {name: value for name, value in state.items() if name in trainable}
    frozen = {name: value for name, value in state.items() if name not in trainable}
    return trained, frozen


def base_checksum(tensors: Iterable[torch.Tensor]) -> tuple[int, int]:
    """The checksum of a LoRA model's frozen base (whole tensors, in state order). Each
    tensor is read once and may be dropped at once (gathered FSDP shards: one at a time)."""
    return checksum(flat_bytes(tensor) for tensor in tensors)


class WeightReceiver:
    """The rollout side of the sync, over ``model``'s own tensors; ``who`` names the worker
    in errors (``rollout rank 0``). With ``adapters_only`` (a LoRA policy) a sync sends
    the adapter tensors alone, and its bucket 0 carries the checksum of the actor's base
    weights, which must be this model's."""

    def __init__(self, model: nn.Module, *, who: str, adapters_only: bool = False) -> None:
        self.model = model
        self.who = who
        self.adapters_only = adapters_only
        self._base_checksum: tuple[int, int] | None = None  # of the frozen base, once
        self.version: int | None = None
        self._targets: dict[str, torch.Tensor] = {}
        self._sent: set[str] = set()
        self._next: int | None = 0  # the bucket a sync expects next; None once it failed
        self._syncing: int | None = None  # the version of the sync under way (its bucket 0's)
        self._started = 0.0
        self._failure = "no weights were synced yet"

    @torch.no_grad()
    def load(self, bucket: WeightBucket) -> float | None:
        """Land ``bucket`` in the model and check what landed there; after the last
        bucket, the seconds of the sync: the actor's first bucket, then this worker's time
        from starting to take it to the last bucket's check. Once a bucket fails, the
        sync's later buckets are refused too: only a new sync (its bucket 0) starts over."""
        if bucket.index == 0:  # no valid version while a sync is part-way
            self.version = None
            self._failure = f"the sync of version {bucket.version} did not complete"
            # The model's own tensors as they are now (not detached aliases, which a view
            # would rebind without the model seeing it): a sync lands where generation reads.
            # A tensor under two names (a tied head) is sent, and set, once.
            self._targets = distinct_entries(self.model.state_dict(keep_vars=True))
            if self.adapters_only:
                self._targets, _ = split_frozen(self.model, self._targets)
            self._sent = set()
            self._next = 0
            self._syncing = bucket.version
            self._started = time.perf_counter() - bucket.seconds
        expected = self._next
        if expected is None:
            raise WeightSyncError(
                f"{self.who}: bucket {bucket.index + 1} of the sync of version "
                f"{bucket.version} refused: {self._failure}"
            )
        try:
            return self._land(bucket, expected)
        except WeightSyncError:
            self._next = None
            failed = f"the sync of version {bucket.version} failed"
            if not self._failure.startswith(failed):
                self._failure = f"{failed} at bucket {bucket.index + 1} of {bucket.count}"
            raise

    def _land(self, bucket: WeightBucket, expected: int) -> float | None:
        """Land ``bucket``, which must be bucket ``expected`` of the sync under way."""
        if bucket.index != expected:
            raise WeightSyncError(
                f"{self.who}: the sync of version {bucket.version} delivered bucket "
                f"{bucket.index + 1} where bucket {expected + 1} was due"
            )
        if bucket.version != self._syncing:  # a sync's buckets are of one model state
            raise WeightSyncError(
                f"{self.who}: bucket {bucket.index + 1} of version {bucket.version} arrived "
                f"during the sync of version {self._syncing}"
            )
        if bucket.index == 0 and self.adapters_only:
            self._check_base(bucket)
        landed = []
        with warnings.catch_warnings():
            # The object store's buffers are read-only; the model only reads its weights.
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            parts = [torch.from_numpy(part) for part in bucket.parts]
        for spec in bucket.tensors:
            target = self._target(spec, bucket.version)
            region = parts[spec.part][spec.offset : spec.offset + spec.nbytes]
            received = region.view(target.dtype).reshape(target.shape)
            if target.device.type == "cpu":
                target.data = received  # the model reads the received bytes, not a copy
            else:
                target.copy_(received)
            landed.append(flat_bytes(target))
            self._sent.add(spec.name)
        held = checksum(landed)
        self._next = expected + 1
        if held != bucket.checksum:
            self._failure = f"the sync of version {bucket.version} failed its check"
            raise WeightSyncError(
                f"{self.who}: weights of version {bucket.version} failed their check: bucket "
                f"{bucket.index + 1} of {bucket.count} ({len(bucket.tensors)} tensors from "
                f"{bucket.tensors[0].name!r}) holds checksum {_hex(held)} in the model, the "
                f"actor sent {_hex(bucket.checksum)}; generation is refused until a sync "
                "succeeds"
            )
        if bucket.index < bucket.count - 1:
            return None
        self._complete(bucket.version)
        return time.perf_counter() - self._started

    def _check_base(self, bucket: WeightBucket) -> None:
        if self._base_checksum is None:
            _, base = split_frozen(self.model, self.model.state_dict())
            self._base_checksum = base_checksum(base.values())
        if bucket.base_checksum != self._base_checksum:
            sent = "none" if bucket.base_checksum is None else _hex(bucket.base_checksum)
            self._failure = f"the sync of version {bucket.version} is for another base model"
            raise WeightSyncError(
                f"{self.who}: the sync of version {bucket.version} sends LoRA adapters for a "
                f"base model of checksum {sent}, but this model's base holds "
                f"{_hex(self._base_checksum)}; the adapters would apply to other weights"
            )

    def require(self, version: int) -> None:
        """Raise unless the model holds, checked, the weights of ``version``."""
        if self.version != version:
            # Why none is held; a version held came from a sync that completed.
            held = f"none ({self._failure})" if self.version is None else f"version {self.version}"
            raise WeightSyncError(
                f"{self.who}: asked to generate with weights of version {version}, but holds {held}"
            )

    def _target(self, spec: TensorSpec, version: int) -> torch.Tensor:
        target = self._targets.get(spec.name)
        if target is None:
            raise WeightSyncError(
                f"{self.who}: the sync of version {version} sent {spec.name!r}, which this "
                "model does not have; actor and rollout models differ"
            )
        if (
            tuple(target.shape) != spec.shape
            or str(target.dtype).removeprefix("torch.") != spec.dtype
        ):
            raise WeightSyncError(
                f"{self.who}: the sync of version {version} sent {spec.name!r} as {spec.dtype} "
                f"{list(spec.shape)}, the model holds {target.dtype} {list(target.shape)}"
            )
        return target

    def _complete(self, version: int) -> None:
        missing = sorted(self._targets.keys() - self._sent)
        if missing:
            self._failure = f"the sync of version {version} left tensors unset"
            raise WeightSyncError(
                f"{self.who}: the sync of version {version} did not send {len(missing)} "
                f"of the model's tensors (e.g. {missing[0]!r})"
            )
        self.version = version


def _hex(pair: tuple[int, int]) -> str:
    return "/".join(f"{value:016x}" for value in pair)
