"""Weight sync from the actor to the rollout workers: bucketed, versioned, checked where the
weights land.

The actor walks its state one tensor at a time and groups the tensors into buckets of about
``bucket_bytes`` (a tensor larger than a bucket travels alone). A bucket is the list of its
tensors' bytes, viewed without a copy; the transport's one copy (the object store's put)
is the only one. Each bucket carries a checksum of those bytes, computed by the actor,
and every sync carries a version number (the actor's update count).

A rollout worker copies each bucket into its own model and then computes the checksum of
the bytes *now in its model's tensors*. The check passes only when the weights arrived
intact and landed in the model that generates: the failure peers' users hit for weeks, a
sync that delivered nothing, fails it as surely as a corrupted bucket. Until every bucket
has passed, the worker holds no valid version, and generation refuses to run on it.

The checksum is Fletcher-like over 64-bit words: the wrapping sum of the words, and the sum
of each 4 KiB block's word sum weighted by the block's place in the bucket. It changes with
any single corrupted word or bit, a tensor left unwritten, two tensors or two blocks
swapped; it does not see words reordered within one 4 KiB block, nor tie a name to its
bytes (the spec's order does), and it is not a cryptographic digest (nothing here defends
against someone who can write the object store). Non-persistent buffers (a rotary
embedding's ``inv_freq``) are not part of a model's state: each side computes its own. It runs at memory speed (a CRC-32 costs 3 copies' time on this CPU, which made the
sync 3-4x a bare transfer).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from verlite.errors import RunFailure


class WeightSyncError(RunFailure):
    """A rollout worker's weights are not the version the trainer expects (a failed check,
    a missing tensor, or no sync yet): it refuses to generate."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class BucketSpec:
    """The tensors of one bucket, in order, their bytes and the checksum the actor computed."""

    tensors: tuple[TensorSpec, ...]
    nbytes: int
    checksum: tuple[int, int]


@dataclass(frozen=True)
class WeightBundle:
    """One sync: the version, each bucket's spec, and one object-store reference per bucket
    (to the list of its tensors' bytes)."""

    version: int
    buckets: tuple[BucketSpec, ...]
    payloads: tuple[Any, ...]

    @property
    def nbytes(self) -> int:
        return sum(bucket.nbytes for bucket in self.buckets)


MASK64 = 2**64 - 1


