"""Masked reductions on low-precision inputs: reduced in float32, not in their own dtype."""

from __future__ import annotations

import pytest
import torch

from verlite.core.masked import masked_mean, masked_var, masked_whiten

LOW_PRECISION = [torch.float16, torch.bfloat16]


def _spread(dtype: torch.dtype, bound: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(2, 6) values spanning +-``bound`` (representable in ``dtype``), garbage off the mask."""
    values = torch.tensor(
        [[-bound, bound, 0.0, 1.0, 3.0, 65504.0], [-7.0, bound / 2, 2.0, -bound, 5.0, 0.0]]
    )
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[0, 5] = mask[1, 5] = False
    values[1, 5] = float("nan")
    return values.to(dtype), mask


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("bound", [300.0, 40000.0])
def test_low_precision_statistics_match_float64(dtype: torch.dtype, bound: float) -> None:
    # In float16 the squares past 256 overflowed: a variance of inf whitened +-300 to all
    # zeros, and shifting by the smallest value overflowed past +-32k into NaN.
    values, mask = _spread(dtype, bound)
    exact = values.double()

    whitened = masked_whiten(values, mask)
    assert whitened.dtype == dtype
    assert torch.isfinite(whitened).all()
    torch.testing.assert_close(whitened, masked_whiten(exact, mask).to(dtype))

    variance = masked_var(values, mask)
    assert variance.dtype == torch.float32  # 40000**2 does not fit in float16
    torch.testing.assert_close(variance.double(), masked_var(exact, mask), rtol=1e-6, atol=0)

    mean = masked_mean(values, mask, dim=-1)
    assert mean.dtype == dtype
    torch.testing.assert_close(mean, masked_mean(exact, mask, dim=-1).to(dtype))


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_low_precision_mean_of_a_long_row_does_not_overflow(dtype: torch.dtype) -> None:
    # 5000 tokens of 100: the float16 sum (500000) overflowed, so the mean was inf.
    values = torch.full((5000,), 100.0, dtype=dtype)
    assert masked_mean(values, torch.ones(5000)).item() == 100.0


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_low_precision_tied_batch_whitens_to_exactly_zero(dtype: torch.dtype) -> None:
    values = torch.full((3, 1000), 0.1, dtype=dtype)
    mask = torch.ones(3, 1000)
    mask[0, 7] = 0
    values[0, 7] = float("inf")
    assert torch.equal(masked_whiten(values, mask), torch.zeros_like(values))
    assert masked_var(values, mask).item() == 0.0
