"""The step's score from its reward sources: a weighted sum (``reward.combine``).

A source is anything that scores every response of a batch, in row order: ``fn`` (the
rule-based reward), ``model`` (the reward-model worker group), ``remote`` (a remote
verifier, ``rewards.remote``). The driver's scorer (``verlite.driver.scorer``) asks each source
that ``reward.combine`` names for its scores and hands them here as ``{source: scores}``;
which sources a config sets up, and the validation of the weights, live with the schema
(``RewardConfig.sources``). A new source joins by being scored and named, not by a change
here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class CombinedScores:
    """Each response's combined score, in row order, and the mean score of every source
    (``reward/<source>/mean``, logged with each step)."""

    scores: list[float]
    metrics: dict[str, float]


def combine_scores(
    scores: Mapping[str, Sequence[float]], weights: Mapping[str, float]
) -> CombinedScores:
    """``sum(weights[s] * scores[s][i] for s)`` for each response ``i``; every weighed source
    must be scored, each with one finite score per response."""
    if set(scores) != set(weights):
        raise ValueError(
            f"reward sources scored ({', '.join(sorted(scores))}) are not the sources weighed "
            f"({', '.join(sorted(weights))})"
        )
    rows = {len(values) for values in scores.values()}
    if len(rows) != 1:
        counts = ", ".join(f"{source} {len(values)}" for source, values in scores.items())
        raise ValueError(f"reward sources scored different numbers of responses: {counts}")
    (n,) = rows
    combined = [0.0] * n
    metrics: dict[str, float] = {}
    for source, values in scores.items():
        if not all(math.isfinite(v) for v in values):
            raise ValueError(f"reward source {source} gave a non-finite score")
        weight = weights[source]
        combined = [total + weight * value for total, value in zip(combined, values, strict=True)]
        metrics[f"reward/{source}/mean"] = math.fsum(values) / n if n else 0.0
    return CombinedScores(combined, metrics)
