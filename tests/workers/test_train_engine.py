"""TrainEngine behaviour besides invariance: inference order, schedules, skips, rank agreement."""

import math
from typing import Any

import pytest
import torch

from verlite.audit.invariance import make_batch
from verlite.config import OptimConfig, load_config
from verlite.distributed import RankFailedError, run_on_ranks
from verlite.models import build_policy
from verlite.workers.forward import response_log_probs
from verlite.workers.train_engine import TrainEngine, lr_multiplier, plan_micro_batches

CONFIG = load_config("configs/ppo_tiny.yaml", ["model.precision=fp64"])


def policy() -> torch.nn.Module:
    return build_policy(CONFIG.model, vocab_size=64, max_positions=64, seed=0)


def log_probs_fn(model, td):
    log_probs, entropy = response_log_probs(model, td, temperature=1.0, entropy="loss")
    return {"log_probs": log_probs, "entropy": entropy, "row_id": td["uid"]}


def engine(**role_overrides) -> TrainEngine:
    cfg = CONFIG.actor.model_copy(update=role_overrides)
    return TrainEngine(policy(), cfg=cfg, total_updates=1, metric_prefix="actor")


def full_batch_reference(batch):
    """One forward over the whole untrimmed batch, zero on padding like the engine's outputs."""
    with torch.no_grad():
        out = log_probs_fn(policy(), batch)
    real = batch["attention_mask"][:, -batch["response_mask"].shape[1] :].bool()
    return {k: v.masked_fill(~real, 0) if v.dim() == 2 else v for k, v in out.items()}


@pytest.mark.parametrize(
    "overrides",
    [
        {"micro_batch_size_per_worker": 3},
        {"use_dynamic_bsz": True, "max_token_len_per_worker": 30},
    ],
    ids=["fixed", "dynamic"],
)
def test_infer_returns_rows_in_original_order(overrides) -> None:
    batch = make_batch(CONFIG)
    out = engine(**overrides).infer(batch, log_probs_fn)
    ref = full_batch_reference(batch)
    assert out["row_id"].tolist() == batch["uid"].tolist()
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(
        out["log_probs"][mask], ref["log_probs"][mask], rtol=1e-10, atol=1e-12
    )
    assert out["log_probs"].shape == batch["response_mask"].shape
    assert out["log_probs"][~batch["attention_mask"][:, -mask.shape[1] :].bool()].abs().max() == 0


def test_dynamic_batching_really_reorders_rows() -> None:
    batch = make_batch(CONFIG)
    eng = engine(use_dynamic_bsz=True, max_token_len_per_worker=30)
    plan = plan_micro_batches(batch, cfg=eng.cfg, device=eng.device, training=True)
    parts = plan.parts
    flat = [i for p in parts for i in p]
    assert plan.repeats == 0 and flat != sorted(flat) and sorted(flat) == list(range(len(flat)))
    lengths = batch["attention_mask"].sum(-1)
    assert all(int(lengths[p].sum()) <= 30 for p in parts)


def _infer_uneven_rows(rank: int, world: int, strategy: str, layout: dict[str, Any]):
    batch = make_batch(CONFIG)
    rows = slice(0, 7) if rank == 0 else slice(7, 9)
    eng = engine(strategy=strategy, **layout)
    out = eng.infer(batch[rows], log_probs_fn)
    return out["log_probs"], full_batch_reference(batch)["log_probs"][rows]


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
@pytest.mark.parametrize(
    "layout",
    [
        {"micro_batch_size_per_worker": 2},  # 4 micro-batches against 1
        # one row a micro-batch on rank 0 (7), more micro-batches than rank 1 has rows (2)
        {"use_dynamic_bsz": True, "max_token_len_per_worker": 12},
    ],
    ids=["fixed", "token_budget"],
)
def test_infer_with_uneven_rows_across_ranks(strategy: str, layout: dict[str, Any]) -> None:
    for got, ref in run_on_ranks(_infer_uneven_rows, world_size=2, args=(strategy, layout)):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)


def _train_uneven_rows(rank: int, world: int):
    batch = make_batch(CONFIG)
    rows = slice(0, 6) if rank == 0 else slice(6, 8)
    eng = engine(strategy="ddp", micro_batch_size_per_worker=2)
    eng.train_mini_batch(batch[rows], lambda model, td: (torch.zeros((), requires_grad=True), {}))


def test_training_refuses_ranks_with_different_micro_batch_counts() -> None:
    with pytest.raises(RankFailedError, match="this rank has 1 micro-batches but another has 3"):
        run_on_ranks(_train_uneven_rows, world_size=2)


def test_non_finite_gradient_skips_the_update() -> None:
    eng = engine()
    before = [p.detach().clone() for p in eng.model.parameters()]

    def nan_loss(model, td):
        log_probs, _ = response_log_probs(model, td, temperature=1.0, entropy="none")
        return log_probs.sum() * float("nan"), {}

    metrics = eng.train_mini_batch(make_batch(CONFIG), nan_loss)
    assert metrics["actor/skipped_updates"].value == 1.0
    assert math.isnan(metrics["actor/grad_norm"].value)
    assert all(torch.equal(a, b) for a, b in zip(before, eng.model.parameters(), strict=True))


def test_lr_schedule_warmup_then_cosine() -> None:
    optim = OptimConfig(lr=1.0, warmup_steps=2, schedule="cosine", min_lr_ratio=0.1)
    values = [lr_multiplier(s, optim=optim, total_updates=6) for s in range(7)]
    assert values[:2] == [0.5, 1.0]
    assert values[2] == pytest.approx(1.0)
    assert values[4] == pytest.approx(0.1 + 0.9 * 0.5)
    assert values[6] == pytest.approx(0.1)
    assert lr_multiplier(5, optim=OptimConfig(), total_updates=6) == 1.0


def test_strategy_none_refuses_several_ranks() -> None:
    with pytest.raises(RankFailedError, match="strategy 'none' cannot train on 2 ranks"):
        run_on_ranks(_engine_none, world_size=2)


def _engine_none(rank: int, world: int) -> None:
    engine(strategy="none")


def test_all_masked_mini_batch_is_skipped_and_counted() -> None:
    eng = engine()
    before = [p.detach().clone() for p in eng.model.parameters()]
    batch = make_batch(CONFIG)
    batch["response_mask"] = batch["response_mask"] * 0
    from functools import partial

    from verlite.workers.objectives import ActorLossSettings, ppo_loss

    metrics = eng.train_mini_batch(
        batch, partial(ppo_loss, settings=ActorLossSettings.from_config(CONFIG.actor))
    )
    assert metrics["actor/skipped_updates"].value == 1.0
    assert all(torch.equal(a, b) for a, b in zip(before, eng.model.parameters(), strict=True))
    assert eng.scheduler.last_epoch == 0


def test_nonfinite_streak_counts_consecutive_skips_and_resets() -> None:
    eng = engine()
    batch = make_batch(CONFIG)

    def loss(scale):
        def fn(model, td):
            log_probs, _ = response_log_probs(model, td, temperature=1.0, entropy="none")
            return log_probs.mean() * scale, {}

        return fn

    streaks = [
        eng.train_mini_batch(batch.clone(), loss(s))["actor/nonfinite_streak"].value
        for s in (float("nan"), float("inf"), 1.0, float("nan"))
    ]
    assert streaks == [1, 2, 0, 1]
