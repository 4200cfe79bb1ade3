"""Masked reductions shared by losses, advantages and metrics.

Means, variances and whitening reduce low-precision floats (float16, bfloat16) in float32,
other tensors in their own dtype: in float16 a sum overflows past 65504 and a square past
256, so a mean, variance or whitening taken in it came out inf or NaN, or all zeros (a
variance of inf whitens by 0). ``masked_sum`` sums in the values' own dtype.
Means and whitened values are returned in the input's dtype, whose range holds them; a
variance stays in the dtype it was reduced in, as the square of a float16 spread need not
fit in float16.
"""

from __future__ import annotations

import torch


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is set; masked entries never propagate NaN/inf."""
    zeros = torch.zeros((), dtype=values.dtype, device=values.device)
    picked = torch.where(mask.bool(), values, zeros)
    return picked.sum() if dim is None else picked.sum(dim=dim)


def _is_low_precision(values: torch.Tensor) -> bool:
    return values.is_floating_point() and values.element_size() < 4


def _widened(values: torch.Tensor) -> torch.Tensor:
    """``values`` in the dtype the reductions here accumulate in (see the module's doc)."""
    return values.float() if _is_low_precision(values) else values


def _narrowed(result: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``result``, reduced from ``_widened(values)``, back in ``values``' dtype."""
    return result.to(values.dtype) if _is_low_precision(values) else result


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over the masked entries; 0 where nothing is selected (never NaN)."""
    wide = _widened(values)
    count = mask.to(wide.dtype).sum() if dim is None else mask.to(wide.dtype).sum(dim=dim)
    return _narrowed(masked_sum(wide, mask, dim) / count.clamp(min=1), values)


def _deviations(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values`` less the mean of the masked entries, both taken from the smallest masked
    entry: entries that tie then deviate by exactly 0. The mean of n equal values, summed
    and rounded, may miss them by an ulp, which whitening divides by ``sqrt(eps)``
    (``core.advantages._group_stats`` does the same per group)."""
    if values.numel() == 0:  # no entry to centre on (amin of an empty tensor raises)
        return values
    valid = mask.bool()
    inf = torch.full((), float("inf"), dtype=values.dtype, device=values.device)
    lowest = torch.where(valid, values, inf).amin()
    shifted = values - torch.where(valid.any(), lowest, torch.zeros_like(lowest))
    return shifted - masked_mean(shifted, mask)


def _variance(deviations: torch.Tensor, mask: torch.Tensor, unbiased: bool) -> torch.Tensor:
    count = mask.to(deviations.dtype).sum()
    denom = count - 1 if unbiased else count
    return masked_sum(deviations**2, mask) / denom.clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over the masked entries (Bessel-corrected when ``unbiased`` and count > 1);
    exactly 0 when they all tie."""
    return _variance(_deviations(_widened(values), mask), mask, unbiased)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Normalize the masked entries to zero mean and unit (unbiased) variance; masked-out
    entries become 0, and so do masked entries that all tie (not an ulp over ``sqrt(eps)``)."""
    deviations = _deviations(_widened(values), mask)
    whitened = deviations * torch.rsqrt(_variance(deviations, mask, unbiased=True) + eps)
    return _narrowed(torch.where(mask.bool(), whitened, torch.zeros_like(whitened)), values)
