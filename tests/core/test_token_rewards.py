"""Token-level reward placement and KL-in-reward."""

import pytest
import torch

from verlite.core.token_rewards import KLController, apply_kl_penalty, place_scores


def test_scores_land_on_the_last_valid_token() -> None:
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    out = place_scores(torch.tensor([0.5, 1.0, 0.7, 0.2]), mask)
    expected = torch.tensor([[0, 0, 0.5, 0], [1.0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0.2]])
    torch.testing.assert_close(out, expected)


def test_scores_land_on_the_policys_last_token_of_a_multi_turn_row() -> None:
    """Observation tokens (0 in the mask) between or after the policy's never take the score."""
    mask = torch.tensor([[1, 0, 0, 1, 1, 0], [1, 1, 0, 0, 0, 0], [0, 0, 1, 0, 1, 0]])
    out = place_scores(torch.tensor([0.5, 1.0, 0.7]), mask)
    expected = torch.zeros(3, 6)
    expected[0, 4], expected[1, 1], expected[2, 4] = 0.5, 1.0, 0.7
    torch.testing.assert_close(out, expected)


def test_kl_penalty_only_on_response_tokens() -> None:
    mask = torch.tensor([[1.0, 1, 0], [1, 0, 0]])
    scores = place_scores(torch.tensor([1.0, 0.0]), mask)
    kl = torch.tensor([[0.1, 0.3, 9.0], [0.2, 9.0, 9.0]])
    rewards, mean_kl = apply_kl_penalty(scores, kl, mask, coef=0.5)
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, 1 - 0.15, 0], [-0.1, 0, 0]]))
    assert mean_kl == pytest.approx((0.2 + 0.2) / 2)


def test_adaptive_controller_moves_towards_target_and_fixed_stays() -> None:
    fixed = KLController(0.1)
    fixed.update(10.0, 100)
    assert fixed.value == 0.1
    adaptive = KLController(0.1, adaptive=True, target_kl=0.1, horizon=100)
    adaptive.update(1.0, 100)  # far above target: +20 %
    assert adaptive.value == pytest.approx(0.12)
    adaptive.update(0.0, 50)  # below target: -20 % * 50/100
    assert adaptive.value == pytest.approx(0.12 * 0.9)


def test_a_resumed_controller_continues_the_adaptive_coefficient_not_a_fixed_one() -> None:
    """``Trainer.resume`` hands it the checkpoint's coefficient: the adaptive state goes on,
    a fixed coefficient is this run's config's (it set the saved one over a changed
    ``algorithm.kl_ctrl.kl_coef``, which the resume reported as changed)."""
    fixed = KLController(0.01)
    fixed.resume(0.001)
    assert fixed.value == 0.01
    adaptive = KLController(0.01, adaptive=True)
    adaptive.resume(0.0123)
    assert adaptive.value == 0.0123


def test_step_statistics() -> None:
    from verlite.core.step_stats import step_statistics

    mask = torch.tensor([[1.0, 1, 1], [1, 0, 0]])
    returns = torch.tensor([[1.0, 2, 3], [4, 9, 9]])
    stats = step_statistics(
        scores=torch.tensor([0.25, 0.75]),
        token_rewards=torch.tensor([[0, 0, 0.25], [0.75, 5, 5]]),
        advantages=torch.tensor([[1.0, -1, 2], [0.5, 99, 99]]),
        returns=returns,
        response_mask=mask,
        at_limit=mask.sum(-1) >= 3,
        values=returns.clone(),
    )
    assert stats["critic/score/mean"] == 0.5 and stats["critic/score/min"] == 0.25
    assert stats["critic/rewards/mean"] == pytest.approx(0.5)
    assert stats["critic/advantages/max"] == 2.0 and stats[
        "critic/advantages/mean"
    ] == pytest.approx(2.5 / 4)
    assert stats["critic/returns/mean"] == pytest.approx(2.5)
    assert stats["response_length/mean"] == 2.0 and stats["response_length/clip_ratio"] == 0.5
    assert stats["critic/vf_explained_var"] == pytest.approx(1.0)


def test_sampler_agreement_is_over_response_tokens_only() -> None:
    from verlite.core.step_stats import sampler_agreement

    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    old = torch.tensor([[-1.0, -2.0, 5.0], [-0.5, 9.0, 9.0]])
    sampled = torch.tensor([[-1.0, -2.5, 0.0], [-0.25, 0.0, 0.0]])
    stats = sampler_agreement(old, sampled, mask)
    assert stats == {"rollout/logprob_abs_diff": 0.25, "rollout/logprob_max_diff": 0.5}
    none = sampler_agreement(old, sampled, torch.zeros_like(mask))
    assert none == {"rollout/logprob_abs_diff": 0.0, "rollout/logprob_max_diff": 0.0}


def test_step_statistics_of_float64_scores_are_not_rounded_to_float32() -> None:
    # An fp64 run's scores are float64 (``precision.score_dtype``): their mean too, as the
    # rewards', advantages' and returns' means are in their dtype.
    from verlite.core.step_stats import step_statistics

    mask = torch.ones((2, 1), dtype=torch.float64)
    third = torch.full((2,), 1 / 3, dtype=torch.float64)
    stats = step_statistics(
        scores=third,
        token_rewards=third[:, None],
        advantages=third[:, None],
        returns=third[:, None],
        response_mask=mask,
        at_limit=torch.zeros(2, dtype=torch.bool),
    )
    assert stats["critic/score/mean"] == 1 / 3 == stats["critic/rewards/mean"]
