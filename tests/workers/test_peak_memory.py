"""perf/max_memory_allocated_gb/<role>: the peak is reset at the role's first call of a step
(not again before it is reported), read in GB, and reduced over ranks by the maximum."""

from __future__ import annotations

import resource

import pytest
import torch
from tensordict import TensorDict

from verlite.core.metrics import Agg, Stage, reduce_metric
from verlite.workers.peak_memory import PeakMemory, pop_peak, with_peak


def test_on_cuda_the_peak_is_reset_once_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    resets: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", resets.append)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 3_500_000_000)
    peak = PeakMemory(torch.device("cuda", 0))
    peak.begin()  # the step's first call (generation) resets
    peak.begin()  # its log-probs and update do not
    metric = peak.metric()
    assert (metric.value, metric.agg) == (3.5, Agg.MAX)
    assert resets == [torch.device("cuda", 0)]
    peak.begin()  # the next step's first call resets again
    assert len(resets) == 2


def test_on_cpu_the_processs_peak_resident_memory() -> None:
    peak = PeakMemory(torch.device("cpu"))
    peak.begin()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    value = float(peak.metric().value)
    assert before <= value <= resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    assert value > 0.01  # a Python process with torch holds more than 10 MB


def test_the_ranks_largest_peak_is_the_roles() -> None:
    ranks = [PeakMemory(torch.device("cpu")).metric() for _ in range(2)]
    ranks[1] = type(ranks[1]).max(float(ranks[1].value) + 1.0)
    assert reduce_metric(ranks, Stage.RANKS).value == ranks[1].value


def test_a_peak_sent_in_rows_arrives_as_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rollout or reward-model rank sends its peak in a column of its rows (``with_peak``),
    which the driver takes out (``pop_peak``): the figure a training role would report, not
    rounded to float32 (71.23456789 GB arrived as 71.23456573, 2 KB off)."""
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 71_234_567_890)
    peak = PeakMemory(torch.device("cuda", 0))
    peak.begin()
    rows = with_peak(TensorDict({"x": torch.zeros(3)}, batch_size=[3]), peak)
    assert pop_peak(rows) == 71.23456789 and set(rows.keys()) == {"x"}
