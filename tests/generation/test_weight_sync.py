"""The weight sync's layout and checks, on real Hugging Face models in one process: a sync
lands every tensor bit for bit, and a corrupted bucket, a missing tensor, a tensor of another
shape, or a generation asked of a version not held, stops with a WeightSyncError that names
the worker and the versions. (The sync over real Ray workers: tests/e2e/test_split_rollout.py.)"""

import dataclasses

import pytest
import torch

from tests.model_support import tiny_qwen2
from verlite.config import ModelConfig
from verlite.distributed import apply_fsdp, distinct_entries, model_state, run_on_ranks
from verlite.generation import WeightBucket, WeightSyncError, make_bucket, sync_layout
from verlite.generation.weights import WeightReceiver
from verlite.models import build_policy


def policy(seed: int, dtype: str = "float32") -> torch.nn.Module:
    cfg = ModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, dtype=dtype)
    return build_policy(cfg, vocab_size=40, max_positions=32, seed=seed)


def publish(state: dict[str, torch.Tensor], version: int, bucket_bytes: int) -> list[WeightBucket]:
    """The buckets the actor publishes, as the actor makes them: one staging buffer for
    all, each bucket's parts copied before the next is made (as Ray stores a call's result
    before the actor's next call)."""
    layout = sync_layout(state, bucket_bytes)
    staging = torch.empty(layout.staging_bytes, dtype=torch.uint8)
    buckets = []
    for index, specs in enumerate(layout.buckets):
        bucket = make_bucket(
            version, index, layout, [state[s.name] for s in specs], staging=staging, started=0.0
        )
        buckets.append(dataclasses.replace(bucket, parts=[part.copy() for part in bucket.parts]))
    return buckets


def sync(source: torch.nn.Module, version: int, bucket_bytes: int) -> list[WeightBucket]:
    """What a rollout worker receives."""
    return publish(source.state_dict(), version, bucket_bytes)


def deliver(receiver: WeightReceiver, buckets: list[WeightBucket]) -> None:
    for bucket in buckets:
        receiver.load(bucket)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("bucket_bytes", [1, 4096, 2**30])
def test_a_sync_lands_every_tensor_bit_for_bit(dtype: str, bucket_bytes: int) -> None:
    source, target = policy(1, dtype), policy(2, dtype)
    buckets = sync(source, version=7, bucket_bytes=bucket_bytes)
    # a tensor larger than a bucket travels alone; otherwise buckets hold several
    sizes = [len(bucket.tensors) for bucket in buckets]
    assert max(sizes) == 1 if bucket_bytes == 1 else max(sizes) > 1
    state = source.state_dict()
    layout = sync_layout(state, bucket_bytes)
    assert layout.nbytes == sum(t.numel() * t.element_size() for t in state.values())
    assert all(
        sum(part.nbytes for part in b.parts) <= bucket_bytes + 64 * len(b.tensors)
        or len(b.tensors) == 1
        for b in buckets
    )
    receiver = WeightReceiver(target, who="rollout rank 0")
    *firsts, last = buckets
    assert all(receiver.load(bucket) is None for bucket in firsts)
    assert receiver.version is None  # none while a sync is part-way
    assert receiver.load(last) > 0.0  # the sync's seconds
    receiver.require(7)
    assert receiver.version == 7
    for name, value in source.state_dict().items():
        assert torch.equal(target.state_dict()[name], value), name


def test_small_tensors_travel_staged_large_ones_as_views_and_land_without_a_copy() -> None:
    cfg = ModelConfig(hidden_size=256, num_layers=1, num_heads=4, num_kv_heads=2)
    source = build_policy(cfg, vocab_size=1024, max_positions=32, seed=1)
    target = build_policy(cfg, vocab_size=1024, max_positions=32, seed=2)
    state = source.state_dict()
    layout = sync_layout(state, 2**30)
    staging = torch.empty(layout.staging_bytes, dtype=torch.uint8)
    bucket = make_bucket(
        1, 0, layout, [state[s.name] for s in layout.buckets[0]], staging=staging, started=0.0
    )
    large = [spec for spec in bucket.tensors if spec.part]
    assert large and all(spec.nbytes >= 2**20 for spec in large)  # the embeddings
    assert all(spec.offset % 64 == 0 for spec in bucket.tensors if not spec.part)
    for spec in large:  # the actor's own bytes, not a copy
        assert bucket.parts[spec.part].ctypes.data == state[spec.name].data_ptr()
    assert bucket.parts[0].ctypes.data == staging.data_ptr()  # the small ones, staged
    (received,) = sync(source, 1, 2**30)
    WeightReceiver(target, who="rollout rank 0").load(received)
    for spec in bucket.tensors:  # the model reads the received bytes
        held = target.state_dict()[spec.name]
        assert held.data_ptr() == received.parts[spec.part].ctypes.data + spec.offset
        assert torch.equal(held, state[spec.name])


def test_a_corrupted_bucket_is_refused_and_generation_with_it_too() -> None:
    source, target = policy(1), policy(2)
    receiver = WeightReceiver(target, who="rollout rank 3 (node 10.0.0.2)")
    deliver(receiver, sync(source, version=1, bucket_bytes=4096))
    buckets = sync(source, version=2, bucket_bytes=4096)
    buckets[2].parts[0][5] ^= 0x10  # one bit of one byte of the third bucket, in transit
    with pytest.raises(
        WeightSyncError,
        match=r"rollout rank 3 \(node 10.0.0.2\): weights of version 2 failed their check: bucket 3 of",
    ):
        deliver(receiver, buckets)
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
    deliver(receiver, sync(source, version=4, bucket_bytes=2**30))
    # older or newer, any other version is refused (the sync of the one held completed)
    for asked in (3, 5):
        with pytest.raises(WeightSyncError, match=f"version {asked}, but holds version 4$"):
            receiver.require(asked)
    receiver.require(4)


