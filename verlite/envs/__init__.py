"""Environments of multi-turn rollouts (``rollout.multi_turn.env``): what one is
(:mod:`verlite.envs.base`), the built-in lookup tool task, user classes by import path, and
the checked, time-bounded session a trajectory talks to."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from verlite.config import Config, ConfigError
from verlite.envs.base import Environment, Turn
from verlite.envs.registry import ENVIRONMENTS, get_environment
from verlite.envs.session import AbandonedCalls, EnvironmentBroken, Session, ToolsStuck


def turn_stop_id(cfg: Config, tokenizer: PreTrainedTokenizerBase) -> int:
    """The token of ``rollout.multi_turn.turn_stop``, which must be exactly one."""
    stop = cfg.rollout.multi_turn.turn_stop
    ids = tokenizer.encode(stop, add_special_tokens=False)
    if len(ids) != 1:
        raise ConfigError(
            f"rollout.multi_turn.turn_stop={stop!r} is {len(ids)} tokens of the model's "
            "tokenizer; a turn must end on one token"
        )
    return int(ids[0])


__all__ = [
    "ENVIRONMENTS",
    "AbandonedCalls",
    "Environment",
    "EnvironmentBroken",
    "Session",
    "ToolsStuck",
    "Turn",
    "get_environment",
    "turn_stop_id",
]
