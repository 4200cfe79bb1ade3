"""An export's generation config ends a response where the rollouts did
(``models.mark_generation_ends``): the model folder's own end tokens kept, the tokenizer's EOS
and ``rollout.stop_token_ids`` added, a pad token only where it has none."""

import pytest
from model_support import tiny_qwen2

from verlite.models import mark_generation_ends


@pytest.mark.parametrize(
    ("eos", "pad", "ends", "expected_eos", "expected_pad"),
    [
        (None, None, [2], 2, 0),  # a folder without a generation config: the tokenizer's
        ([7, 5], 5, [7], [7, 5], 5),  # an instruct model's end of turn and EOS: kept as they are
        (5, None, [7, 9, 7], [5, 7, 9], 0),  # the run's EOS and stop ids added, once each
    ],
)
def test_the_ends_of_the_rollouts_join_the_models_own(
    eos: int | list[int] | None,
    pad: int | None,
    ends: list[int],
    expected_eos: int | list[int],
    expected_pad: int,
) -> None:
    model = tiny_qwen2(tied=True)
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = pad
    mark_generation_ends(model, ends, pad_token_id=0)
    assert model.generation_config.eos_token_id == expected_eos
    assert model.generation_config.pad_token_id == expected_pad
