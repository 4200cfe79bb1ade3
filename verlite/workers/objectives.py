"""The actor and critic losses of one micro-batch, globally normalized.

Both read the :class:`~verlite.core.losses.GlobalCounts` from the TensorDict, where the
engine stamped them once per mini-batch (``verlite.step_batch.read_counts``); settings that do not
change between batches (clip ranges, coefficients) come from a small frozen dataclass.
Every term goes through ``agg_loss`` with the same counts, so the sum of the terms keeps
the invariance of each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import TensorDict
from torch import nn

from verlite.config import ActorConfig, CriticConfig
from verlite.core.losses import (
    GlobalCounts,
    agg_loss,
    compute_policy_loss,
    compute_value_loss,
    kl_penalty,
)
from verlite.core.masked import masked_mean
from verlite.core.metrics import Metric, MetricDict
from verlite.step_batch import read_counts
from verlite.workers.forward import response_log_probs, response_values


@dataclass(frozen=True)
class AggSettings:
    """How a role aggregates token losses (``agg_loss``'s settings besides the counts)."""

    loss_agg_mode: str
    loss_scale_factor: float | None

    def apply(
        self, loss_mat: torch.Tensor, mask: torch.Tensor, counts: GlobalCounts
    ) -> torch.Tensor:
        return agg_loss(
            loss_mat,
            mask,
            loss_agg_mode=self.loss_agg_mode,
            counts=counts,
            loss_scale_factor=self.loss_scale_factor,
        )


@dataclass(frozen=True)
class ActorLossSettings:
    agg: AggSettings
    policy_loss: str
    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_c: float
    entropy_coeff: float
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: str

    @classmethod
    def from_config(cls, cfg: ActorConfig) -> ActorLossSettings:
        return cls(
            agg=AggSettings(cfg.loss_agg_mode, cfg.loss_scale_factor),
            policy_loss=cfg.policy_loss,
            clip_ratio_low=cfg.clip_ratio_low,
            clip_ratio_high=cfg.clip_ratio_high,
            clip_ratio_c=cfg.clip_ratio_c,
            entropy_coeff=cfg.entropy_coeff,
            use_kl_loss=cfg.use_kl_loss,
            kl_loss_coef=cfg.kl_loss_coef,
            kl_loss_type=cfg.kl_loss_type,
        )


@dataclass(frozen=True)
class CriticLossSettings:
    agg: AggSettings
    cliprange_value: float

    @classmethod
    def from_config(cls, cfg: CriticConfig) -> CriticLossSettings:
        assert cfg.loss_agg_mode is not None, "the config fills critic.loss_agg_mode from the actor"
        return cls(AggSettings(cfg.loss_agg_mode, cfg.loss_scale_factor), cfg.cliprange_value)


def ppo_loss(
    model: nn.Module, td: TensorDict, settings: ActorLossSettings
) -> tuple[torch.Tensor, MetricDict]:
    """Policy loss - entropy bonus + KL loss to the reference, each term globally normalized."""
    mask, counts, agg = td["response_mask"], read_counts(td), settings.agg
    # The entropy is always a metric; its backward runs only when the loss weighs it in (over
    # the vocabulary at every response token: the gradients are the same bit for bit).
    log_probs, entropy = response_log_probs(
        model,
        td,
        temperature=float(td.get_non_tensor("temperature")),
        entropy="loss" if settings.entropy_coeff != 0 else "metric",
    )
    assert entropy is not None
    pg_loss, pg_metrics = compute_policy_loss(
        old_log_prob=td["old_log_probs"],
        log_prob=log_probs,
        advantages=td["advantages"],
        response_mask=mask,
        loss_mode=settings.policy_loss,
        clip_ratio_low=settings.clip_ratio_low,
        clip_ratio_high=settings.clip_ratio_high,
        clip_ratio_c=settings.clip_ratio_c,
        loss_agg_mode=agg.loss_agg_mode,
        counts=counts,
        loss_scale_factor=agg.loss_scale_factor,
        importance_weights=td.get("rollout_is_weights", None),
    )
    entropy_loss = agg.apply(entropy, mask, counts)
    loss = pg_loss - settings.entropy_coeff * entropy_loss
    metrics = {
        "actor/pg_loss": Metric.loss(pg_loss),
        "actor/entropy": Metric.loss(entropy_loss),
        **{f"actor/{name}": metric for name, metric in pg_metrics.items()},
    }
    if settings.use_kl_loss:
        kl = kl_penalty(log_probs, td["ref_log_prob"], kind=settings.kl_loss_type)
        kl_loss = agg.apply(kl, mask, counts)
        loss = loss + settings.kl_loss_coef * kl_loss
        metrics["actor/kl_loss"] = Metric.loss(kl_loss)
    metrics["actor/loss"] = Metric.loss(loss)
    return loss, metrics


def value_loss(
    model: nn.Module, td: TensorDict, settings: CriticLossSettings
) -> tuple[torch.Tensor, MetricDict]:
    """Clipped value regression to the returns, globally normalized like the actor loss."""
    mask = td["response_mask"]
    vpreds = response_values(model, td)
    loss, clipfrac = compute_value_loss(
        vpreds=vpreds,
        values=td["values"],
        returns=td["returns"],
        response_mask=mask,
        cliprange_value=settings.cliprange_value,
        loss_agg_mode=settings.agg.loss_agg_mode,
        counts=read_counts(td),
        loss_scale_factor=settings.agg.loss_scale_factor,
    )
    metrics = {
        "critic/vf_loss": Metric.loss(loss),
        "critic/vf_clipfrac": clipfrac,
        "critic/vpred_mean": Metric.weighted_mean(masked_mean(vpreds, mask), mask.sum()),
    }
    return loss, metrics
