"""The tokens that end a response, and an export's generation config.

A response ends at the tokenizer's EOS, ``model.path``'s own end tokens (its
generation_config.json's ``eos_token_id``, an instruct model's end of turn: Gemma-2-it's
<end_of_turn> beside its tokenizer's <eos>) and ``rollout.stop_token_ids``
(``models.generation_ends.response_stop_ids``; the run's sampling with them is
``tests/e2e/test_e2e_chat_template.py``'s). An export's generation config ends a response
where the rollouts did (``models.generation_ends.mark_generation_ends``): the model folder's
own end tokens kept, the tokenizer's EOS and ``rollout.stop_token_ids`` added, a pad token only
where it has none."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from chat_model_support import metaspace_tokenizer, save_end_of_turn_model
from model_support import tiny_qwen2

from verlite.config import Config, ConfigError, load_config
from verlite.data import load_tokenizer
from verlite.driver.preflight import check_generation
from verlite.envs import turn_stop_id
from verlite.models.generation_ends import (
    generation_end_ids,
    mark_generation_ends,
    response_stop_ids,
)


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


@pytest.fixture(scope="module")
def gemma_like(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("gemma_like")
    save_end_of_turn_model(folder)
    return folder


def _config(folder: Path, *overrides: str) -> Config:
    return load_config(None, ["data.task=copy", f"model.path={folder}", *overrides])


def test_a_models_own_end_tokens_end_a_response_besides_eos(gemma_like: Path) -> None:
    """Mutations: the model's own ends left out (only rollout.stop_token_ids); the EOS kept
    among them; rollout.ignore_eos ignoring them not."""
    tokenizer = load_tokenizer(str(gemma_like))
    eos, end = tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<end_of_turn>")
    assert generation_end_ids(str(gemma_like)) == (eos, end)
    assert response_stop_ids(_config(gemma_like), tokenizer) == (end,)
    stops = "rollout.stop_token_ids=[7,350]"
    assert response_stop_ids(_config(gemma_like, stops), tokenizer) == (end, 7)
    # rollout.ignore_eos (benchmarks) runs past every EOS, the model's own too
    assert response_stop_ids(_config(gemma_like, "rollout.ignore_eos=true"), tokenizer) == ()
    assert response_stop_ids(load_config(None, ["data.task=copy"]), tokenizer) == ()


def test_a_turn_stop_among_them_ends_a_turn_only(gemma_like: Path) -> None:
    """Gemma-2-it's <end_of_turn> as rollout.multi_turn.turn_stop hands each turn to the
    environment; the trajectory ends at EOS (or another end token), as with a base model's
    <|im_end|>. Mutation: the turn stop kept among the end tokens (every trajectory would end
    at its first turn)."""
    tokenizer = load_tokenizer(str(gemma_like))
    cfg = _config(
        gemma_like,
        "rollout.multi_turn.env=lookup",
        "rollout.multi_turn.max_total_length=64",
        "rollout.multi_turn.turn_stop=<end_of_turn>",
    )
    end = turn_stop_id(cfg, tokenizer)
    assert end == tokenizer.convert_tokens_to_ids("<end_of_turn>")
    assert end not in response_stop_ids(cfg, tokenizer)


def test_a_turn_stop_is_the_token_a_turn_ends_with_after_its_text() -> None:
    """A turn written ``cat?`` ends with the ``?`` token, not with ``▁?``, which a SentencePiece
    tokenizer makes of ``?`` alone (the start of a text, read as after a space). Mutation:
    turn_stop tokenized alone -> ``▁?``, and a turn ``cat?`` goes on."""
    tokenizer = metaspace_tokenizer()
    cfg = load_config(
        None,
        [
            "data.task=lookup",
            "rollout.multi_turn.env=lookup",
            "rollout.multi_turn.max_total_length=64",
            "rollout.multi_turn.turn_stop=?",
        ],
    )
    turn = tokenizer.encode("cat?", add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(turn) == ["▁cat", "?"]
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("?", add_special_tokens=False)) == [
        "▁?"
    ]
    assert turn_stop_id(cfg, tokenizer) == turn[-1]


def test_without_a_generation_config_the_models_config_names_them(
    gemma_like: Path, tmp_path: Path
) -> None:
    """As Hugging Face generate reads a folder without generation_config.json."""
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((gemma_like / name).read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "eos_token_id": [0, 5]}))
    assert generation_end_ids(str(tmp_path)) == (0, 5)


def test_the_end_tokens_in_all_are_at_most_what_static_decode_checks(
    gemma_like: Path, tmp_path: Path
) -> None:
    """rollout.stop_token_ids (at most 6) with the model's own 2 ends: 8 in all, within 10;
    a folder that names 5 more is refused in one line. Mutation: the model's ends not
    counted."""
    stops = "rollout.stop_token_ids=[3,4,5,6,7,8]"
    check_generation(_config(gemma_like, stops), 400)
    shutil.copytree(gemma_like, tmp_path / "more")
    (tmp_path / "more" / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [0, 350, 10, 11, 12, 13, 14]})
    )
    with pytest.raises(ConfigError) as refused:
        check_generation(_config(tmp_path / "more", stops), 400)
    assert str(refused.value) == (
        f"model.path={str(tmp_path / 'more')!r} ends generation at 7 tokens of its own (its "
        "generation config's eos_token_id) besides rollout.stop_token_ids=[3, 4, 5, 6, 7, 8]: "
        "13 end tokens in all; at most 10"
    )
