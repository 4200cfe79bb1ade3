"""Rule-based rewards: a registry of ``fn(response, answer, prompt) -> float`` in [0, 1],
user functions by import path, and validated batch scoring."""

from verlite.rewards.registry import (
    REWARDS,
    RewardError,
    RewardFn,
    get_reward,
    resolve_reward,
    score_responses,
)
from verlite.rewards.rules import digit_match, exact_match, gsm8k

__all__ = [
    "REWARDS",
    "RewardError",
    "RewardFn",
    "digit_match",
    "exact_match",
    "get_reward",
    "gsm8k",
    "resolve_reward",
    "score_responses",
]
