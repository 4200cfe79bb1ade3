"""Advantage estimators (GAE, GRPO / Dr. GRPO, RLOO, REINFORCE++), registered by name.

Every estimator takes one :class:`AdvantageInputs` and returns ``(advantages, returns)``,
both (B, T) and zero outside ``response_mask``, so the trainer calls
``compute_advantages(name, inputs)`` whatever the algorithm. Estimators use the
fields they need and check that those are given. ``AdvantageInputs`` is the one place
their inputs are listed.

Conventions shared by all estimators:

- ``token_level_rewards``, ``values`` and ``response_mask`` are (B, T); responses are
  right-padded. A row's mask marks the policy's own tokens: a prefix of ones for a
  single-turn response (possibly empty), with holes for a multi-turn one, whose observation
  tokens (a tool's output, the environment's turn) are 0. Discounted sums and GAE run over
  the policy's tokens only, each one's successor being the next policy token, as if the
  holes were not there. The mask may have any dtype; nonzero means valid.
- ``index`` is a (B,) integer tensor of group ids: the n samples of one prompt share it.
- Everything is computed in the dtype of ``token_level_rewards`` (but whitening, which
  ``core.masked`` does in float32 for float16/bfloat16) and returned in it. Entries outside
  the mask are ignored, even when they hold NaN or inf.
- Nothing loops in Python over tokens or groups: discounted sums are one (T, T) matmul over
  each row's policy tokens moved to its front (one stable sort of the mask, a gather, and
  the scatter back), and group statistics use ``torch.unique`` + ``index_add``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from verlite.core.masked import masked_sum, masked_whiten

__all__ = [
    "ADV_ESTIMATORS",
    "ESTIMATORS_NEEDING_CRITIC",
    "ESTIMATOR_SETTINGS",
    "GROUP_BASELINES",
    "SETTINGS",
    "AdvantageFn",
    "AdvantageInputs",
    "compute_advantages",
    "register_advantage",
]


@dataclass(frozen=True)
class AdvantageInputs:
    """Everything an estimator may use; each reads the fields its algorithm needs."""

    token_level_rewards: torch.Tensor
    response_mask: torch.Tensor
    values: torch.Tensor | None = None  # the critic's, for GAE
    index: torch.Tensor | None = None  # group ids, for the group baselines
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std: bool = True  # GRPO; False is Dr. GRPO
    epsilon: float = 1e-6


AdvantageFn = Callable[[AdvantageInputs], tuple[torch.Tensor, torch.Tensor]]

ADV_ESTIMATORS: dict[str, AdvantageFn] = {}
# The estimators whose baseline is the mean of a prompt's rollout.n scores: a group whose
# scores are all equal has zero advantage (before any batch-wide whitening).
GROUP_BASELINES = ("grpo", "rloo", "reinforce_plus_plus_baseline")
ESTIMATORS_NEEDING_CRITIC: frozenset[str] = frozenset({"gae"})


# The settings of AdvantageInputs (algorithm.<name> in a run's config), and those each
# registered estimator reads: a run's config names the others as having no effect.
SETTINGS: frozenset[str] = frozenset({"gamma", "lam", "norm_adv_by_std"})
ESTIMATOR_SETTINGS: dict[str, frozenset[str]] = {}


def register_advantage(
    name: str, *, reads: frozenset[str] = SETTINGS
) -> Callable[[AdvantageFn], AdvantageFn]:
    """Register an estimator, a function of one :class:`AdvantageInputs`, under ``name``;
    ``reads``: which of the :data:`SETTINGS` it uses (all, unless it says)."""
    if not reads <= SETTINGS:
        raise ValueError(f"{name!r} reads {sorted(reads - SETTINGS)}: not among {sorted(SETTINGS)}")

    def decorator(fn: AdvantageFn) -> AdvantageFn:
        if name in ADV_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ADV_ESTIMATORS[name] = fn
        ESTIMATOR_SETTINGS[name] = reads
        return fn

    return decorator


def compute_advantages(name: str, inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the estimator registered as ``name``; returns ``(advantages, returns)``, (B, T)."""
    fn = ADV_ESTIMATORS.get(name)
    if fn is None:
        valid = ", ".join(sorted(ADV_ESTIMATORS))
        raise ValueError(f"unknown advantage estimator {name!r}; valid names: {valid}")
    return fn(inputs)


# --------------------------------------------------------------------------- helpers


