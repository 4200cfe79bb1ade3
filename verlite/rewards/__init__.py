"""Rule-based rewards: a registry of ``fn(response, answer, prompt) -> float`` in [0, 1],
user functions by import path, and checked, time-bounded scoring of a batch."""

from verlite.rewards.registry import REWARDS, RewardFn, check_answers, get_reward, resolve_reward
from verlite.rewards.rules import digit_match, exact_match, gsm8k
from verlite.rewards.scoring import RewardError, score_responses

__all__ = [
    "REWARDS",
    "RewardError",
    "RewardFn",
    "check_answers",
    "digit_match",
    "exact_match",
    "get_reward",
    "gsm8k",
    "resolve_reward",
    "score_responses",
]
