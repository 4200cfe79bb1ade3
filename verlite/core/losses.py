"""Loss math: global loss aggregation, policy and value losses, KL penalties, entropy.

The one rule that makes losses independent of micro-batching and data parallelism lives
in :func:`agg_loss`. A worker counts the valid tokens and sequences of its DP-local
mini-batch, all-reduces the counts once and passes them, with ``dp_size``, into every
micro-batch loss as one :class:`GlobalCounts`:

* each micro-batch loss is its masked sum divided by the *global* count, so summing the
  micro-batch gradients (plain gradient accumulation, no ``1/grad_accum`` factor) gives the
  gradient of the rank's share of the global loss;
* DDP/FSDP *average* gradients over ranks; the ``* dp_size`` factor cancels that mean, so
  the synchronized gradient is the gradient of the loss over the whole global mini-batch.

Rows whose mask is all zero contribute nothing; the counts are clamped at one so an
all-masked batch yields a zero loss that still carries a gradient (never NaN).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from verlite.core.masked import masked_mean, masked_sum
from verlite.core.metrics import Metric, MetricDict

LOSS_AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


@dataclass(frozen=True)
class GlobalCounts:
    """What one global mini-batch is normalized by, counted once before it is split over
    data-parallel ranks and micro-batches, and handed to every :func:`agg_loss` of it.

    ``batch_num_tokens`` is the number of valid (loss-carrying) tokens and
    ``global_batch_size`` the number of sequences with at least one, both over the whole
    global mini-batch; ``dp_size`` is the number of ranks whose gradients are averaged.
    """

    dp_size: int
    batch_num_tokens: int
    global_batch_size: int

    def __post_init__(self) -> None:
        for name, least in (("dp_size", 1), ("batch_num_tokens", 0), ("global_batch_size", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an int >= {least}, got {value!r}")

    @classmethod
    def of(cls, loss_mask: torch.Tensor) -> GlobalCounts:
        """The counts of ``loss_mask`` as a whole mini-batch on one rank."""
        tokens, sequences = count_valid(loss_mask).tolist()
        return cls(dp_size=1, batch_num_tokens=tokens, global_batch_size=sequences)


def count_valid(loss_mask: torch.Tensor) -> torch.Tensor:
    """``[valid tokens, sequences with a valid token]`` of a (batch, tokens) mask, as one
    int64 tensor: a rank's part of the :class:`GlobalCounts`, summed over ranks in one
    all-reduce."""
    valid = loss_mask != 0
    return torch.stack([valid.sum(), valid.any(dim=-1).sum()]).to(torch.int64)


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    loss_agg_mode: str,
    counts: GlobalCounts | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Aggregate a (batch, tokens) loss matrix into this micro-batch's share of the global loss.

    ``counts`` are those of the global mini-batch this micro-batch belongs to. None counts
    ``loss_mask`` itself, which is right only when this call sees the whole mini-batch on
    a single rank.
    """
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(
            f"unknown loss_agg_mode {loss_agg_mode!r}; valid modes: {', '.join(LOSS_AGG_MODES)}"
        )
    counts = counts or GlobalCounts.of(loss_mask)
    mask = loss_mask.to(loss_mat.dtype)

    if loss_agg_mode == "token-sum":
        return masked_sum(loss_mat, mask) * counts.dp_size
    if loss_agg_mode == "token-mean":
        tokens = _at_least_one(counts.batch_num_tokens, loss_mat)
        return masked_sum(loss_mat, mask) / tokens * counts.dp_size

    if loss_agg_mode == "seq-mean-token-mean":
        seq_losses = masked_mean(loss_mat, mask, dim=-1)
    else:
        seq_losses = masked_sum(loss_mat, mask, dim=-1)
    seqs = _at_least_one(counts.global_batch_size, loss_mat)
    loss = seq_losses.sum() / seqs * counts.dp_size
    if loss_agg_mode == "seq-mean-token-sum-norm":
        if loss_scale_factor is None or loss_scale_factor <= 0:
            # The padded width of the micro-batch would make the loss depend on how the
            # batch was split; the caller must pass a constant (e.g. the max response length).
            raise ValueError(
                "loss_agg_mode 'seq-mean-token-sum-norm' needs a positive loss_scale_factor "
                f"(a constant such as the max response length), got {loss_scale_factor!r}"
            )
        loss = loss / loss_scale_factor
    return loss


