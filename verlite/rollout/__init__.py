"""Generation of responses with the actor's current weights.

``NativeRollout`` turns a batch of left-padded prompts into the step TensorDict of
``verlite.step_batch``: verlite's batched, KV-cached sampler, run by the actor workers on
the model they train (no weight sync). ``verlite.rollout.noise`` draws its random numbers,
keyed per response so that a run does not depend on its layout.
"""

from verlite.rollout.native import NativeRollout, SamplingParams, sample_next_token
from verlite.rollout.noise import KeyedNoise, Noise, StreamNoise, sample_keys

__all__ = [
    "KeyedNoise",
    "NativeRollout",
    "Noise",
    "SamplingParams",
    "StreamNoise",
    "sample_keys",
    "sample_next_token",
]
