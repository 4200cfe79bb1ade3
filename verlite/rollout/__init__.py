"""Generation of responses with the actor's current weights.

An engine turns a batch of left-padded prompts into the step TensorDict of
``verlite.step_batch``. ``native`` is verlite's batched, KV-cached sampler that runs on the
training model itself (no weight sync); engines such as vLLM or SGLang for GPU clusters
plug in behind the same ``RolloutEngine`` protocol.
"""

from verlite.rollout.native import NativeRollout, SamplingParams, sample_next_token

__all__ = ["NativeRollout", "SamplingParams", "sample_next_token"]