def _at_least_one(count: int, like: torch.Tensor) -> torch.Tensor:
    """``count`` (at least 1) as a 0-d tensor of ``like``'s dtype on its device, filled there:
    ``torch.tensor`` would copy it from the host, and a GPU's copy waits for its queue."""
    return torch.full((), max(count, 1), dtype=like.dtype, device=like.device)


# --------------------------------------------------------------------------- policy loss


@dataclass(frozen=True)
class PolicyLossInputs:
    """What every policy loss is given; each reads the fields its objective needs."""

    old_log_prob: torch.Tensor
    log_prob: torch.Tensor
    advantages: torch.Tensor
    response_mask: torch.Tensor
    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_c: float


# The per-token loss matrix, and per-token boolean indicators for metrics.
PolicyLossFn = Callable[[PolicyLossInputs], tuple[torch.Tensor, dict[str, torch.Tensor]]]

POLICY_LOSSES: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    def register(fn: PolicyLossFn) -> PolicyLossFn:
        POLICY_LOSSES[name] = fn
        return fn

    return register


# exp(20) ~ 5e8: large enough never to clip a real ratio, small enough to stay finite.
LOG_RATIO_CLAMP = 20.0


@register_policy_loss("vanilla")
def _vanilla_policy_loss(x: PolicyLossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (Schulman 2017) with asymmetric ranges and dual-clip (Ye 2020).

    Dual-clip bounds the loss of negative-advantage tokens at ``-A * clip_ratio_c`` so a
    huge ratio on a bad action cannot dominate the update.
    """
    log_ratio = torch.clamp(x.log_prob - x.old_log_prob, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -x.advantages * ratio
    clipped = -x.advantages * torch.clamp(ratio, 1.0 - x.clip_ratio_low, 1.0 + x.clip_ratio_high)
    clip_loss = torch.maximum(unclipped, clipped)
    dual_bound = -x.advantages * x.clip_ratio_c
    negative = x.advantages < 0
    loss = torch.where(negative, torch.minimum(clip_loss, dual_bound), clip_loss)
    indicators = {
        "pg_clipfrac": clipped > unclipped,
        "pg_clipfrac_lower": (clip_loss > dual_bound) & negative,
    }
    return loss, indicators


@register_policy_loss("gspo")
def _gspo_policy_loss(x: PolicyLossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng 2025): clip a sequence-level ratio, the geometric mean of token ratios.

    The token-level form ``s_i * exp(logp_t - sg(logp_t))`` has the value of the sequence
    ratio and routes its gradient through every token. The paper pairs it with
    ``seq-mean-token-mean`` aggregation and much smaller clip ranges (3e-4 / 4e-4).
    """
    log_ratio = x.log_prob - x.old_log_prob
    seq_log_ratio = masked_mean(log_ratio, x.response_mask, dim=-1).detach().unsqueeze(-1)
    token_log_ratio = x.log_prob - x.log_prob.detach() + seq_log_ratio
    ratio = torch.exp(torch.clamp(token_log_ratio, max=10.0))
    unclipped = -x.advantages * ratio
    clipped = -x.advantages * torch.clamp(ratio, 1.0 - x.clip_ratio_low, 1.0 + x.clip_ratio_high)
    return torch.maximum(unclipped, clipped), {"pg_clipfrac": clipped > unclipped}


@register_policy_loss("reinforce")
def _reinforce_policy_loss(x: PolicyLossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Plain policy gradient ``-A * log pi``: no ratio, so it is exact only on-policy."""
    return -x.advantages * x.log_prob, {}


def compute_policy_loss(
    *,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_mode: str = "vanilla",
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str,
    counts: GlobalCounts | None = None,
    loss_scale_factor: float | None = None,
    importance_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, MetricDict]:
    """Policy-gradient loss of one micro-batch, globally normalized by :func:`agg_loss`.

    ``importance_weights`` (per token, e.g. ``core.rollout_correction.truncated_is_weights``)
    multiply the token losses *before* aggregation, so the global normalization is unchanged.

    Metrics are token-weighted means over the micro-batch (``pg_clipfrac``,
    ``pg_clipfrac_lower``, ``ppo_kl`` = mean of ``old_log_prob - log_prob``), so reducing
    them over micro-batches and ranks gives the figure over the whole mini-batch.
    """
    if loss_mode not in POLICY_LOSSES:
        raise ValueError(
            f"unknown policy loss_mode {loss_mode!r}; valid modes: {', '.join(sorted(POLICY_LOSSES))}"
        )
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1.0 for dual-clip PPO, got {clip_ratio_c}")
    loss_mat, indicators = POLICY_LOSSES[loss_mode](
        PolicyLossInputs(
            old_log_prob=old_log_prob,
            log_prob=log_prob,
            advantages=advantages,
            response_mask=response_mask,
            clip_ratio_low=clip_ratio_low,
            clip_ratio_high=clip_ratio_high,
            clip_ratio_c=clip_ratio_c,
        )
    )
    if importance_weights is not None:
        loss_mat = loss_mat * importance_weights
    loss = agg_loss(
        loss_mat,
        response_mask,
        loss_agg_mode=loss_agg_mode,
        counts=counts,
        loss_scale_factor=loss_scale_factor,
    )
    tokens = response_mask.sum()
    metrics = {
        name: Metric.weighted_mean(
            masked_mean(indicators[name].to(log_prob.dtype), response_mask), tokens
        )
        if name in indicators
        else Metric.weighted_mean(0.0, tokens)
        for name in ("pg_clipfrac", "pg_clipfrac_lower")
    }
    metrics["ppo_kl"] = Metric.weighted_mean(
        masked_mean(old_log_prob - log_prob, response_mask), tokens
    )
    return loss, metrics


# ---------------------------------------------------------------------------- value loss


def compute_value_loss(
    *,
    vpreds: torch.Tensor,
    values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str,
    counts: GlobalCounts | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, Metric]:
    """Clipped value loss ``0.5 * agg(max((v - R)^2, (clip(v, V±c) - R)^2))``.

    ``vpreds`` are the critic's current predictions, ``values`` the predictions made at
    rollout time (the clipping centre) and ``returns`` the regression targets. Returns the
    loss and the token-weighted fraction of tokens where the clipped term was chosen.
    """
    clipped_preds = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    unclipped_loss = (vpreds - returns) ** 2
    clipped_loss = (clipped_preds - returns) ** 2
    loss = 0.5 * agg_loss(
        torch.maximum(unclipped_loss, clipped_loss),
        response_mask,
        loss_agg_mode=loss_agg_mode,
        counts=counts,
        loss_scale_factor=loss_scale_factor,
    )
    clipfrac = masked_mean((clipped_loss > unclipped_loss).to(vpreds.dtype), response_mask)
    return loss, Metric.weighted_mean(clipfrac, response_mask.sum())


# ------------------------------------------------------------------- KL penalty, entropy

KL_KINDS = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, *, kind: str) -> torch.Tensor:
    """Per-token KL estimate between the policy and the reference (Schulman's k1/k2/k3).

    ``k1``/``kl``: log-ratio; ``abs``: its magnitude; ``k2``/``mse``: half its square;
    ``k3``/``low_var_kl``: ``exp(-x) + x - 1`` with ``x = logp - ref``, unbiased and
    non-negative, clamped to [-10, 10] for stability. A ``+`` suffix (``k3+``) keeps the
    value of the estimator but takes the gradient of ``k2``, whose gradient is the
    unbiased estimate of the KL gradient.
    """
    if kind.endswith("+"):
        value = kl_penalty(log_prob, ref_log_prob, kind=kind[:-1])
        k2 = kl_penalty(log_prob, ref_log_prob, kind="k2")
        return k2 - k2.detach() + value.detach()
    log_ratio = log_prob - ref_log_prob
    if kind in ("k1", "kl"):
        return log_ratio
    if kind == "abs":
        return log_ratio.abs()
    if kind in ("k2", "mse"):
        return 0.5 * log_ratio.square()
    if kind in ("k3", "low_var_kl"):
        neg = torch.clamp(-log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return torch.clamp(torch.exp(neg) - neg - 1.0, -10.0, 10.0)
    valid = ", ".join([*KL_KINDS, "any of these with a '+' suffix"])
    raise ValueError(f"unknown KL penalty kind {kind!r}; valid kinds: {valid}")


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution over the last dimension."""
    log_probs = torch.log_softmax(logits, dim=-1)
    return -(log_probs.exp() * log_probs).sum(dim=-1)


def log_probs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Log-probability of ``labels`` under ``logits`` without materializing a full log-softmax."""
    picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)
