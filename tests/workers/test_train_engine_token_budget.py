"""The engine's dynamic micro-batches, measured on the tensors the model actually runs on:
each trimmed micro-batch fits the token budget, padding stays within ``MAX_PADDING``, and
rows are regrouped by length (the update equals the full batch's: test_train_engine_invariance)."""

import pytest
import torch

from verlite.audit.invariance import make_batch
from verlite.config import load_config
from verlite.core.partition import MAX_PADDING, flatten
from verlite.step_batch import trim_padding
from verlite.workers.train_engine import plan_micro_batches

CONFIG = load_config("configs/ppo_tiny.yaml")


@pytest.mark.parametrize("budget_rows", [1, 2, 4])
def test_trimmed_micro_batches_fit_the_budget_with_little_padding(budget_rows: int) -> None:
    batch = make_batch(CONFIG)
    prompt_widths = batch["attention_mask"][:, : CONFIG.data.max_prompt_length].sum(-1)
    assert len(set(prompt_widths.tolist())) > 1, "the audit batch should have ragged prompts"
    longest = CONFIG.max_sequence_length
    budget = budget_rows * longest
    cfg = CONFIG.actor.model_copy(
        update={"strategy": "none", "use_dynamic_bsz": True, "max_token_len_per_worker": budget}
    )
    plan = plan_micro_batches(batch, cfg=cfg, device=torch.device("cpu"), training=True)
    parts = plan.parts
    assert plan.repeats == 0 and sorted(flatten(parts)) == list(range(batch.batch_size[0]))
    ran = [trim_padding(batch[torch.tensor(p)])["attention_mask"] for p in parts]
    assert max(mask.numel() for mask in ran) <= budget
    padding = 1 - sum(int(mask.sum()) for mask in ran) / sum(mask.numel() for mask in ran)
    assert padding <= MAX_PADDING
    if budget_rows > 1:  # grouped by length, not cut into contiguous runs of rows
        assert any(p != list(range(p[0], p[0] + len(p))) for p in parts)
