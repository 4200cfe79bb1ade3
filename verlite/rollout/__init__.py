"""Generation of responses, by the actor workers (colocated) or a rollout worker group (split).

``NativeRollout`` turns a batch of left-padded prompts into the step TensorDict of
``verlite.step_batch``: verlite's batched, KV-cached sampler. ``verlite.rollout.engine``
states what a generation engine must implement; ``verlite.rollout.weights`` syncs the
actor's weights into a rollout worker's engine, versioned and checked; and
``verlite.rollout.noise`` draws the random numbers, keyed per response so that a run does
not depend on its layout.
"""

from verlite.rollout.engine import NativeEngine, RolloutEngine
from verlite.rollout.native import NativeRollout, SamplingParams, sample_next_token
from verlite.rollout.noise import KeyedNoise, Noise, StreamNoise, noise_for, sample_keys
from verlite.rollout.weights import (
    SyncLayout,
    WeightBucket,
    WeightSyncError,
    base_checksum,
    make_bucket,
    split_frozen,
    sync_layout,
)

__all__ = [
    "KeyedNoise",
    "NativeEngine",
    "NativeRollout",
    "Noise",
    "RolloutEngine",
    "SamplingParams",
    "StreamNoise",
    "SyncLayout",
    "WeightBucket",
    "WeightSyncError",
    "base_checksum",
    "make_bucket",
    "noise_for",
    "sample_keys",
    "sample_next_token",
    "split_frozen",
    "sync_layout",
]
