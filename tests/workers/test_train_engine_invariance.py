"""The engine's update equals the single-process full-batch update under every layout.

Real spawned ranks with gloo, a tiny Hugging Face Llama (actor) and value model (critic),
float64, ragged prompts and responses with a fully masked row, truncated importance weights
on the policy token losses, all five loss_agg_modes, DDP and FSDP2, dp 1/2/4 (and 3, with a rank without loss tokens), micro-batches
of 1, 2, all rows, and a token budget, padded or packed (2 rows or the budget per packed
row), and 2 rows with activation checkpointing: one plain SGD step, and three steps of AdamW with gradient clipping active, as
training runs. GSPO's sequence ratio with a KL loss, padded and packed.
"""

import dataclasses
import itertools
from pathlib import Path

import pytest

from verlite.audit.invariance import (
    MICRO_LAYOUTS,
    VOCAB_SIZE,
    Case,
    _rank_job,
    audit_rows,
    check_invariance,
    compare,
    make_batch,
    run_case,
)
from verlite.config import load_config
from verlite.core.losses import LOSS_AGG_MODES
from verlite.core.partition import dp_shares
from verlite.distributed import run_on_ranks
from verlite.models import tiny_hf_config
from verlite.step_batch import row_costs

CONFIG = load_config("configs/ppo_tiny.yaml", ["model.precision=fp64"])
TOLERANCE = 1e-9
# The configured optimizer (AdamW) with a clip threshold below every step's gradient norm.
CLIP = 0.25
ADAMW = load_config(
    "configs/ppo_tiny.yaml",
    ["model.precision=fp64", f"actor.optim.grad_clip={CLIP}", f"critic.optim.grad_clip={CLIP}"],
)
ADAMW_STEPS = 3
ADAMW_MICROS = ["1", "full", "dynamic", "packed-dynamic"]


# dp 1 runs DDP only (FSDP2 over one rank shards nothing), dp 2 FSDP2 only (DDP is the same
# code at 4 ranks, with more ragged shares). FSDP2 over 4 ranks runs every micro layout with a
# token-level and a sequence-level mode: a mode's loss (agg_loss, its global counts and dp_size)
# is the same code under either strategy, and each mode meets 4 ranks under DDP and FSDP2
# under dp 2 above; the 4-rank FSDP2 run of all five cost a 2-core machine 29 s.
FSDP4_MODES = ("token-mean", "seq-mean-token-mean")


@pytest.mark.parametrize(
    ("dp", "strategy", "modes"),
    [
        (1, "ddp", LOSS_AGG_MODES),
        (2, "fsdp", LOSS_AGG_MODES),
        (4, "ddp", LOSS_AGG_MODES),
        (4, "fsdp", FSDP4_MODES),
    ],
    ids=["1-ddp", "2-fsdp", "4-ddp", "4-fsdp"],
)
def test_all_modes_and_micro_layouts_match_the_reference(
    dp: int, strategy: str, modes: tuple[str, ...]
) -> None:
    reports = check_invariance(CONFIG, dps=[dp], strategies=[strategy], loss_agg_modes=modes)
    assert len(reports) == len(modes) * len(MICRO_LAYOUTS) * 2
    failures = [r for r in reports if r.worst() > TOLERANCE]
    assert not failures, failures


def test_negative_control_per_micro_batch_normalization_differs() -> None:
    reports = check_invariance(
        CONFIG,
        dps=[2],
        strategies=["ddp"],
        micros=["1", "dynamic", "packed-dynamic"],
        loss_agg_modes=LOSS_AGG_MODES,
        naive=True,
    )
    assert len(reports) == len(LOSS_AGG_MODES) * 3 * 2
    too_close = [
        r for r in reports if min(r.max_rel_grad_diff, r.grad_norm_diff, r.loss_diff) < 1e-3
    ]
    assert not too_close, f"the audit could not tell naive normalization apart: {too_close}"


def test_reference_update_is_not_trivial() -> None:
    batch = make_batch(CONFIG)
    mask = batch["response_mask"]
    assert mask.sum(-1).eq(0).any()  # a row whose whole response is observation
    # Observation holes between the policy's tokens, as multi-turn rows have.
    before, after = mask.cummax(-1).values, mask.flip(-1).cummax(-1).values.flip(-1)
    assert int(((before > mask) & (after > mask)).any(-1).sum()) >= 3
    assert len(set(batch["attention_mask"].sum(-1).tolist())) > 4  # ragged
    for role in ("actor", "critic"):
        outcome = run_case(CONFIG, Case(role, "token-mean", "full"), batch, strategy="none")
        assert outcome is not None and outcome.grad_norm > 1e-3
        assert sum(int(g.ne(0).sum()) for g in outcome.grads.values()) > 1000


