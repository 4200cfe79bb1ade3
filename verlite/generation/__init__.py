"""Generation of responses, by the actor workers (colocated) or a rollout worker group (split).

``Sampler`` turns a batch of left-padded prompts into the step TensorDict of
``verlite.step_batch``: verlite's batched, KV-cached sampler, which
``verlite.generation.decode`` runs on a static cache (and CUDA graphs on cuda);
``verlite.generation.sampling`` holds what both decode paths share. ``verlite.generation.engine``
states what a generation engine must implement; ``verlite.generation.weights`` syncs the
actor's weights into a rollout worker's engine, versioned and checked; and
``verlite.generation.noise`` draws the random numbers, keyed per response so that a run does
not depend on its layout.
"""

from verlite.generation.decode import DecodeSettings
from verlite.generation.engine import GenerationEngine, NativeEngine
from verlite.generation.noise import KeyedNoise, Noise, StreamNoise, noise_for, sample_keys
from verlite.generation.sampler import Sampler
from verlite.generation.sampling import SamplingParams, sample_next_token
from verlite.generation.weights import (
    SyncLayout,
    WeightBucket,
    WeightSyncError,
    base_checksum,
    make_bucket,
    split_frozen,
    sync_layout,
)

__all__ = [
    "DecodeSettings",
    "GenerationEngine",
    "KeyedNoise",
    "NativeEngine",
    "Noise",
    "Sampler",
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
