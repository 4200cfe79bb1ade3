"""The engine's update stays exact when dynamic micro-batches group rows by length
(``cost="padded"``): the same float64 gradients, parameters and losses as the full batch,
for every loss_agg_mode, actor and critic.

The engine's planner calls ``partition_by_token_budget`` and
``count_token_budget_partitions``; the tests point both at the cost they compare.
"""

from collections.abc import Callable
from typing import Any

import pytest
import torch

import verlite.workers.engine as engine_module
from verlite.config import load_config
from verlite.core import batching
from verlite.core.losses import LOSS_AGG_MODES
from verlite.invariance import Case, compare, make_batch, run_case
from verlite.workers.engine import plan_micro_batches

CONFIG = load_config("configs/ppo_tiny.yaml", ["model.dtype=float64"])
TOLERANCE = 1e-9


def use_cost(patch: pytest.MonkeyPatch, cost: str) -> None:
    """Point the engine's planner at this token cost, whatever cost it asks for itself."""
    for name in ("partition_by_token_budget", "count_token_budget_partitions"):
        patch.setattr(engine_module, name, with_cost(getattr(batching, name), cost))


def with_cost(fn: Callable[..., Any], cost: str) -> Callable[..., Any]:
    return lambda *args, **kwargs: fn(*args, **{**kwargs, "cost": cost})


@pytest.fixture
def padded_cost(monkeypatch: pytest.MonkeyPatch) -> None:
    use_cost(monkeypatch, "padded")


@pytest.mark.usefixtures("padded_cost")
@pytest.mark.parametrize("role", ["actor", "critic"])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_padded_micro_batches_match_the_full_batch(role: str, mode: str) -> None:
    batch = make_batch(CONFIG)
    reference = run_case(CONFIG, Case(role, mode, "full"), batch, strategy="none")
    outcome = run_case(CONFIG, Case(role, mode, "dynamic"), batch, strategy="none")
    assert reference is not None and outcome is not None
    diffs = compare(outcome, reference)
    assert max(diffs.values()) <= TOLERANCE, diffs


def test_padded_grouping_differs_from_packed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The padded planner really regroups the audit batch (or the test above proves nothing)."""
    batch = make_batch(CONFIG)
    longest = CONFIG.data.max_prompt_length + CONFIG.rollout.max_response_length
    # The audit's dynamic layout: a budget of two longest rows.
    cfg = CONFIG.actor.model_copy(
        update={
            "strategy": "none",
            "use_dynamic_bsz": True,
            "max_token_len_per_worker": 2 * longest,
        }
    )
    plans = {}
    for cost in ("packed", "padded"):
        use_cost(monkeypatch, cost)
        plans[cost], _ = plan_micro_batches(batch, cfg=cfg, device=torch.device("cpu"))
    assert sorted(map(sorted, plans["padded"])) != sorted(map(sorted, plans["packed"]))
    lengths = batch["attention_mask"].sum(-1).tolist()
    assert all(batching.padded_cost(lengths, p) <= 2 * longest for p in plans["padded"])