def _checked(inputs: AdvantageInputs, estimator: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The token rewards and the response mask, once their shapes agree."""
    rewards, mask = inputs.token_level_rewards, inputs.response_mask
    if rewards.dim() != 2 or rewards.shape != mask.shape:
        raise ValueError(
            f"{estimator}: token_level_rewards {tuple(rewards.shape)} and "
            f"response_mask {tuple(mask.shape)} must be the same (B, T) shape"
        )
    return rewards, mask


def _require_values(inputs: AdvantageInputs, estimator: str) -> torch.Tensor:
    values, mask = inputs.values, inputs.response_mask
    if values is None:
        raise ValueError(f"{estimator}: `values` is required (critic value estimates, (B, T))")
    if values.shape != mask.shape:
        raise ValueError(
            f"{estimator}: values {tuple(values.shape)} must match "
            f"response_mask {tuple(mask.shape)}"
        )
    return values


def _require_index(inputs: AdvantageInputs, estimator: str) -> torch.Tensor:
    index, mask = inputs.index, inputs.response_mask
    if index is None:
        raise ValueError(f"{estimator}: `index` is required (group id per sequence, (B,))")
    if index.shape != mask.shape[:1]:
        raise ValueError(
            f"{estimator}: index {tuple(index.shape)} must be (B,) = {tuple(mask.shape[:1])}"
        )
    return index


def _zero_outside(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # torch.where rather than a multiply: 0 * NaN padding would still be NaN.
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


def _policy_tokens_first(mask: torch.Tensor) -> torch.Tensor:
    """Per row, the positions of its valid tokens in order, then the others: gathering a
    (B, T) tensor by it moves the policy's tokens to the front, closing the observation
    holes (and leaves a prefix mask as it is)."""
    return torch.argsort((~mask.bool()).to(torch.int8), dim=-1, stable=True)


def _restored(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """A tensor gathered by ``order`` put back at its positions."""
    return torch.empty_like(x).scatter_(-1, order, x)


def _discounted_reverse_cumsum(x: torch.Tensor, discount: float) -> torch.Tensor:
    """``y_t = sum_{s >= t} discount**(s - t) * x_s`` along the last dim of a (B, T) tensor.

    One matmul with the (T, T) matrix ``M[s, t] = discount**(s - t)`` for ``s >= t``.
    Powers are taken directly (not as ``discount**s / discount**t``), so nothing overflows
    or underflows to 0/0 for long T or small discounts; ``0**0 == 1`` keeps discount=0 exact.
    Costs O(T^2) memory for the matrix, negligible next to the (B, T, vocab) logits.
    """
    steps = x.shape[-1]
    pos = torch.arange(steps, device=x.device)
    lag = pos[:, None] - pos[None, :]  # s - t
    base = torch.tensor(discount, dtype=x.dtype, device=x.device)
    powers = torch.where(lag >= 0, base.pow(lag.clamp(min=0).to(x.dtype)), torch.zeros_like(base))
    return x @ powers


def _group_stats(
    scores: torch.Tensor, index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sequence (group size, score minus group mean, unbiased group std), gathered back
    to (B,).

    Deviations are taken from each group's smallest score before the mean is: a group whose
    scores tie then has deviations and std of exactly 0. Its mean taken directly (the sum
    over n, rounded) may miss the tied score by an ulp, and GRPO's division by a std of the
    same size turned that ulp into an advantage of order one for every row of the group.

    Groups of one sample get mean 0 and std 1: with no peers there is no baseline, so the
    score passes through unchanged (the convention of verl/OpenRLHF).
    """
    uniq, inverse = torch.unique(index, return_inverse=True)
    inverse = inverse.to(scores.device)
    n_groups = uniq.numel()
    zeros = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device)
    counts = zeros.index_add(0, inverse, torch.ones_like(scores))
    lowest = zeros.scatter_reduce(0, inverse, scores, "amin", include_self=False)
    shifted = scores - lowest[inverse]
    shifted_means = zeros.index_add(0, inverse, shifted) / counts.clamp(min=1)
    # Two-pass variance (sum of squared deviations), not E[x^2] - E[x]^2, which cancels badly.
    deviations = shifted - shifted_means[inverse]
    var = zeros.index_add(0, inverse, deviations**2) / (counts - 1).clamp(min=1)
    singleton = (counts <= 1)[inverse]
    deviations = torch.where(singleton, scores, deviations)
    stds = torch.where(singleton, torch.ones_like(scores), var.sqrt()[inverse])
    return counts[inverse], deviations, stds


