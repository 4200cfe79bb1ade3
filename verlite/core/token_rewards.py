"""Token-level rewards: sequence scores placed on the policy's last response token, KL in the
reward."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verlite.core.masked import masked_mean


def place_scores(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(B,) sequence scores as (B, R) token scores: all on the last valid token of each row
    (the policy's last, also when observation tokens come after or between)."""
    valid = response_mask.bool()
    positions = torch.arange(valid.shape[-1], device=scores.device)
    last = torch.where(valid, positions, -1).amax(-1)
    token_scores = torch.zeros(response_mask.shape, dtype=scores.dtype, device=scores.device)
    has_tokens = last >= 0
    rows = torch.arange(len(scores), device=scores.device)[has_tokens]
    token_scores[rows, last[has_tokens]] = scores[has_tokens]
    return token_scores


@dataclass
class KLController:
    """The KL coefficient of the in-reward penalty: fixed, or adaptive (Ziegler et al. 2019).

    The adaptive rule moves the coefficient by at most 20 % of ``n_samples / horizon`` per
    update, towards the value that keeps the measured KL at ``target_kl``.
    """

    value: float
    adaptive: bool = False
    target_kl: float = 0.1
    horizon: int = 10000

    def resume(self, saved: float) -> None:
        """Continue from the coefficient a checkpoint saved: the adaptive controller's state.
        A fixed coefficient is the config's, which a resume may change (and is told it did)."""
        if self.adaptive:
            self.value = saved

    def update(self, current_kl: float, n_samples: int) -> None:
        if not self.adaptive:
            return
        error = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_samples / self.horizon


def apply_kl_penalty(
    token_scores: torch.Tensor, kl: torch.Tensor, response_mask: torch.Tensor, *, coef: float
) -> tuple[torch.Tensor, float]:
    """``rewards = scores - coef * kl`` on response tokens; returns them and the batch mean KL
    (mean over sequences of the per-sequence token mean, the figure the controller tracks)."""
    kl = kl * response_mask
    rewards = token_scores - coef * kl
    per_sequence = masked_mean(kl, response_mask, dim=-1)
    return rewards, float(per_sequence.mean())
