"""Truncated importance weights: worked values, truncation, pads, overflow, and how the
policy loss folds them in (before aggregation; weights of one change nothing)."""

import math

import pytest
import torch

from verlite.core.losses import LOSS_AGG_MODES, POLICY_LOSSES, agg_loss, compute_policy_loss
from verlite.core.rollout_correction import truncated_is_weights

CAP = 2.0
# old - rollout per token: exact, truncated (3 > 2), below one, overflowing (exp(1000));
# 1.5, underflowing, then two pads holding garbage that must not leak.
LOG_RATIO = [[0.0, math.log(3.0), -math.log(2.0), 1000.0], [math.log(1.5), -1000.0, 0.0, 0.0]]
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    rollout = torch.tensor([[-1.0, -2.0, -0.5, -1000.0], [-3.0, -1.0, float("nan"), -math.inf]])
    old = rollout + torch.tensor(LOG_RATIO)
    old[1, 2:] = torch.tensor([math.inf, 7.0])
    return old.requires_grad_(), rollout


def test_weights_and_metrics_match_a_hand_computation() -> None:
    old, rollout = _inputs()
    weights, metrics = truncated_is_weights(old, rollout, MASK, cap=CAP)
    expected = torch.tensor([[1.0, 2.0, 0.5, 2.0], [1.5, math.exp(-20.0), 0.0, 0.0]])
    torch.testing.assert_close(weights, expected, rtol=1e-6, atol=0)
    assert weights.dtype == torch.float32 and not weights.requires_grad
    assert metrics == {
        "actor/rollout_is_weight/mean": pytest.approx((1 + 2 + 0.5 + 2 + 1.5 + math.exp(-20)) / 6),
        "actor/rollout_is_clipfrac": pytest.approx(2 / 6),
    }


def test_no_overflow_and_pads_are_zero() -> None:
    old, rollout = _inputs()
    weights, metrics = truncated_is_weights(old, rollout, MASK, cap=1e30)
    assert torch.isfinite(weights).all()
    assert weights[0, 3].item() == pytest.approx(math.exp(20.0), rel=1e-6)  # clamped log-ratio
    assert weights[1, 2:].tolist() == [0.0, 0.0]
    assert all(math.isfinite(value) for value in metrics.values())
    assert metrics["actor/rollout_is_clipfrac"] == 0.0


def test_float64_inputs_and_an_all_masked_batch() -> None:
    old = torch.tensor([[0.3, -0.2]], dtype=torch.float64)
    weights, metrics = truncated_is_weights(old, torch.zeros_like(old), torch.zeros(1, 2), cap=CAP)
    assert weights.dtype == torch.float64 and weights.tolist() == [[0.0, 0.0]]
    assert metrics == {"actor/rollout_is_weight/mean": 0.0, "actor/rollout_is_clipfrac": 0.0}


@pytest.mark.parametrize("cap", [0.0, -1.0, math.nan])
def test_cap_must_be_positive(cap: float) -> None:
    old, rollout = _inputs()
    with pytest.raises(ValueError, match="cap must be > 0"):
        truncated_is_weights(old, rollout, MASK, cap=cap)


# ------------------------------------------------------------- folded into the policy loss


def _policy_inputs() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(3, 5, dtype=torch.float32, generator=gen)
    return {
        "old_log_prob": old,
        "log_prob": (old + 0.3 * torch.randn(3, 5, generator=gen)).requires_grad_(),
        "advantages": torch.randn(3, 5, generator=gen),
        "response_mask": torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]]),
    }


@pytest.mark.parametrize("loss_mode", sorted(POLICY_LOSSES))
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_weights_of_one_are_bit_identical_to_none(loss_mode: str, mode: str) -> None:
    x = _policy_inputs()
    agg = {"loss_mode": loss_mode, "loss_agg_mode": mode, "loss_scale_factor": 5.0}
    results = []
    for weights in (None, torch.ones(3, 5)):
        loss, metrics = compute_policy_loss(**x, importance_weights=weights, **agg)
        (grad,) = torch.autograd.grad(loss, x["log_prob"])
        results.append((loss, grad, {k: float(m.value) for k, m in metrics.items()}))
    (loss, grad, metrics), (w_loss, w_grad, w_metrics) = results
    assert torch.equal(w_loss, loss) and torch.equal(w_grad, grad)
    assert w_metrics == metrics


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_weights_multiply_token_losses_before_aggregation(mode: str) -> None:
    x = _policy_inputs()
    weights = torch.rand(3, 5, generator=torch.Generator().manual_seed(1)) * 2
    agg = {"loss_agg_mode": mode, "loss_scale_factor": 5.0}
    loss, _ = compute_policy_loss(**x, loss_mode="reinforce", importance_weights=weights, **agg)
    token_losses = -x["advantages"] * x["log_prob"]
    expected = agg_loss(token_losses * weights, x["response_mask"], **agg)
    torch.testing.assert_close(loss, expected, rtol=0, atol=0)