def _sequence_scores(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    return masked_sum(token_level_rewards, response_mask, dim=-1)


def _broadcast(per_seq: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    return _zero_outside(per_seq[:, None].expand(response_mask.shape), response_mask)


# --------------------------------------------------------------------------- estimators


@register_advantage("gae", reads=frozenset({"gamma", "lam"}))
def gae(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2015, arXiv:1506.02438).

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` with ``V`` = 0 beyond the last valid token,
    ``A_t = sum_k (gamma * lam)**k * delta_{t+k}``, t + 1 and t + k counting policy tokens
    only (across observation holes), ``returns = A + V`` (the critic's target,
    not whitened), and ``advantages = masked_whiten(A, mask)`` over the whole batch.
    Uses ``values``; ignores ``index``, ``norm_adv_by_std`` and ``epsilon``.
    """
    token_level_rewards, response_mask = _checked(inputs, "gae")
    dtype = token_level_rewards.dtype
    values = _require_values(inputs, "gae")
    order = _policy_tokens_first(response_mask)
    mask = response_mask.gather(-1, order)  # a prefix mask: the policy's tokens in front
    rewards = _zero_outside(token_level_rewards.gather(-1, order), mask)
    vals = _zero_outside(values.to(dtype).gather(-1, order), mask)
    # With prefix masks and values zeroed outside them, shifting left by one gives the next
    # policy token's value, which is already 0 after the last: no bootstrap past the response.
    next_vals = torch.nn.functional.pad(vals[:, 1:], (0, 1))
    deltas = rewards + inputs.gamma * next_vals - vals
    adv = _zero_outside(_discounted_reverse_cumsum(deltas, inputs.gamma * inputs.lam), mask)
    adv, returns = _restored(adv, order), _restored(adv + vals, order)
    return masked_whiten(adv, response_mask), returns


@register_advantage("grpo", reads=frozenset({"norm_adv_by_std"}))
def grpo(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative outcome advantage: GRPO (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300).

    ``score_i = sum_t r_{i,t}`` over the mask; per group (same ``index``) ``mean`` and
    unbiased ``std`` (``torch.std`` semantics; a group of one gets mean 0, std 1).
    ``A_i = (score_i - mean) / (std + epsilon)``, or ``score_i - mean`` when
    ``norm_adv_by_std`` is False, which is Dr. GRPO (Liu et al. 2025, "Understanding
    R1-Zero-Like Training: A Critical Perspective", arXiv:2503.20783). ``A_i`` is broadcast
    over the valid tokens; ``returns = advantages``. Ignores ``values``, ``gamma``, ``lam``.
    """
    token_level_rewards, response_mask = _checked(inputs, "grpo")
    group = _require_index(inputs, "grpo")
    scores = _sequence_scores(token_level_rewards, response_mask)
    _, adv, std = _group_stats(scores, group)
    if inputs.norm_adv_by_std:
        adv = adv / (std + inputs.epsilon)
    advantages = _broadcast(adv, response_mask)
    return advantages, advantages


@register_advantage("rloo", reads=frozenset())
def rloo(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE Leave-One-Out (Ahmadian et al. 2024, "Back to Basics", arXiv:2402.14740).

    ``A_i = score_i - mean_{j != i} score_j`` over the other samples of the group, computed
    as ``(score_i - group_mean) * n/(n-1)``; a group of one keeps ``score_i``.
    Broadcast over the valid tokens; ``returns = advantages``. Uses only ``index``.
    """
    token_level_rewards, response_mask = _checked(inputs, "rloo")
    group = _require_index(inputs, "rloo")
    scores = _sequence_scores(token_level_rewards, response_mask)
    counts, deviations, _ = _group_stats(scores, group)
    scale = counts / (counts - 1).clamp(min=1)
    # _group_stats passes singletons' scores through; the scale must be 1 for them too.
    scale = torch.where(counts > 1, scale, torch.ones_like(scale))
    advantages = _broadcast(deviations * scale, response_mask)
    return advantages, advantages


@register_advantage("reinforce_plus_plus", reads=frozenset({"gamma"}))
def reinforce_plus_plus(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu et al. 2025, arXiv:2501.03262).

    ``G_t = sum_{s >= t} gamma**k(s, t) * r_s`` over the policy's tokens, k counting the
    policy tokens from t to s (the returns), and
    ``advantages = masked_whiten(G, mask)`` over the whole batch (global normalization
    in place of a critic or group baseline). Uses only ``gamma``.
    """
    token_level_rewards, response_mask = _checked(inputs, "reinforce_plus_plus")
    order = _policy_tokens_first(response_mask)
    mask = response_mask.gather(-1, order)
    rewards = _zero_outside(token_level_rewards.gather(-1, order), mask)
    returns = _zero_outside(_discounted_reverse_cumsum(rewards, inputs.gamma), mask)
    returns = _restored(returns, order)
    return masked_whiten(returns, response_mask), returns


@register_advantage("reinforce_plus_plus_baseline", reads=frozenset())
def reinforce_plus_plus_baseline(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group-mean baseline (Hu et al. 2025, arXiv:2501.03262).

    ``A_i = score_i - group_mean`` (a group of one has mean 0), broadcast over the valid
    tokens, then ``masked_whiten`` over the whole batch; ``returns = advantages``.
    Uses only ``index``. ``score_i`` sums the token rewards, a KL in them included, so each
    token carries the whole response's KL: verl's form, not OpenRLHF's (docs/design.md,
    "KL in the reward").
    """
    token_level_rewards, response_mask = _checked(inputs, "reinforce_plus_plus_baseline")
    group = _require_index(inputs, "reinforce_plus_plus_baseline")
    scores = _sequence_scores(token_level_rewards, response_mask)
    _, deviations, _ = _group_stats(scores, group)
    advantages = masked_whiten(_broadcast(deviations, response_mask), response_mask)
    return advantages, advantages
