"""Per-step statistics of a rollout batch, named by the field's common conventions."""

from __future__ import annotations

import torch

from verlite.core.masked import masked_mean, masked_var


def step_statistics(
    *,
    scores: torch.Tensor,
    token_rewards: torch.Tensor,
    advantages: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    at_limit: torch.Tensor,
    values: torch.Tensor | None = None,
) -> dict[str, float]:
    """Scores and ``at_limit`` are per sequence (B,); the rest (B, R) response-aligned.

    ``response_length/*`` count the policy's tokens (``response_mask``); ``clip_ratio`` is
    the share of rows whose response area is full (``at_limit``): a response of the most
    tokens allowed, or a multi-turn trajectory whose turns and observations fill its room,
    whose policy tokens alone never reach the area's width.
    """
    mask = response_mask.to(torch.bool)
    lengths = response_mask.sum(-1).float()
    stats = {
        "critic/score/mean": scores.mean(),
        "critic/score/max": scores.max(),
        "critic/score/min": scores.min(),
        "critic/rewards/mean": (token_rewards * response_mask).sum(-1).mean(),
        "critic/advantages/mean": masked_mean(advantages, mask),
        "critic/advantages/max": advantages[mask].max() if mask.any() else torch.zeros(()),
        "critic/advantages/min": advantages[mask].min() if mask.any() else torch.zeros(()),
        "critic/returns/mean": masked_mean(returns, mask),
        "response_length/mean": lengths.mean(),
        "response_length/max": lengths.max(),
        "response_length/min": lengths.min(),
        "response_length/clip_ratio": at_limit.float().mean(),
    }
    if values is not None:
        stats["critic/values/mean"] = masked_mean(values, mask)
        # 1 - Var(returns - values) / Var(returns): 1 is a perfect critic, 0 predicts the mean.
        residual_var = masked_var(returns - values, mask)
        stats["critic/vf_explained_var"] = 1.0 - residual_var / (masked_var(returns, mask) + 1e-8)
    return {key: float(value) for key, value in stats.items()}


def sampler_agreement(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """How far the log-probs the trainer recomputes are from those the sampler drew the
    tokens with, over response tokens: the token mean and the largest absolute difference.

    Near float rounding when both run the same weights and the sampler kept the whole
    distribution; top-k or top-p (renormalized over what they keep), other weights or
    another engine show here.
    """
    mask = response_mask.to(torch.bool)
    diff = (old_log_probs.double() - rollout_log_probs.double()).abs()
    largest = diff[mask].max() if mask.any() else torch.zeros(())
    return {
        "rollout/logprob_abs_diff": float(masked_mean(diff, mask)),
        "rollout/logprob_max_diff": float(largest),
    }


def multi_turn_statistics(
    turns: torch.Tensor,
    cut_turns: torch.Tensor,
    tool_calls: torch.Tensor,
    observation_tokens: torch.Tensor,
    truncated: torch.Tensor,
    tool_error: torch.Tensor,
    abandoned_call: torch.Tensor,
) -> dict[str, float]:
    """The ``multiturn/`` metrics of a step's trajectories, from (B,) per-row outcomes: means
    per trajectory, the share of policy turns cut by a turn's limit, the share of
    trajectories cut short by ``max_turns`` or ``max_total_length``, the
    number of tool calls that raised or timed out, and of those that timed out (whose
    threads were left running)."""
    return {
        "multiturn/turns/mean": float(turns.float().mean()),
        "multiturn/turn_clip_ratio": float(cut_turns.sum() / turns.sum()),
        "multiturn/tool_calls/mean": float(tool_calls.float().mean()),
        "multiturn/observation_tokens/mean": float(observation_tokens.float().mean()),
        "multiturn/truncated": float(truncated.float().mean()),
        "multiturn/tool_errors": float(tool_error.float().sum()),
        "multiturn/abandoned_calls": float(abandoned_call.float().sum()),
    }
