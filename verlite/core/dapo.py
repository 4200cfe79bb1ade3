"""DAPO's filters (Yu et al. 2025, "DAPO: an open-source LLM reinforcement learning system at
scale"): which groups of a step carry a learning signal, and the soft penalty on responses
that run into the length limit.

Dynamic sampling keeps the groups whose ``rollout.n`` scores are not all equal: under a group
baseline (GRPO, RLOO, Dr. GRPO) a tied group has zero advantage everywhere, so its tokens
carry no gradient and only dilute a token-mean loss. Overlong shaping lowers the score of a
response linearly over the last ``buffer`` tokens before the limit, so that a long answer is
told apart from a cut one without a cliff at the limit.
"""

from __future__ import annotations

import torch


def tied_groups(scores: torch.Tensor, n: int) -> torch.Tensor:
    """(G,) bool: whether each group's scores are all equal, for (G * n,) scores of groups of
    ``n`` consecutive rows (the step layout: prompt-major, ``n`` samples a prompt). A group of
    one response always ties."""
    if scores.ndim != 1 or scores.numel() % n:
        raise ValueError(f"expected (G * {n},) scores, got shape {tuple(scores.shape)}")
    grouped = scores.view(-1, n)
    return grouped.amax(-1) == grouped.amin(-1)


def chosen_groups(tied: torch.Tensor, need: int) -> tuple[list[int], int]:
    """The groups a step trains on, by index into ``tied`` (every draw's groups in draw
    order), in that order: the first ``need`` groups that are not tied; when there are fewer,
    all of those plus the first tied ones up to ``need`` (what a run without dynamic
    sampling would have trained on). Also how many tied groups topped it up."""
    varied = (~tied).nonzero().flatten().tolist()
    if len(varied) >= need:
        return varied[:need], 0
    filled = tied.nonzero().flatten().tolist()[: need - len(varied)]
    return sorted(varied + filled), len(filled)


def overlong_penalty(
    lengths: torch.Tensor, *, limit: int, buffer: int, factor: float, dtype: torch.dtype
) -> torch.Tensor:
    """DAPO's soft overlong punishment of responses of ``lengths`` tokens, with ``limit`` the
    most a response may have: 0 up to ``limit - buffer`` tokens, then falling linearly to
    ``-factor`` at the limit (``-factor * (length - (limit - buffer)) / buffer``), in
    ``dtype`` (the scores' it is added to)."""
    if not 0 < buffer <= limit:
        raise ValueError(f"the overlong buffer must be in [1, {limit}], got {buffer}")
    excess = (lengths.to(dtype) - (limit - buffer)).clamp(min=0.0)
    return -factor * excess / buffer
