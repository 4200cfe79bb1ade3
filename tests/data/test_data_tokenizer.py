"""The character-level task tokenizer: ids, round trips, save/load, and loading a model's tokenizer."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from verlite.config import ConfigError
from verlite.data import build_task_tokenizer, encode_prompts, load_tokenizer
from verlite.data.tokenizer import (
    CHARACTERS,
    SPECIAL_TOKENS,
    holds_special_text,
    load_reward_tokenizer,
    response_text,
)


def test_special_tokens_and_small_vocab() -> None:
    tok = build_task_tokenizer()
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == ("<pad>", "<bos>", "<eos>")
    assert tok.pad_token_id == 0
    assert len({tok.pad_token_id, tok.bos_token_id, tok.eos_token_id}) == 3
    assert len(tok) == len(SPECIAL_TOKENS) + len(CHARACTERS) <= 64


@pytest.mark.parametrize(
    "text", ["copy 4821=", "reverse 4821=", "37+485=", "what is 3 * (4 - 1)?\n#### 9", " a  b "]
)
def test_one_token_per_character_round_trip(text: str) -> None:
    tok = build_task_tokenizer()
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)
    assert tok.decode(ids) == text
    assert tok(text)["input_ids"] == [tok.bos_token_id, *ids]  # the template adds BOS


def test_decode_skips_special_tokens() -> None:
    tok = build_task_tokenizer()
    ids = [tok.bos_token_id, *tok("42", add_special_tokens=False)["input_ids"], tok.eos_token_id]
    assert tok.decode([*ids, tok.pad_token_id], skip_special_tokens=True) == "42"


def test_unknown_characters_become_unk() -> None:
    tok = build_task_tokenizer()
    assert tok("aZb", add_special_tokens=False)["input_ids"][1] == tok.unk_token_id


def test_save_and_auto_load_round_trip(tmp_path: Path) -> None:
    tok = build_task_tokenizer()
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert loaded.get_vocab() == tok.get_vocab()
    assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id) == (0, 1, 2)
    text = "12+9=\n#### 21"
    assert loaded(text)["input_ids"] == tok(text)["input_ids"]
    assert loaded.decode(loaded(text)["input_ids"], skip_special_tokens=True) == text
    assert load_tokenizer(str(tmp_path)).get_vocab() == tok.get_vocab()


def test_load_tokenizer_without_a_model_is_a_character_tokenizer() -> None:
    from verlite.data.tasks import TASK_ALPHABET

    assert load_tokenizer(None).get_vocab() == build_task_tokenizer().get_vocab()
    small = load_tokenizer(None, task="copy")
    assert len(small) == len(SPECIAL_TOKENS) + len(TASK_ALPHABET) == 17
    assert small.decode(small("4821>", add_special_tokens=False)["input_ids"]) == "4821>"


def _backend() -> Tokenizer:
    return build_task_tokenizer().backend_tokenizer


def test_load_tokenizer_falls_back_to_eos_for_padding(tmp_path: Path) -> None:
    PreTrainedTokenizerFast(tokenizer_object=_backend(), eos_token="<eos>").save_pretrained(
        tmp_path
    )
    tok = load_tokenizer(str(tmp_path))
    assert tok.pad_token == "<eos>"
    assert tok.pad_token_id == tok.eos_token_id


def test_load_tokenizer_without_pad_or_eos_fails(tmp_path: Path) -> None:
    PreTrainedTokenizerFast(tokenizer_object=_backend()).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="neither a pad nor an eos token"):
        load_tokenizer(str(tmp_path))


def test_a_model_folder_without_a_tokenizer_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ConfigError, match=r"model\.path=.*: no tokenizer loads from it"):
        load_tokenizer(str(tmp_path))


def unreadable_tokenizer(folder: Path) -> Path:
    """A tokenizer saved with a model type this tokenizers version does not know, as a newer
    version's file reads to an older one."""
    build_task_tokenizer().save_pretrained(folder)
    saved = json.loads((folder / "tokenizer.json").read_text())
    saved["model"]["type"] = "FutureModel"
    (folder / "tokenizer.json").write_text(json.dumps(saved))
    return folder


def test_a_tokenizer_file_the_library_cannot_read_is_one_line(tmp_path: Path) -> None:
    # tokenizers raises a bare Exception ("data did not match any variant of untagged enum
    # ModelWrapper"): a traceback.
    with pytest.raises(ConfigError, match=r"model\.path=.*: no tokenizer loads from it: .*variant"):
        load_tokenizer(str(unreadable_tokenizer(tmp_path)))
    with pytest.raises(ConfigError, match=r"reward\.model\.path=.*: no tokenizer loads from it"):
        load_reward_tokenizer(str(tmp_path))