def test_the_audit_batch_weights_the_policy_loss() -> None:
    """Importance weights spread over [0.5, 2] on response tokens, 0 on pads, and the actor's
    update depends on them: every layout above is audited with weights present."""
    batch = make_batch(CONFIG)
    valid = batch["response_mask"].bool()
    weights = batch["rollout_is_weights"]
    assert weights[valid].min() < 0.6 and weights[valid].max() > 1.9
    assert weights[~valid].eq(0).all()
    case = Case("actor", "token-mean", "full")
    weighted = run_case(CONFIG, case, batch, strategy="none")
    unweighted = run_case(CONFIG, case, batch.exclude("rollout_is_weights"), strategy="none")
    assert weighted is not None and unweighted is not None
    assert abs(weighted.loss - unweighted.loss) > 1e-3 * abs(unweighted.loss)
    assert abs(weighted.grad_norm - unweighted.grad_norm) > 1e-3 * unweighted.grad_norm


@pytest.mark.parametrize(("dp", "strategy"), [(2, "fsdp"), (4, "ddp")])
def test_three_adamw_steps_with_clipping_match_the_reference(dp: int, strategy: str) -> None:
    reports = check_invariance(
        ADAMW,
        dps=[dp],
        strategies=[strategy],
        micros=ADAMW_MICROS,
        optimizer="configured",
        steps=ADAMW_STEPS,
    )
    assert len(reports) == 2 * len(ADAMW_MICROS)
    failures = [r for r in reports if r.worst() > TOLERANCE]
    assert not failures, failures


def test_the_adamw_reference_clips_and_moves_every_step() -> None:
    """Clipping is active at each of the steps (the norm is above the threshold), and the
    steps after the first (where AdamW is no longer lr * sign(g)) change the parameters."""
    assert ADAMW.actor.optim.name == ADAMW.critic.optim.name == "adamw"
    batch = make_batch(ADAMW)
    for role in ("actor", "critic"):
        outcomes = [
            run_case(
                ADAMW,
                Case(role, "token-mean", "full"),
                batch,
                strategy="none",
                optimizer="configured",
                steps=steps,
            )
            for steps in range(1, ADAMW_STEPS + 1)
        ]
        assert all(o is not None and o.grad_norm > CLIP for o in outcomes), role
        for before, after in itertools.pairwise(outcomes):
            assert before is not None and after is not None
            moved = max(float((after.params[k] - p).abs().max()) for k, p in before.params.items())
            assert moved > 1e-4, role


def test_negative_control_fails_after_three_adamw_steps() -> None:
    reports = check_invariance(
        ADAMW,
        dps=[2],
        strategies=["ddp"],
        micros=["1", "dynamic"],
        naive=True,
        optimizer="configured",
        steps=ADAMW_STEPS,
    )
    too_close = [r for r in reports if r.max_rel_param_diff < 1e-4]
    assert not too_close, f"AdamW and clipping hid per-micro-batch normalization: {too_close}"


# LoRA: the gradients of the adapters (A and B: the audit starts B away from 0) under DDP and
# FSDP2 (frozen and trainable parameters in one shard unit), padded, packed and checkpointed
# (a frozen base under activation checkpointing).
LORA = load_config("configs/ppo_tiny.yaml", ["model.precision=fp64", "actor.lora.rank=4"])


def test_lora_adapter_gradients_match_the_reference() -> None:
    micros = ["1", "packed", "checkpointed"]
    reports = check_invariance(LORA, dps=[2], micros=micros, roles=["actor"])
    assert len(reports) == 2 * len(micros)
    failures = [r for r in reports if r.worst() > TOLERANCE]
    assert not failures, failures


