"""Generation of responses with the actor's current weights.

``NativeRollout`` turns a batch of left-padded prompts into the step TensorDict of
``verlite.step_batch``: verlite's batched, KV-cached sampler, run by the actor workers on
the model they train (no weight sync).
"""

from verlite.rollout.native import NativeRollout, SamplingParams, sample_next_token

__all__ = ["NativeRollout", "SamplingParams", "sample_next_token"]
