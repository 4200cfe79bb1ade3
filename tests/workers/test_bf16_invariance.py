"""The invariance audit in bf16: bf16-mixed (fp32 master weights, fp32 accumulation and
reduction, bf16 products) passes at its tolerance under every layout; pure bf16 does not,
and neither does per-micro-batch normalization in bf16-mixed (real spawned gloo ranks)."""

import pytest

from verlite.audit.invariance import MICRO_LAYOUTS, check_invariance, tolerance_for
from verlite.config import load_config

MIXED = load_config("configs/ppo_tiny.yaml", ["model.precision=bf16-mixed"])
PURE = load_config("configs/ppo_tiny.yaml", ["model.precision=bf16"])


def test_both_are_held_to_one_tolerance() -> None:
    assert tolerance_for(MIXED) == tolerance_for(PURE) == 1e-2


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_bf16_mixed_updates_match_the_reference_under_every_layout(strategy: str) -> None:
    reports = check_invariance(MIXED, dps=[2], strategies=[strategy])
    assert len(reports) == len(MICRO_LAYOUTS) * 2
    failures = [r for r in reports if r.worst() > tolerance_for(MIXED)]
    assert not failures, failures
    # The fp32 master weights take the update exactly: parameters agree far more closely
    # than the bf16 gradients.
    assert max(r.max_rel_param_diff for r in reports) < 1e-4


def test_pure_bf16_fails_where_bf16_mixed_passes() -> None:
    reports = check_invariance(PURE, dps=[2], strategies=["ddp"], micros=["1", "2"])
    failures = [r for r in reports if r.worst() > tolerance_for(PURE)]
    assert failures, [r.worst() for r in reports]
    # Updates rounded to bf16 parameters differ by far more than fp32 master weights'.
    assert max(r.max_rel_param_diff for r in reports) > 1e-3


def test_per_micro_batch_normalization_fails_in_bf16_mixed() -> None:
    reports = check_invariance(
        MIXED, dps=[2], strategies=["ddp"], micros=["1", "packed-dynamic"], naive=True
    )
    assert all(r.worst() > tolerance_for(MIXED) for r in reports), reports
