"""Masked reductions shared by losses, advantages and metrics."""

from __future__ import annotations

import torch


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is set; masked entries never propagate NaN/inf."""
    zeros = torch.zeros((), dtype=values.dtype, device=values.device)
    picked = torch.where(mask.bool(), values, zeros)
    return picked.sum() if dim is None else picked.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over the masked entries; 0 where nothing is selected (never NaN)."""
    count = mask.to(values.dtype).sum() if dim is None else mask.to(values.dtype).sum(dim=dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over the masked entries (Bessel-corrected when ``unbiased`` and count > 1)."""
    mean = masked_mean(values, mask)
    count = mask.to(values.dtype).sum()
    sq = masked_sum((values - mean) ** 2, mask)
    denom = count - 1 if unbiased else count
    return sq / denom.clamp(min=1)


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """Normalize the masked entries to zero mean and unit variance; masked-out entries become 0."""
    mean = masked_mean(values, mask)
    whitened = (values - mean) * torch.rsqrt(masked_var(values, mask) + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, torch.zeros_like(whitened))