def byte_view(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as a flat uint8 array: a view of a contiguous CPU tensor, a copy
    only of a strided or device tensor."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy()


BLOCK_WORDS = 512  # 4 KiB: the granularity at which the checksum sees positions


def _block_sums(data: torch.Tensor) -> torch.Tensor:
    """The wrapping sums of the 4 KiB blocks of a flat uint8 tensor's 64-bit words (the
    last block shorter, its last word the tail of fewer than 8 bytes)."""
    whole = data.numel() // 8 * 8
    head = data[:whole]
    if head.storage_offset() % 8:  # a word view needs aligned bytes
        head = head.clone()
    words = head.view(torch.int64)
    full = words.numel() // BLOCK_WORDS * BLOCK_WORDS
    sums = [words[:full].view(-1, BLOCK_WORDS).sum(dim=1)]
    tail = int.from_bytes(data[whole:].numpy().tobytes(), "little")
    if full < words.numel() or tail:
        rest = (int(words[full:].sum()) + tail) & MASK64
        sums.append(torch.tensor([rest - 2**64 if rest >= 2**63 else rest], dtype=torch.int64))
    return torch.cat(sums)


def checksum(arrays: Iterable[np.ndarray]) -> tuple[int, int]:
    """The checksum of the bytes of a bucket's tensors in order (writable arrays: the
    actor's tensors, the receiver's after the copy; see the module docstring):
    the wrapping sum of every 4 KiB block's word sum, and of each block sum times the
    block's place in the bucket."""
    plain = weighted = 0
    place = 1
    for array in arrays:
        sums = _block_sums(torch.from_numpy(array))
        places = torch.arange(place, place + sums.numel(), dtype=torch.int64)
        plain = (plain + int(sums.sum())) & MASK64
        weighted = (weighted + int((sums * places).sum())) & MASK64
        place += sums.numel()
    return plain, weighted


def pack(
    tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[tuple[BucketSpec, list[np.ndarray]]]:
    """The buckets of a state, in order: each one's spec and its tensors' bytes."""
    specs: list[TensorSpec] = []
    arrays: list[np.ndarray] = []
    size = 0
    for name, tensor in tensors:
        array = byte_view(tensor)
        if arrays and size + array.nbytes > bucket_bytes:
            yield BucketSpec(tuple(specs), size, checksum(arrays)), arrays
            specs, arrays, size = [], [], 0
        specs.append(
            TensorSpec(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))
        )
        arrays.append(array)
        size += array.nbytes
    if arrays:
        yield BucketSpec(tuple(specs), size, checksum(arrays)), arrays


class WeightReceiver:
    """The rollout side of the sync, over ``model``'s own tensors; ``who`` names the worker
    in errors (``rollout rank 0``)."""

    def __init__(self, model: nn.Module, *, who: str) -> None:
        self.model = model
        self.who = who
        self.version: int | None = None
        self.targets: dict[str, torch.Tensor] = {}
        self._next = 0  # the bucket a sync in progress expects next
        self._failure = "no weights were synced yet"

    @torch.no_grad()
    def load_bucket(self, index: int, bundle: WeightBundle, arrays: Sequence[np.ndarray]) -> None:
        """Copy bucket ``index`` of ``bundle`` into the model and check what landed there."""
        if index == 0:  # no valid version while a sync is part-way
            self.version = None
            self._failure = f"the sync of version {bundle.version} did not complete"
            # The model's tensors as they are now: a sync writes where generation reads.
            self.targets = dict(self.model.state_dict())
            self._next = 0
        if index != self._next:
            raise WeightSyncError(
                f"{self.who}: the sync of version {bundle.version} delivered bucket "
                f"{index + 1} where bucket {self._next + 1} was due"
            )
        spec = bundle.buckets[index]
        landed = []
        with warnings.catch_warnings():
            # The object store's buffers are read-only; they are only read from here.
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            for tensor_spec, array in zip(spec.tensors, arrays, strict=True):
                target = self._target(tensor_spec, bundle.version)
                target.copy_(torch.from_numpy(array).view(target.dtype).reshape(target.shape))
                landed.append(byte_view(target))
        held = checksum(landed)
        self._next += 1
        if held != spec.checksum:
            self._failure = f"the sync of version {bundle.version} failed its check"
            raise WeightSyncError(
                f"{self.who}: weights of version {bundle.version} failed their check: bucket "
                f"{index + 1} of {len(bundle.buckets)} ({len(spec.tensors)} tensors from "
                f"{spec.tensors[0].name!r}) holds checksum {_hex(held)} in the model, the actor "
                f"sent {_hex(spec.checksum)}; generation is refused until a sync succeeds"
            )
        if index == len(bundle.buckets) - 1:
            self._complete(bundle)

    def require(self, version: int) -> None:
        """Raise unless the model holds, checked, the weights of ``version``."""
        if self.version != version:
            held = "none" if self.version is None else f"version {self.version}"
            raise WeightSyncError(
                f"{self.who}: asked to generate with weights of version {version}, but holds "
                f"{held} ({self._failure})"
            )

    def _target(self, spec: TensorSpec, version: int) -> torch.Tensor:
        target = self.targets.get(spec.name)
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

    def _complete(self, bundle: WeightBundle) -> None:
        sent = {t.name for bucket in bundle.buckets for t in bucket.tensors}
        missing = sorted(self.targets.keys() - sent)
        if missing:
            self._failure = f"the sync of version {bundle.version} left tensors unset"
            raise WeightSyncError(
                f"{self.who}: the sync of version {bundle.version} did not send {len(missing)} "
                f"of the model's tensors (e.g. {missing[0]!r})"
            )
        self.version = bundle.version


def _hex(pair: tuple[int, int]) -> str:
    return "/".join(f"{value:016x}" for value in pair)
