"""The tokens that end a response: a model folder's own end tokens (its generation config's
``eos_token_id``), the run's stop tokens beside EOS, and the generation config an export
writes so that Hugging Face ``generate`` ends a response where verlite's sampler did."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from torch import nn
from transformers import GenerationConfig, PreTrainedTokenizerBase

from verlite.config import Config, ConfigError
from verlite.errors import one_line, shown
from verlite.models import model_config
from verlite.user_files import read_text


def mark_generation_ends(model: nn.Module, end_token_ids: Sequence[int], pad_token_id: int) -> None:
    """Have the generation config of ``model`` (a causal LM, or a peft model over one), which
    Hugging Face ``generate`` reads from an export's ``generation_config.json``, end a response
    where verlite's sampler ended it: ``end_token_ids`` (the tokenizer's EOS, then
    ``rollout.stop_token_ids``) added to its ``eos_token_id`` after the ids it has (a model
    folder's own, e.g. an instruct model's end of turn), and ``pad_token_id`` when it has none."""
    config = model.generation_config  # a peft model's attribute is its base model's
    assert isinstance(config, GenerationConfig)  # what every causal LM holds
    present = config.eos_token_id
    ids = [] if present is None else [present] if isinstance(present, int) else list(present)
    ids += [i for i in dict.fromkeys(end_token_ids) if i not in ids]
    config.eos_token_id = ids[0] if len(ids) == 1 else ids
    if config.pad_token_id is None:
        config.pad_token_id = pad_token_id


def generation_end_ids(path: str | None) -> tuple[int, ...]:
    """The tokens that end generation in the model folder ``path`` (none for the built-in
    model): its ``generation_config.json``'s ``eos_token_id``, or ``config.json``'s without
    one, as Hugging Face ``generate`` and vLLM read them. An instruct model names its end of
    turn there when its tokenizer's EOS is another token (Gemma 2's ``<end_of_turn>`` beside
    ``<eos>``, Phi-3's ``<|end|>`` beside ``<|endoftext|>``). A generation_config.json that
    does not load, or an ``eos_token_id`` that is no token id nor a list of them, is one
    line naming the file (checked at start-up, before Ray: ``driver.preflight``)."""
    if path is None:
        return ()
    file = Path(path, "generation_config.json")
    if file.is_file():
        config = _generation_config(path, file)
    else:
        config = GenerationConfig.from_model_config(model_config(path))
        file = Path(path, "config.json")
    ids = config.eos_token_id
    listed = [ids] if isinstance(ids, int) else ids
    if ids is not None and not (
        isinstance(listed, list) and all(type(i) is int and i >= 0 for i in listed)
    ):
        raise ConfigError(
            f"model.path={path!r}: its {file.name} has eos_token_id={ids!r}; expected a token "
            "id (an integer >= 0) or a list of them"
        )
    return () if ids is None else tuple(listed)


def _generation_config(path: str, file: Path) -> GenerationConfig:
    """The generation config in ``file``, model.path's generation_config.json: one line where
    it is no JSON object or Hugging Face does not load it."""
    text = read_text(file, what="model.path's generation_config.json", error=ConfigError)
    named = f"model.path={path!r}: its generation_config.json"
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{named} is not valid JSON ({exc})") from None
    if not isinstance(fields, dict):
        raise ConfigError(f"{named} holds {type(fields).__name__}, not a JSON object")
    try:
        return GenerationConfig.from_dict(fields)
    except Exception as exc:  # its checks raise ValueError or TypeError
        raise ConfigError(f"{named} does not load: {shown(one_line(exc), 160)}") from None


def response_stop_ids(cfg: Config, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """The tokens besides ``tokenizer``'s EOS that end a response: ``model.path``'s own end
    tokens (:func:`generation_end_ids`; with ``rollout.ignore_eos`` none, as the EOS they
    are), less ``rollout.multi_turn.turn_stop``'s token, which ends a turn only (Gemma-2-it's
    <end_of_turn> handing a turn to the environment), then ``rollout.stop_token_ids``."""
    own = () if cfg.rollout.ignore_eos else generation_end_ids(cfg.model.path)
    turn_stop = cfg.rollout.multi_turn.turn_stop
    turn = [] if turn_stop is None else tokenizer.encode(turn_stop, add_special_tokens=False)
    kept = [i for i in own if i != tokenizer.eos_token_id and [i] != turn]
    return tuple(dict.fromkeys([*kept, *cfg.rollout.stop_token_ids]))
