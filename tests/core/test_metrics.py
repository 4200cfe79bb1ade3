"""Metric reductions give whole-batch figures whatever the micro-batch and rank split."""

import pytest
import torch

from verlite.core.masked import masked_mean
from verlite.core.metrics import Agg, Metric, Stage, reduce_metric, reduce_metrics, to_floats


def reduce_layout(layout: list[list[dict[str, Metric]]]) -> dict[str, float]:
    per_rank = [reduce_metrics(micro, Stage.MICRO_BATCHES) for micro in layout]
    return to_floats(reduce_metrics(per_rank, Stage.RANKS))


def test_token_weighted_ratio_reduces_to_whole_batch_ratio() -> None:
    flags = torch.tensor([1.0, 0, 0, 1, 1, 0, 1, 1, 0])
    mask = torch.tensor([1.0, 1, 1, 1, 0, 1, 1, 1, 0])
    whole = masked_mean(flags, mask).item()

    def part(rows: slice) -> dict[str, Metric]:
        return {
            "clipfrac": Metric.weighted_mean(masked_mean(flags[rows], mask[rows]), mask[rows].sum())
        }

    layout = [[part(slice(0, 1)), part(slice(1, 5))], [part(slice(5, 8)), part(slice(8, 9))]]
    assert reduce_layout(layout)["clipfrac"] == pytest.approx(whole)


def test_globally_normalized_loss_sums_micro_batches_and_averages_ranks() -> None:
    token_losses = torch.arange(10, dtype=torch.float64)
    n, dp = token_losses.numel(), 2
    # each micro-batch loss is S_micro / N * dp_size, as agg_loss("token-mean") returns
    splits = [[slice(0, 2), slice(2, 3)], [slice(3, 10)]]
    layout = [
        [{"loss": Metric.loss(token_losses[s].sum() / n * dp)} for s in rank] for rank in splits
    ]
    assert reduce_layout(layout)["loss"] == pytest.approx(token_losses.mean().item())


def test_mini_batch_stage_averages_losses_and_sums_counts() -> None:
    parts = [
        {
            "loss": Metric.loss(1.0),
            "skipped": Metric.sum(1),
            "norm": Metric.max(3.0),
            "lr": Metric.mean(1.0),
        },
        {
            "loss": Metric.loss(3.0),
            "skipped": Metric.sum(0),
            "norm": Metric.max(2.0),
            "lr": Metric.mean(2.0),
        },
    ]
    out = to_floats(reduce_metrics(parts, Stage.MINI_BATCHES))
    assert out == {"loss": 2.0, "skipped": 1.0, "norm": 3.0, "lr": 1.5}


def test_min_max_sum_mean_at_every_stage() -> None:
    values = [3.0, -1.0, 2.0]
    for stage in Stage:
        assert reduce_metric([Metric.min(v) for v in values], stage).value == -1.0
        assert reduce_metric([Metric.max(v) for v in values], stage).value == 3.0
        assert reduce_metric([Metric.sum(v) for v in values], stage).value == 4.0
        assert reduce_metric([Metric.mean(v) for v in values], stage).value == pytest.approx(4 / 3)


def test_weighted_mean_over_no_tokens_is_zero_not_nan() -> None:
    empty = [Metric.weighted_mean(torch.tensor(0.0), torch.tensor(0.0))] * 2
    assert float(reduce_metric(empty, Stage.RANKS).value) == 0.0


def test_keys_missing_from_some_parts_and_mixed_aggregations() -> None:
    out = reduce_metrics(
        [{"a": Metric.sum(1)}, {"a": Metric.sum(2), "b": Metric.mean(5)}], Stage.RANKS
    )
    assert to_floats(out) == {"a": 3.0, "b": 5.0}
    with pytest.raises(ValueError, match="mixed aggregations"):
        reduce_metric([Metric.sum(1), Metric.mean(1)], Stage.RANKS)
    with pytest.raises(ValueError, match="at least one"):
        reduce_metric([], Stage.RANKS)


def test_tensor_values_are_detached_and_convert_to_floats() -> None:
    x = torch.tensor(2.0, requires_grad=True)
    m = Metric.loss(x * 3)
    assert not m.value.requires_grad
    assert m.to_float() == Metric(6.0, Agg.LOSS, 1.0)


def test_count_sums_updates_but_not_replicas() -> None:
    """A skipped update is seen by every rank: 2 ranks x 3 updates, one skipped, count 1."""
    per_rank = [
        reduce_metrics([{"skipped": Metric.count(s)} for s in (0, 1, 0)], Stage.MINI_BATCHES)
        for _ in range(2)
    ]
    assert to_floats(reduce_metrics(per_rank, Stage.RANKS)) == {"skipped": 1.0}
