"""``perf/max_memory_allocated_gb/<role>``: the most memory one rank of a role held during its
work of a step, reported with the metrics its update returns anyway.

On cuda, ``torch.cuda.max_memory_allocated`` since the role's first call of the step (the peak
is reset there): the tensors torch allocated, not what its caching allocator reserved. On CPU,
the worker process's peak resident set size (``ru_maxrss``), which never decreases: the most
the process has held since it started, not what this step took. The actor and critic report
it with their update's metrics (the actor, in the critic's warm-up steps, with
``skip_update``'s); a rollout or reward-model rank, whose calls return rows, in a
column of its rows (:func:`with_peak`) that the driver takes out (:func:`pop_peak`).
"""

from __future__ import annotations

import resource

import torch
from tensordict import TensorDict

from verlite.core.metrics import Metric

GB = 1e9


class PeakMemory:
    """The peak of one rank's device memory over its role's work in a step: :meth:`begin` at
    each call that may be its first of the step (the first one resets the peak),
    :meth:`metric` in the call that reports it (the next :meth:`begin` resets again)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._open = False

    def begin(self) -> None:
        if not self._open and self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._open = True

    def metric(self) -> Metric:
        """The peak in GB (10^9 bytes), reduced over ranks by their maximum."""
        self._open = False
        if self.device.type == "cuda":
            return Metric.max(torch.cuda.max_memory_allocated(self.device) / GB)
        # ru_maxrss is in kilobytes on Linux.
        return Metric.max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB)


# The column a worker that returns rows (a rollout or reward-model rank) carries its peak in:
# every row of its share holds it, and the driver takes it out of the batch (:func:`pop_peak`).
PEAK_COLUMN = "peak_memory_gb"


def with_peak(td: TensorDict, peak: PeakMemory) -> TensorDict:
    """``td`` (one rank's rows) with :data:`PEAK_COLUMN` set to ``peak``'s
    :meth:`~PeakMemory.metric`, in float64: the figure as measured, as the training roles
    report theirs (a column of torch's default float32 rounded it, by up to 4 KB of 80 GB)."""
    td[PEAK_COLUMN] = torch.full(td.batch_size, float(peak.metric().value), dtype=torch.float64)
    return td


def pop_peak(td: TensorDict) -> float:
    """The largest peak a rank put in ``td``'s :data:`PEAK_COLUMN`, which leaves ``td``."""
    peaks = td.pop(PEAK_COLUMN)
    # with_peak's column: a tensor, never a nested TensorDict
    assert isinstance(peaks, torch.Tensor)
    return float(peaks.max())
