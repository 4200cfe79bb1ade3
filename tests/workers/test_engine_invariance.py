"""The engine's update equals the single-process full-batch update under every layout.

Real spawned ranks with gloo, a tiny Hugging Face Llama (actor) and value model (critic),
float64, ragged prompts and responses with a fully masked row, all five loss_agg_modes,
DDP and FSDP2, dp 1/2/4, micro-batches of 1, 2, all rows, and a token budget.
"""

import pytest

from verlite.config import load_config
from verlite.core.losses import LOSS_AGG_MODES
from verlite.invariance import Case, check_invariance, make_batch, run_case

CONFIG = load_config("configs/ppo_tiny.yaml", ["model.dtype=float64"])
TOLERANCE = 1e-9


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("dp", [1, 2, 4])
def test_all_modes_and_micro_layouts_match_the_reference(dp: int, strategy: str) -> None:
    reports = check_invariance(
        CONFIG, dps=[dp], strategies=[strategy], loss_agg_modes=LOSS_AGG_MODES
    )
    assert len(reports) == len(LOSS_AGG_MODES) * 4 * 2
    failures = [r for r in reports if r.worst() > TOLERANCE]
    assert not failures, failures


def test_negative_control_per_micro_batch_normalization_differs() -> None:
    reports = check_invariance(
        CONFIG,
        dps=[2],
        strategies=["ddp"],
        micros=["1", "dynamic"],
        loss_agg_modes=LOSS_AGG_MODES,
        naive=True,
    )
    assert len(reports) == len(LOSS_AGG_MODES) * 2 * 2
    too_close = [
        r for r in reports if min(r.max_rel_grad_diff, r.grad_norm_diff, r.loss_diff) < 1e-3
    ]
    assert not too_close, f"the audit could not tell naive normalization apart: {too_close}"


def test_reference_update_is_not_trivial() -> None:
    batch = make_batch(CONFIG)
    assert int(batch["response_mask"].sum(-1).eq(0).sum()) == 1  # one fully masked row
    assert len(set(batch["attention_mask"].sum(-1).tolist())) > 4  # ragged
    for role in ("actor", "critic"):
        outcome = run_case(CONFIG, Case(role, "token-mean", "full"), batch, strategy="none")
        assert outcome is not None and outcome.grad_norm > 1e-3
        assert sum(int(g.ne(0).sum()) for g in outcome.grads.values()) > 1000
