"""The weight sync's packing and checks, on real Hugging Face models in one process: a sync
lands every tensor bit for bit, and a corrupted bucket, a missing tensor, a tensor of another
shape, or a generation asked of a version not held, stops with a WeightSyncError that names
the worker and the versions. (The sync over real Ray workers: tests/e2e/test_split_rollout.py.)"""

import numpy as np
import pytest
import torch

from verlite.config import ModelConfig
from verlite.models import build_policy
from verlite.rollout import WeightBundle, WeightSyncError, pack
from verlite.rollout.weights import WeightReceiver


def policy(seed: int, dtype: str = "float32") -> torch.nn.Module:
    cfg = ModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, dtype=dtype)
    return build_policy(cfg, vocab_size=40, max_positions=32, seed=seed)


def sync(
    source: torch.nn.Module, version: int, bucket_bytes: int
) -> tuple[WeightBundle, list[list[np.ndarray]]]:
    """What the actor publishes, with the bucket payloads kept in memory instead of the
    object store (each payload copied, as the store's put copies it)."""
    buckets = list(pack(source.state_dict().items(), bucket_bytes))
    payloads = [[array.copy() for array in arrays] for _, arrays in buckets]
    bundle = WeightBundle(version, tuple(spec for spec, _ in buckets), tuple(range(len(buckets))))
    return bundle, payloads


def deliver(receiver: WeightReceiver, bundle: WeightBundle, payloads) -> None:
    for index, arrays in enumerate(payloads):
        receiver.load_bucket(index, bundle, arrays)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("bucket_bytes", [1, 4096, 2**30])
def test_a_sync_lands_every_tensor_bit_for_bit(dtype: str, bucket_bytes: int) -> None:
    source, target = policy(1, dtype), policy(2, dtype)
    bundle, payloads = sync(source, version=7, bucket_bytes=bucket_bytes)
    # a tensor larger than a bucket travels alone; otherwise buckets hold several
    sizes = [len(spec.tensors) for spec in bundle.buckets]
    assert max(sizes) == 1 if bucket_bytes == 1 else max(sizes) > 1
    assert bundle.nbytes == sum(t.numel() * t.element_size() for t in source.state_dict().values())
    receiver = WeightReceiver(target, who="rollout rank 0")
    deliver(receiver, bundle, payloads)
    receiver.require(7)
    assert receiver.version == 7
    for name, value in source.state_dict().items():
        assert torch.equal(target.state_dict()[name], value), name


def test_packing_views_the_tensors_without_copying_them() -> None:
    model = policy(1)
    (spec, arrays), *_ = pack(model.state_dict().items(), 2**30)
    first = next(iter(model.state_dict().values()))
    assert arrays[0].ctypes.data == first.data_ptr()
    assert spec.checksum != (0, 0)


def test_a_corrupted_bucket_is_refused_and_generation_with_it_too() -> None:
    source, target = policy(1), policy(2)
    receiver = WeightReceiver(target, who="rollout rank 3 (node 10.0.0.2)")
    bundle, payloads = sync(source, version=1, bucket_bytes=4096)
    deliver(receiver, bundle, payloads)
    bundle, payloads = sync(source, version=2, bucket_bytes=4096)
    payloads[2][0][5] ^= 0x10  # one bit of one byte of the third bucket, in transit
    with pytest.raises(
        WeightSyncError,
        match=r"rollout rank 3 \(node 10.0.0.2\): weights of version 2 failed their check: bucket 3 of",
    ):
        deliver(receiver, bundle, payloads)
    assert receiver.version is None
    with pytest.raises(
        WeightSyncError,
        match=r"asked to generate with weights of version 2, but holds none \(the sync of version 2 failed its check\)",
    ):
        receiver.require(2)


def test_generation_refuses_a_version_it_does_not_hold() -> None:
    source, target = policy(1), policy(2)
    receiver = WeightReceiver(target, who="rollout rank 0")
    with pytest.raises(WeightSyncError, match="holds none \\(no weights were synced yet\\)"):
        receiver.require(0)
    bundle, payloads = sync(source, version=4, bucket_bytes=2**30)
    deliver(receiver, bundle, payloads)
    with pytest.raises(WeightSyncError, match="version 5, but holds version 4"):
        receiver.require(5)


def test_a_sync_that_leaves_a_tensor_unset_or_of_another_shape_is_refused() -> None:
    source, target = policy(1), policy(2)
    state = source.state_dict()
    missing = next(iter(state))
    partial = [(name, value) for name, value in state.items() if name != missing]
    buckets = list(pack(partial, 2**30))
    bundle = WeightBundle(3, tuple(spec for spec, _ in buckets), (0,))
    receiver = WeightReceiver(target, who="rollout rank 0")
    with pytest.raises(
        WeightSyncError, match=f"did not send 1 of the model's tensors \\(e.g. '{missing}'\\)"
    ):
        deliver(receiver, bundle, [arrays for _, arrays in buckets])
    assert receiver.version is None
    wrong = [
        (name, value.reshape(-1) if name == missing else value) for name, value in state.items()
    ]
    buckets = list(pack(wrong, 2**30))
    bundle = WeightBundle(3, tuple(spec for spec, _ in buckets), (0,))
    with pytest.raises(
        WeightSyncError, match=f"sent '{missing}' as float32 \\[.*\\], the model holds"
    ):
        deliver(receiver, bundle, [arrays for _, arrays in buckets])


def test_the_checksum_sees_blocks_swapped_within_a_tensor_and_buckets_out_of_order() -> None:
    source, target = policy(1), policy(2)
    bundle, payloads = sync(source, version=1, bucket_bytes=4096)
    largest = max(range(len(payloads)), key=lambda i: payloads[i][0].nbytes)
    array = payloads[largest][0]
    assert array.nbytes >= 2 * 4096
    first, second = array[:4096].copy(), array[4096:8192].copy()
    array[:4096], array[4096:8192] = second, first  # same words, other places
    receiver = WeightReceiver(target, who="rollout rank 0")
    with pytest.raises(
        WeightSyncError, match=f"bucket {largest + 1} of .* failed|failed their check"
    ):
        deliver(receiver, bundle, payloads)
    bundle, payloads = sync(source, version=2, bucket_bytes=4096)
    receiver.load_bucket(0, bundle, payloads[0])
    with pytest.raises(WeightSyncError, match="delivered bucket 3 where bucket 2 was due"):
        receiver.load_bucket(2, bundle, payloads[2])


def test_a_sync_lands_in_the_parameters_the_model_holds_now() -> None:
    """Parameters replaced after the receiver was made (a move, a cast, a reload) still
    receive the sync: the receiver writes where generation reads."""
    source, target = policy(1), policy(2)
    receiver = WeightReceiver(target, who="rollout rank 0")
    name = "model.norm.weight"
    target.model.norm.weight = torch.nn.Parameter(target.model.norm.weight.detach().clone())
    bundle, payloads = sync(source, version=1, bucket_bytes=2**30)
    deliver(receiver, bundle, payloads)
    assert torch.equal(target.state_dict()[name], source.state_dict()[name])