def test_a_sync_that_leaves_a_tensor_unset_or_of_another_shape_is_refused() -> None:
    source, target = policy(1), policy(2)
    state = source.state_dict()
    missing = next(iter(state))
    partial = {name: value for name, value in state.items() if name != missing}
    receiver = WeightReceiver(target, who="rollout rank 0")
    with pytest.raises(
        WeightSyncError, match=f"did not send 1 of the model's tensors \\(e.g. '{missing}'\\)"
    ):
        deliver(receiver, publish(partial, 3, 2**30))
    assert receiver.version is None
    wrong = {name: value.reshape(-1) if name == missing else value for name, value in state.items()}
    with pytest.raises(
        WeightSyncError, match=f"sent '{missing}' as float32 \\[.*\\], the model holds"
    ):
        deliver(receiver, publish(wrong, 3, 2**30))


def test_the_checksum_sees_blocks_swapped_and_buckets_out_of_order_or_of_another_sync() -> None:
    source, target = policy(1), policy(2)
    buckets = sync(source, version=1, bucket_bytes=4096)
    largest = max(range(len(buckets)), key=lambda i: buckets[i].parts[0].nbytes)
    array = buckets[largest].parts[0]
    assert array.nbytes >= 2 * 4096
    first, second = array[:4096].copy(), array[4096:8192].copy()
    array[:4096], array[4096:8192] = second, first  # same words, other places
    receiver = WeightReceiver(target, who="rollout rank 0")
    with pytest.raises(
        WeightSyncError, match=f"bucket {largest + 1} of .* failed|failed their check"
    ):
        deliver(receiver, buckets)
    buckets = sync(source, version=2, bucket_bytes=4096)
    receiver.load(buckets[0])
    with pytest.raises(WeightSyncError, match="delivered bucket 3 where bucket 2 was due"):
        receiver.load(buckets[2])
    # in order, but a bucket of another sync: the model would hold two versions' tensors
    for version in (3, 1):
        receiver.load(sync(source, version=2, bucket_bytes=4096)[0])
        with pytest.raises(
            WeightSyncError,
            match=f"bucket 2 of version {version} arrived during the sync of version 2",
        ):
            receiver.load(sync(source, version=version, bucket_bytes=4096)[1])
        assert receiver.version is None


def test_a_sync_lands_in_the_parameters_the_model_holds_now() -> None:
    """Parameters replaced after the receiver was made (a move, a cast, a reload) still
    receive the sync: the receiver writes where generation reads."""
    source, target = policy(1), policy(2)
    receiver = WeightReceiver(target, who="rollout rank 0")
    name = "model.norm.weight"
    target.model.norm.weight = torch.nn.Parameter(target.model.norm.weight.detach().clone())
    deliver(receiver, sync(source, version=1, bucket_bytes=2**30))
    assert torch.equal(target.state_dict()[name], source.state_dict()[name])


def test_after_a_failed_bucket_the_rest_of_the_sync_is_refused() -> None:
    """A sync whose first bucket fails its check holds no version, however many of its
    later buckets arrive intact; the next sync starts over."""
    source, target = policy(1), policy(2)
    receiver = WeightReceiver(target, who="rollout rank 0")
    buckets = sync(source, version=7, bucket_bytes=4096)
    buckets[0].parts[0][0] ^= 0x01
    with pytest.raises(WeightSyncError, match=r"failed their check: bucket 1 of"):
        receiver.load(buckets[0])
    for bucket in buckets[1:]:
        with pytest.raises(
            WeightSyncError, match="refused: the sync of version 7 failed its check"
        ):
            receiver.load(bucket)
    assert receiver.version is None
    deliver(receiver, sync(source, version=8, bucket_bytes=4096))
    receiver.require(8)


def _sent_names(rank: int, world: int) -> list[str]:
    """The names a sync of an FSDP2-sharded tied model sends, on this rank."""
    model = apply_fsdp(tiny_qwen2(tied=True, vocab_size=40))
    return list(distinct_entries(model_state(model)))


@pytest.mark.parametrize("tied", [True, False])
def test_a_tied_head_travels_once_and_lands_in_the_tied_model(tied: bool) -> None:
    """A tied head is the embedding under a second name: a sync sends it once (a
    Qwen2.5-0.5B's is 545 MB in fp32), and the rollout model, tied alike, expects it once;
    an untied head is a tensor of its own and travels."""
    source, target = (
        tiny_qwen2(tied=tied, vocab_size=40, seed=1),
        tiny_qwen2(tied=tied, vocab_size=40, seed=2),
    )
    state = distinct_entries(source.state_dict())
    assert ("lm_head.weight" in state) is not tied and "model.embed_tokens.weight" in state
    distinct = {p.data_ptr(): p.numel() * p.element_size() for p in source.state_dict().values()}
    assert sync_layout(state, 4096).nbytes == sum(distinct.values())
    receiver = WeightReceiver(target, who="rollout rank 0")
    deliver(receiver, publish(state, 3, 4096))
    receiver.require(3)
    for name, value in source.state_dict().items():
        assert torch.equal(target.state_dict()[name], value), name
    assert (target.lm_head.weight is target.model.embed_tokens.weight) is tied
    if tied:  # sharded, the tie is one DTensor: every rank leaves its second name out alike
        names = run_on_ranks(_sent_names, world_size=2)
        assert names[0] == names[1] == list(state)