def test_lora_reference_trains_only_the_adapters_and_the_negative_control_fails() -> None:
    batch = make_batch(LORA)
    case = Case("actor", LORA.actor.loss_agg_mode, "full")
    reference = run_case(LORA, case, batch, strategy="none")
    assert reference is not None
    assert {n.split(".")[-3] for n in reference.grads} == {"lora_A", "lora_B"}
    assert all(g.abs().max() > 0 for g in reference.grads.values())
    # per-micro-batch normalization, micro-batches of one row, in this process
    one_row = dataclasses.replace(case, micro="1")
    naive = run_case(LORA, one_row, batch, strategy="none", naive=True)
    assert naive is not None
    diffs = compare(naive, reference)
    assert min(diffs["max_rel_grad_diff"], diffs["loss_diff"]) > 1e-3, diffs


# GSPO: the one policy loss whose token losses share a per-sequence figure, the geometric mean
# of the sequence's token ratios (a mean over its own loss tokens, observation holes left out),
# with the KL loss (k3+: the k2 gradient) beside it. A sequence's ratio must not depend on the
# micro-batch it sits in, whose width is trimmed to its own longest response, padded or packed.
GSPO = load_config(
    "configs/ppo_tiny.yaml",
    [
        "model.precision=fp64",
        "actor.policy_loss=gspo",
        "actor.use_kl_loss=true",
        "actor.kl_loss_type=k3+",
        "actor.kl_loss_coef=0.1",
    ],
)


def test_gspo_with_a_kl_loss_matches_the_reference() -> None:
    micros = ["1", "packed-dynamic"]
    reports = check_invariance(
        GSPO,
        dps=[2],
        strategies=["fsdp"],
        micros=micros,
        roles=["actor"],
        loss_agg_modes=["seq-mean-token-mean"],  # the paper's
    )
    assert len(reports) == len(micros)
    failures = [r for r in reports if r.worst() > TOLERANCE]
    assert not failures, failures


# Three ranks: the loss gradient is scaled by a dp_size that is not a power of two, which
# rounds differently in any op below the model's precision. Hugging Face's RMSNorm computed in
# float32 under fp64 and the gradients were 1.3e-7 apart (models.precision.fp64_throughout).
def test_three_ranks_with_a_rank_without_tokens_match_the_reference() -> None:
    batch = make_batch(CONFIG, num_sequences=12)
    shares = dp_shares(row_costs(batch), world=3)
    mask = batch["response_mask"].clone()
    mask[shares[2]] = 0  # one rank holds rows, but no token that carries loss
    batch["response_mask"] = mask
    cases = [Case(role, "token-mean", "1") for role in ("actor", "critic")]
    references = [
        run_case(CONFIG, dataclasses.replace(c, micro="full"), batch, strategy="none")
        for c in cases
    ]
    per_rank = run_on_ranks(
        _rank_job, world_size=3, args=(CONFIG, batch, cases, "ddp", False, "sgd", 1)
    )
    for case, outcome, reference in zip(cases, per_rank[0], references, strict=True):
        assert reference is not None
        diffs = compare(outcome, reference)
        assert max(diffs.values()) < TOLERANCE, (case, diffs)


def test_the_audit_batch_splits_equally_over_every_requested_size() -> None:
    """Any data-parallel size is audited (dp 3 found float32 norms in an fp64 model), on a
    batch every size splits into equal shares, 16 rows for the powers of two."""
    assert audit_rows([1, 2, 4]) == audit_rows([16]) == 16
    assert audit_rows([1, 3]) == audit_rows([6]) == 48
    assert audit_rows([5, 8]) == 80
    for dps in ([3], [2, 3], [5, 6, 7]):
        rows = audit_rows(dps)
        assert all(rows % dp == 0 for dp in dps) and rows % 16 == 0


# A checkpoint whose config.json sets attention_dropout: a training forward drew dropout
# masks, so the update depended on the micro-batches and the random stream (models._without_dropout).
def test_a_checkpoint_with_dropout_matches_the_reference(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf = tiny_hf_config(
        CONFIG.model, vocab_size=VOCAB_SIZE, max_positions=CONFIG.max_sequence_length
    )
    hf.attention_dropout = 0.5
    AutoModelForCausalLM.from_config(hf).save_pretrained(tmp_path)
    cfg = load_config("configs/ppo_tiny.yaml", ["model.precision=fp64", f"model.path={tmp_path}"])
    reports = check_invariance(cfg, dps=[2], strategies=["ddp"], micros=["1", "full"])
    failures = [r for r in reports if r.worst() > TOLERANCE]
    assert not failures, failures