@pytest.mark.parametrize("template", [5, {"default": None}])
def test_a_chat_template_that_is_no_text_is_one_line(tmp_path: Path, template: object) -> None:
    """A hand-edited tokenizer_config.json: with data.chat_template=true it failed at the
    first prompt as that prompt's fault ("prompts.jsonl:1: ... Can't compile non template
    nodes"); read by the reward model, at its first scoring."""
    build_task_tokenizer().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({**config, "chat_template": template})
    )
    for load, field in (
        (load_tokenizer, "model.path"),
        (load_reward_tokenizer, "reward.model.path"),
    ):
        with pytest.raises(ConfigError) as caught:
            load(str(tmp_path))
        assert str(caught.value).startswith(
            f"{field}={str(tmp_path)!r}: its tokenizer's chat_template is {template!r}, not a "
            "template's text (nor named texts); save"
        )


def test_encode_prompts_prepends_bos_only() -> None:
    tok = build_task_tokenizer()
    [ids] = encode_prompts(tok, ["7+8="])
    assert ids[0] == tok.bos_token_id
    assert tok.eos_token_id not in ids
    assert tok.decode(ids[1:]) == "7+8="
    assert encode_prompts(tok, []) == []


def test_encode_prompts_without_bos(tmp_path: Path) -> None:
    PreTrainedTokenizerFast(
        tokenizer_object=_backend(), pad_token="<pad>", eos_token="<eos>"
    ).save_pretrained(tmp_path)
    tok = load_tokenizer(str(tmp_path))
    assert tok.bos_token_id is None
    assert encode_prompts(tok, ["12"]) == [tok("12", add_special_tokens=False)["input_ids"]]


def test_response_text_shows_ids_past_the_tokenizer_as_unk() -> None:
    """A model with more rows than the tokenizer (model.vocab_size) may sample ids the
    tokenizer lacks: a reward reads each as <unk>, never as nothing (which would hide it)."""
    tokenizer = load_tokenizer(None, task="copy")
    one, two = tokenizer.convert_tokens_to_ids(["1", "2"])
    size = len(tokenizer)
    assert response_text(tokenizer, [one, size, two, size + 500]) == "1<unk>2<unk>"
    assert response_text(tokenizer, [size, tokenizer.eos_token_id]) == "<unk>"
    assert response_text(tokenizer, [one, two, tokenizer.eos_token_id]) == "12"


def test_response_text_ends_at_the_token_that_ended_it() -> None:
    """A response that stopped on one of the run's other end tokens (an instruct model's end
    of turn, ``models.generation_ends.response_stop_ids``) reads without it, as one ended by
    EOS does; one in the middle, which did not end it, is shown. Mutation: only EOS dropped."""
    tokenizer = load_tokenizer(None, task="copy")
    one, two, stop = tokenizer.convert_tokens_to_ids(["1", "2", "+"])
    assert response_text(tokenizer, [one, two, stop], stops=(stop,)) == "12"
    assert response_text(tokenizer, [one, stop, two], stops=(stop,)) == "1+2"
    assert response_text(tokenizer, [one, two, stop]) == "12+"


def test_which_texts_hold_a_special_tokens_text() -> None:
    """The texts a reward model or an environment's observation reads with a special
    token's text in them (read as its characters there), and none for a tokenizer without
    special tokens. Mutation: no special tokens searched as an empty pattern -> every text
    holds one."""
    tok = build_task_tokenizer()
    texts = ["12+3=15", "15<eos>", "<pad>", "", "<eo s>"]
    assert holds_special_text(tok, texts) == [False, True, True, False, False]
    without = SimpleNamespace(added_tokens_decoder={})  # a tokenizer with no special tokens
    assert holds_special_text(without, texts) == [False] * len(texts)  # type: ignore[arg-type]


def test_a_qwen2_folder_without_tokenizer_files_is_one_line(tmp_path: Path) -> None:
    # transformers builds an empty Qwen2Tokenizer (one special token) from a Qwen2 folder with
    # no tokenizer files, where it refuses a Llama one: the user who saved the model but not its
    # tokenizer was told "prompt is empty", or that the tokenizer "has no chat template".
    (tmp_path / "config.json").write_text('{"model_type": "qwen2"}')
    with pytest.raises(ConfigError, match=r"model\.path=.*: no tokenizer loads from it: .*only"):
        load_tokenizer(str(tmp_path))
    with pytest.raises(ConfigError, match=r"reward\.model\.path=.*: no tokenizer loads from it"):
        load_reward_tokenizer(str(tmp_path))
