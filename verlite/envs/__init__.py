"""Environments of multi-turn rollouts (``rollout.multi_turn.env``): what one is
(:mod:`verlite.envs.base`), the built-in lookup tool task, user classes by import path, and
the checked, time-bounded session a trajectory talks to."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from verlite.config import Config, ConfigError
from verlite.data.tokenizer import tokens_after_text
from verlite.envs.base import Environment, Turn
from verlite.envs.registry import ENVIRONMENTS, get_environment
from verlite.envs.session import (
    AbandonedCalls,
    EnvironmentBroken,
    Session,
    SessionThreads,
    ToolsStuck,
    open_sessions,
)


def turn_stop_id(cfg: Config, tokenizer: PreTrainedTokenizerBase) -> int:
    """The token of ``rollout.multi_turn.turn_stop``, which must be exactly one, and not one
    that ends the whole trajectory (the end-of-sequence token or a ``rollout.stop_token_ids``
    one): a turn that stops on it would never be followed by an observation. Its token as
    it ends a turn's text (:func:`~verlite.data.tokenizer.tokens_after_text`)."""
    stop = cfg.rollout.multi_turn.turn_stop
    assert stop is not None  # its callers have one
    ids = tokens_after_text(tokenizer, stop)
    if len(ids) != 1:
        raise ConfigError(
            f"rollout.multi_turn.turn_stop={stop!r} is {len(ids)} tokens of the model's "
            "tokenizer; a turn must end on one token"
        )
    token = int(ids[0])
    ends = {
        **({} if cfg.rollout.ignore_eos else {tokenizer.eos_token_id: "the end-of-sequence token"}),
        **{i: "in rollout.stop_token_ids" for i in cfg.rollout.stop_token_ids},
    }
    if token in ends:
        raise ConfigError(
            f"rollout.multi_turn.turn_stop={stop!r} is token {token}, {ends[token]}, which ends "
            "the whole trajectory: a turn that stops on it is never followed by an observation; "
            "choose a token that only ends a turn"
        )
    return token


__all__ = [
    "ENVIRONMENTS",
    "AbandonedCalls",
    "Environment",
    "EnvironmentBroken",
    "Session",
    "SessionThreads",
    "ToolsStuck",
    "Turn",
    "get_environment",
    "open_sessions",
    "turn_stop_id",
]
