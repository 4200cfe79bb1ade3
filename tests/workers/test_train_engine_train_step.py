"""The production update path equals one process updating on the whole batch.

Unlike the invariance audit (one mini-batch, one update), this follows a step as the
trainer runs it: the driver's dispatch cuts the batch into DP shares of global mini-batches,
and every rank's ``train_step`` makes ``ppo_epochs=2`` passes with a KL loss and an entropy
bonus. The metrics reduced over ranks and the final parameters must equal those of a single
process, for DDP and FSDP2, fixed and token-budget micro-batches, on 2 and 4 ranks: ranks
holding unequal numbers of rows, and a rank whose whole share carries no loss. And the
update's cost: gradients are reduced across ranks once per update, on its last micro-batch.
"""

from __future__ import annotations

import itertools
from functools import partial
from typing import Any

import pytest
import torch
from tensordict import TensorDict
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

from verlite.audit.invariance import VOCAB_SIZE, make_batch
from verlite.config import load_config
from verlite.controller.dispatch import DpSplit, dispatch
from verlite.core.metrics import Stage, reduce_metrics, to_floats
from verlite.core.partition import dp_shares
from verlite.distributed import all_gather_object, full_state_dict, run_on_ranks
from verlite.models import build_policy, build_value_model
from verlite.step_batch import row_costs
from verlite.workers.objectives import ActorLossSettings, CriticLossSettings, ppo_loss, value_loss
from verlite.workers.train_engine import TrainEngine

CONFIG = load_config(
    "configs/ppo_tiny.yaml",
    ["model.precision=fp64", "actor.use_kl_loss=true", "actor.entropy_coeff=0.05"],
)
TOLERANCE = 1e-9


def _model(role: str) -> torch.nn.Module:
    build = build_policy if role == "actor" else build_value_model
    return build(CONFIG.model, vocab_size=VOCAB_SIZE, max_positions=64, seed=0)


def _step(
    rank: int,
    world: int,
    batch: TensorDict,
    role: str,
    strategy: str,
    micro: int | None,
    mini_batches: int,
) -> tuple[dict[str, float], dict[str, torch.Tensor]] | None:
    """One training step of this rank's share; rank 0 returns reduced metrics and parameters."""
    # The driver's own dispatch: this rank's share of the global mini-batches, (k, rows).
    (share,) = dispatch(DpSplit(mini_batches=mini_batches), world, (batch,), {}).args[rank]
    base = getattr(CONFIG, role)
    # Plain SGD without clipping: Adam and clipping would hide a wrong gradient
    # (docs/invariance-audit.md). Four steps at lr 0.5 amplified the layouts' 1e-16 rounding
    # to 1e-8 in fp64 (0.1: 6e-13), beyond what the comparison is for.
    optim = base.optim.model_copy(update={"name": "sgd", "grad_clip": None, "lr": 0.1})
    layout: dict[str, Any] = (
        {"use_dynamic_bsz": True, "max_token_len_per_worker": 24}
        if micro is None
        else {"use_dynamic_bsz": False, "micro_batch_size_per_worker": micro}
    )
    cfg = base.model_copy(update={"optim": optim, "strategy": strategy, "ppo_epochs": 2, **layout})
    engine = TrainEngine(_model(role), cfg=cfg, total_updates=10, metric_prefix=role)
    loss = (
        partial(ppo_loss, settings=ActorLossSettings.from_config(CONFIG.actor))
        if role == "actor"
        else partial(value_loss, settings=CriticLossSettings.from_config(CONFIG.critic))
    )
    metrics = engine.train_step(share, loss)
    reduced = to_floats(reduce_metrics(all_gather_object(metrics), Stage.RANKS))
    params = full_state_dict(engine.model)
    return (reduced, params) if rank == 0 else None


def _check_step_on_ranks(
    world: int,
    batch: TensorDict,
    role: str,
    strategy: str,
    micro: int | None,
    mini_batches: int = 2,
) -> None:
    """The step on ``world`` ranks equals the single-process step, which moved the weights."""
    torch.set_num_threads(1)
    reference = _step(0, 1, batch, role, "none", 8, mini_batches)
    assert reference is not None
    args = (batch, role, strategy, micro, mini_batches)
    _assert_same(run_on_ranks(_step, world_size=world, args=args, timeout_s=300)[0], reference)
    # the step really moved the weights: a no-op update would pass the comparison
    initial, ref_params = _model(role).state_dict(), reference[1]
    assert max(float((ref_params[k] - initial[k]).abs().max()) for k in ref_params) > 1e-4


