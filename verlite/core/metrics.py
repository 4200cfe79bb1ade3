"""Metric values that know how to aggregate over micro-batches, DP ranks and mini-batches.

Every figure a worker reports is a :class:`Metric`: a value, a weight and an aggregation.
The aggregation says what happens at each of the three reduction stages, so that the
number shown on the driver means the same thing whatever the micro-batch size or the
number of data-parallel workers (docs/design.md, "The metric algebra"):

============== ================== ================= ===================
aggregation     micro-batches      DP ranks          mini-batches
============== ================== ================= ===================
loss            sum                mean              mean
count           sum                mean              sum
weighted_mean   weighted mean      weighted mean     weighted mean
mean            mean               mean              mean
sum             sum                sum               sum
min / max       min / max          min / max         min / max
============== ================== ================= ===================

``loss`` is for globally normalized losses: each micro-batch loss is already divided by
the global count and multiplied by ``dp_size`` (``agg_loss``), so summing the micro-batches
of one rank gives ``dp_size * S_rank / N`` and averaging over ranks gives ``S / N``, the loss
of the whole mini-batch. ``weighted_mean`` is for ratios such as clip fractions: the
weight is the number of tokens the ratio was measured on, so the reduced value is the
ratio over every token of the mini-batch. ``count`` is for events every rank sees alike,
such as an update skipped for a non-finite gradient norm (the norm is global): summed over
the updates of a step, not multiplied by the number of ranks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

import torch


class Agg(StrEnum):
    """How a metric combines; see the module docstring for the table."""

    LOSS = "loss"
    COUNT = "count"
    WEIGHTED_MEAN = "weighted_mean"
    MEAN = "mean"
    SUM = "sum"
    MIN = "min"
    MAX = "max"


class Stage(StrEnum):
    """The three places where metrics of one update are combined."""

    MICRO_BATCHES = "micro_batches"
    RANKS = "ranks"
    MINI_BATCHES = "mini_batches"


@dataclass(frozen=True)
class Metric:
    """One reported figure. ``value`` may be a 0-d tensor so hot loops avoid host syncs."""

    value: float | torch.Tensor
    agg: Agg = Agg.MEAN
    weight: float | torch.Tensor = 1.0

    @classmethod
    def loss(cls, value: float | torch.Tensor) -> Metric:
        return cls(_detach(value), Agg.LOSS)

    @classmethod
    def count(cls, value: float | torch.Tensor) -> Metric:
        return cls(_detach(value), Agg.COUNT)

    @classmethod
    def weighted_mean(cls, value: float | torch.Tensor, weight: float | torch.Tensor) -> Metric:
        return cls(_detach(value), Agg.WEIGHTED_MEAN, _detach(weight))

    @classmethod
    def mean(cls, value: float | torch.Tensor) -> Metric:
        return cls(_detach(value), Agg.MEAN)

    @classmethod
    def sum(cls, value: float | torch.Tensor) -> Metric:
        return cls(_detach(value), Agg.SUM)

    @classmethod
    def min(cls, value: float | torch.Tensor) -> Metric:
        return cls(_detach(value), Agg.MIN)

    @classmethod
    def max(cls, value: float | torch.Tensor) -> Metric:
        return cls(_detach(value), Agg.MAX)

    def to_float(self) -> Metric:
        """The same metric with plain Python numbers (cheap to send between processes)."""
        return Metric(float(self.value), self.agg, float(self.weight))


MetricDict = dict[str, Metric]


def _detach(value: float | torch.Tensor) -> float | torch.Tensor:
    return value.detach() if isinstance(value, torch.Tensor) else value


def reduce_metric(metrics: Sequence[Metric], stage: Stage) -> Metric:
    """Combine the values of one metric at one stage; all must share one aggregation."""
    if not metrics:
        raise ValueError("reduce_metric needs at least one metric")
    agg = metrics[0].agg
    if any(m.agg != agg for m in metrics):
        kinds = sorted({str(m.agg) for m in metrics})
        raise ValueError(f"cannot reduce one metric with mixed aggregations {kinds}")
    values = [m.value for m in metrics]
    if agg is Agg.WEIGHTED_MEAN:
        weight = _total(m.weight for m in metrics)
        weighted = _total(m.value * m.weight for m in metrics)
        # A ratio measured on no token contributes nothing; all-empty reduces to 0, not NaN.
        value = weighted / weight if float(weight) > 0 else weighted * 0.0
        return Metric(value, agg, weight)
    if (
        agg is Agg.SUM
        or (agg is Agg.LOSS and stage is Stage.MICRO_BATCHES)
        or (agg is Agg.COUNT and stage is not Stage.RANKS)
    ):
        return Metric(_total(values), agg)
    if agg in (Agg.MEAN, Agg.LOSS, Agg.COUNT):
        return Metric(_total(values) / len(values), agg)
    pick = min if agg is Agg.MIN else max
    return Metric(pick(values, key=float), agg)


def _total(values: Iterable[float | torch.Tensor]) -> float | torch.Tensor:
    total: float | torch.Tensor = 0.0
    for v in values:
        total = total + v
    return total


def reduce_metrics(parts: Sequence[Mapping[str, Metric]], stage: Stage) -> MetricDict:
    """Reduce a list of metric dicts key by key; a key missing from some parts uses the rest."""
    keys: dict[str, None] = {}
    for part in parts:
        keys.update(dict.fromkeys(part))
    return {k: reduce_metric([p[k] for p in parts if k in p], stage) for k in keys}


def to_floats(metrics: Mapping[str, Metric]) -> dict[str, float]:
    """Plain numbers for logging."""
    return {k: float(m.value) for k, m in metrics.items()}
