"""The preallocated KV cache layer: appends in place, reads back what was written, and
refuses to grow past the room it was given."""

import pytest
import torch

from verlite.generation.sampler import PreallocatedCacheLayer


def test_appends_in_place_and_refuses_to_overflow() -> None:
    layer = PreallocatedCacheLayer(capacity=5)
    prompt_k, prompt_v = torch.randn(2, 3, 3, 4), torch.randn(2, 3, 3, 4)
    keys, values = layer.update(prompt_k, prompt_v)
    assert torch.equal(keys, prompt_k) and torch.equal(values, prompt_v)
    assert layer.get_seq_length() == 3 and layer.get_mask_sizes(1) == (4, 0)
    step_k, step_v = torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 4)
    keys, values = layer.update(step_k, step_v)
    assert torch.equal(keys, torch.cat([prompt_k, step_k], dim=2))
    assert torch.equal(values, torch.cat([prompt_v, step_v], dim=2))
    layer.update(step_k, step_v)
    with pytest.raises(ValueError, match="5 positions cannot hold 6"):
        layer.update(step_k, step_v)