def _assert_same(got: Any, reference: Any) -> None:
    (metrics, params), (ref_metrics, ref_params) = got, reference
    assert metrics.keys() == ref_metrics.keys()
    for key, value in ref_metrics.items():
        assert metrics[key] == pytest.approx(value, rel=TOLERANCE, abs=1e-12), key
    for name, tensor in ref_params.items():
        torch.testing.assert_close(params[name], tensor, rtol=TOLERANCE, atol=1e-12)


@pytest.mark.parametrize(
    ("role", "strategy", "micro"),
    [("actor", "ddp", 1), ("critic", "fsdp", 2)],
    ids=["actor-ddp-micro1", "critic-fsdp-micro2"],
)
def test_two_ranks_two_mini_batches_two_epochs_equal_one_process(
    role: str, strategy: str, micro: int | None
) -> None:
    _check_step_on_ranks(2, make_batch(CONFIG, num_sequences=16), role, strategy, micro)


@pytest.mark.parametrize(
    ("role", "strategy", "micro"),
    [("actor", "fsdp", None), ("critic", "ddp", None)],
    ids=["actor-fsdp-token_budget", "critic-ddp-token_budget"],
)
def test_four_ranks_with_unequal_loss_rows_and_a_silent_rank_equal_one_process(
    role: str, strategy: str, micro: int | None
) -> None:
    """Every rank holds 4 rows (2 of each global mini-batch; the config requires equal rows),
    but 4, 3, 2 and 0 of them carry loss: the last rank's whole share is masked."""
    batch = make_batch(CONFIG, num_sequences=16)
    shares = dp_shares(row_costs(batch), world=4, mini_batches=2)
    masked = [i for share, k in zip(shares, (0, 1, 2, 4), strict=True) for i in share[:k]]
    batch["response_mask"][torch.tensor(masked)] = 0
    carrying = [int(batch["response_mask"][share].any(dim=1).sum()) for share in shares]
    assert carrying == [4, 3, 2, 0]
    _check_step_on_ranks(4, batch, role, strategy, micro)


class _CountingReduceScatter(DefaultReduceScatter):
    """FSDP2's reduce-scatter of gradients, counted (torch has no public base class for
    ``set_custom_reduce_scatter`` yet: its default, from a private module)."""

    def __init__(self, counted: list[int]) -> None:
        self.counted = counted

    def __call__(self, *args, **kwargs):
        self.counted[0] += 1
        return super().__call__(*args, **kwargs)


def _reductions_by_micro_batch(rank: int, world: int, strategy: str) -> list[int]:
    """One update of 3 micro-batches on this rank: the gradient reductions (DDP bucket
    all-reduces, FSDP2 reduce-scatters) issued by the backward of each micro-batch."""
    (share,) = dispatch(
        DpSplit(mini_batches=1), world, (make_batch(CONFIG, num_sequences=12),), {}
    ).args[rank]
    cfg = CONFIG.actor.model_copy(update={"strategy": strategy, "micro_batch_size_per_worker": 2})
    engine = TrainEngine(_model("actor"), cfg=cfg, total_updates=1, metric_prefix="actor")
    counted = [0]
    if strategy == "ddp":

        def counting_allreduce(state, bucket):
            counted[0] += 1
            return allreduce_hook(state, bucket)

        engine.model.register_comm_hook(None, counting_allreduce)
    else:
        for module in engine.model.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_reduce_scatter(_CountingReduceScatter(counted))
    before_forward = []  # the reductions so far as each micro-batch's forward begins
    settings = ActorLossSettings.from_config(CONFIG.actor)

    def loss(model: torch.nn.Module, micro: TensorDict):
        before_forward.append(counted[0])
        return ppo_loss(model, micro, settings=settings)

    engine.train_mini_batch(share[0], loss)
    marks = [*before_forward, counted[0]]
    return [later - earlier for earlier, later in itertools.pairwise(marks)]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_an_update_reduces_gradients_once_on_its_last_micro_batch(strategy: str) -> None:
    """Syncing on every micro-batch gives the same gradients (the invariance tests cannot
    see it) at the number of micro-batches times the collectives."""
    torch.set_num_threads(1)
    by_rank = run_on_ranks(
        _reductions_by_micro_batch, world_size=2, args=(strategy,), timeout_s=300
    )
    # The last backward reduces: DDP one all-reduce per gradient bucket (however many its
    # bucket size makes), FSDP2 one reduce-scatter per sharded unit (each decoder block and
    # the root); the ones before, nothing.
    for reductions in by_rank:
        first, second, last = reductions
        assert (first, second) == (0, 0)
        if strategy == "fsdp":
            assert last == CONFIG.model.num_layers + 1
        else:
            assert last >= 1
