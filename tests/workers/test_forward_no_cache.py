"""The forward passes of ``workers.forward`` (log-probs and values, training and inference,
padded and packed) ask the model for no KV cache: a Hugging Face model's config asks for one
by default, which each forward then builds and copies every layer's keys and values into."""

import pytest
import torch
from torch import nn

from verlite.audit.invariance import make_batch
from verlite.config import load_config
from verlite.models import build_policy, build_value_model
from verlite.models.varlen import enable_packing
from verlite.step_batch import trim_padding
from verlite.workers.forward import mark_packed, response_log_probs, response_values

MAIN = load_config("configs/ppo_tiny.yaml")
VOCAB = 97  # make_batch draws ids below 64


def _use_cache_seen(trunk: nn.Module) -> list[object]:
    """What each forward of ``trunk`` (the decoder under the head) is asked for ``use_cache``."""
    seen: list[object] = []

    def record(module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        seen.append(kwargs.get("use_cache"))

    trunk.register_forward_pre_hook(record, with_kwargs=True)
    return seen


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_log_prob_and_value_passes_keep_no_cache(packed: bool, training: bool) -> None:
    sizes = {"vocab_size": VOCAB, "max_positions": MAIN.max_sequence_length, "seed": 3}
    policy = build_policy(MAIN.model, **sizes)
    critic = build_value_model(MAIN.model, **sizes)
    assert policy.config.use_cache  # the default this guards against
    td = trim_padding(make_batch(MAIN, seed=1, num_sequences=4))
    if packed:
        for model in (policy, critic):
            enable_packing(model)
        mark_packed(td)
    seen = {"policy": _use_cache_seen(policy.model), "critic": _use_cache_seen(critic.trunk)}
    with torch.set_grad_enabled(training):
        policy.train(training)
        critic.train(training)
        response_log_probs(policy, td, temperature=1.0, entropy="loss")
        response_values(critic, td)
    assert seen == {"policy": [False], "critic": [False]}
