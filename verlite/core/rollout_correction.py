"""Off-policy correction between the policy that sampled a batch and the one that trains on it.

With asynchronous training (or a sampler whose numerics differ from the trainer's) the tokens
were drawn by a *behaviour* policy (the sampler's own log-probs, ``rollout_log_probs``) while
the PPO ratio is taken against the *proximal* policy (the trainer's recompute,
``old_log_probs``). Truncated importance sampling (TIS; Yao et al. 2025, "Your efficient RL
framework secretly brings you off-policy RL training"; the decoupled PPO objective of AReaL)
weights each token's policy loss by ``min(pi_old / pi_rollout, cap)``: an unbiased correction
up to the truncation, whose cap bounds the variance.

The weights multiply the per-token loss matrix *before* ``agg_loss``
(``compute_policy_loss(importance_weights=...)``), so each token's loss is reweighted and then
normalized by the same global counts as always: a micro-batch, a rank or the whole mini-batch
sums the same weighted token losses, and the normalization contract is unchanged. Applying
them after aggregation (scaling a micro-batch's loss by its own mean weight) would make the
loss depend on how the batch was cut.
"""

from __future__ import annotations

import torch

from verlite.core.losses import LOG_RATIO_CLAMP
from verlite.core.masked import masked_mean


@torch.no_grad()
def truncated_is_weights(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    cap: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token ``min(exp(old_log_probs - rollout_log_probs), cap)``, 0 on padded positions,
    in ``old_log_probs``' dtype and without gradient; and its metrics over response tokens:
    the mean weight after truncation and the fraction of tokens whose weight was truncated.

    The log-ratio is computed in float64 and clamped to ``±LOG_RATIO_CLAMP`` so it never
    overflows.
    """
    if not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    mask = response_mask.bool()
    log_ratio = old_log_probs.double() - rollout_log_probs.double()
    raw = torch.exp(torch.clamp(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    weights = torch.where(mask, torch.clamp(raw, max=cap), torch.zeros_like(raw))
    metrics = {
        "actor/rollout_is_weight/mean": float(masked_mean(weights, mask)),
        "actor/rollout_is_clipfrac": float(masked_mean((raw > cap).double(), mask)),
    }
    return weights.to(old_log_probs.dtype), metrics
