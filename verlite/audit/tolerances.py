"""The audits' default tolerances by ``model.precision``, in one place without torch: the
audits compare with them, and ``verlite check-invariance --help`` states them."""

from __future__ import annotations

from collections.abc import Mapping

# bf16 rounds every matrix product's output to 8 significant bits (unit roundoff
# u = 2^-9 = 2.0e-3), and each layout rounds other partial sums: a micro-batch's weight
# gradient is one bf16 product, so a layout of k micro-batches sums k rounded parts where the
# reference rounds their sum once, and with advantages of both signs the parts cancel. On the
# audit batch that gives up to 3.6u (6.9e-3) in bf16-mixed, whose fp32 master weights take
# the update exactly (parameters within 1.4e-5); 5u (1e-2) bounds it. Pure bf16 accumulates
# and updates in bf16 too: 1.1e-2 to 2.3e-2 on the same batch (docs/invariance-audit.md).
# The relative tolerance of one update, and of the whole runs' metrics (--run).
TOLERANCE = {"fp32": 1e-5, "fp64": 1e-9, "bf16-mixed": 1e-2, "bf16": 1e-2}
# bf16-mixed is calibrated per case (role x loss_agg_mode) instead: the audit also runs the
# case's single-process reference in fp32 (same batch, same fp32 initial weights) and takes
# its noise e = the bf16-mixed reference's max relative gradient difference from it, how far
# bf16 products move this case's gradient. Every layout's bf16-mixed gradient is about as far
# from fp32's, so by the triangle inequality two of them are at most about 2e apart. Measured
# (docs/invariance-audit.md): e = 1.0e-2 to 2.9e-2 (LoRA adapters the most), the worst layout
# 0.29e to 0.85e. A case is held to max(TOLERANCE, NOISE_FACTOR * e). Pure bf16 keeps the
# fixed tolerance: its accumulation and update in bf16 are its defect, which must show.
NOISE_FACTOR = 2.0
# The negative control (per-micro-batch normalization) differs by 0.045 to 30 per layout, its
# weakest layouts by 0.06 to 0.12 in bf16-mixed here: a case whose calibrated tolerance would
# exceed 0.1 gets no verdict rather than one that could pass it.
NOISE_CAP = 0.1
# AdamW divides every gradient entry by its own running magnitude, so float32 rounding of
# small entries (1e-7 relative) becomes parameter differences of up to ~1e-4 after 3 steps
# of the main job's model; per-micro-batch normalization differs by 7e-2 or more there.
# float64 keeps 1e-9.
# In bf16 (mixed or pure) three AdamW steps turn the gradients' rounding into parameter
# differences of up to 3e-2 (a step is about lr * sign(g)); per-micro-batch normalization
# still differs by more than 5e-2.
CONFIGURED_OPTIMIZER_TOLERANCE = {"fp32": 1e-3, "fp64": 1e-9, "bf16-mixed": 5e-2, "bf16": 5e-2}
# The whole runs' absolute tolerance (--run). Some metrics carry rounding noise with no
# meaningful relative difference: those that are zero in exact arithmetic (the mean of
# whitened advantages, the PPO KL of a step's first mini-batch; float32: 1.8e-8 measured for
# the former), and those that are a small difference of larger quantities
# (``rollout/logprob_abs_diff`` and ``_max_diff``: in a float64 run the trainer's log-probs
# less the sampler's float32 ones, ~1e-7, whose operands are log-probs of magnitude up to
# ln(vocabulary) and beyond). Their noise is a few units of rounding of the operands, not of
# the metric: a layout that rounded one log-prob between 8 and 16 one unit (2^-49 = 1.8e-15)
# otherwise moved ``rollout/logprob_max_diff`` by 7.5e-9 relative, REINFORCE++ with the KL in
# the reward (tests/e2e/test_whole_run_invariance.py). 1e-13 is a few units of rounding of
# quantities up to 64 (a unit: 1.4e-14) in float64. float32's 1e-6 is a few units of rounding
# of a quantity of order 1, as measured (not widened: float32 runs drift by more than
# rounding after 20-25 steps anyway); bf16 keeps it.
RUN_ATOL = {"fp32": 1e-6, "fp64": 1e-13, "bf16-mixed": 1e-6, "bf16": 1e-6}


def calibrated_tolerance(fixed: float, noise: float | None) -> float:
    """The tolerance of a case whose bf16 rounding noise is ``noise``, at least ``fixed``
    (all of it when the case is not calibrated, None)."""
    return fixed if noise is None else max(fixed, NOISE_FACTOR * noise)


def calibration_rule() -> str:
    """The rule as the help and the report state it."""
    return (
        f"bf16-mixed's SGD step: per role and loss_agg_mode, max({_short(TOLERANCE['bf16-mixed'])}, "
        f"{NOISE_FACTOR:g} x its noise), the noise being its bf16-mixed reference's gradient "
        f"difference from an fp32 one; no verdict above {NOISE_CAP:g}"
    )


def noise_refusal(role: str, loss_agg_mode: str, noise: float) -> str | None:
    """The line that refuses a case's verdict when its noise would set a tolerance the negative
    control could pass; None when the tolerance is below :data:`NOISE_CAP`."""
    tolerance = NOISE_FACTOR * noise
    if tolerance <= NOISE_CAP:
        return None
    return (
        f"{role} {loss_agg_mode}: no verdict: bf16 rounding moves its reference gradient "
        f"{noise:.1e} from fp32's, so a tolerance of {tolerance:.1e} (over {NOISE_CAP:g}) would "
        "let per-micro-batch normalization pass; audit it with model.precision=fp32"
    )


def run_precision_note(precision: str) -> str | None:
    """The line ``check-invariance --run`` prints before running in bf16 (mixed or pure), None
    in fp32 and fp64: whole runs are not calibrated, since an fp32 reference run would part
    from the bf16 ones within a step or two anyway (docs/invariance-audit.md)."""
    if not precision.startswith("bf16"):
        return None
    return (
        f"model.precision={precision}: whole runs are held to the fixed "
        f"{_short(TOLERANCE[precision])}, but bf16 layouts round apart from the first update "
        "and then clip and sample differently, so a difference need not be a normalization "
        "error; audit whole runs in model.precision=fp32 or fp64, and bf16's update without --run"
    )


def by_precision(table: Mapping[str, float]) -> str:
    """A table as the help states it: ``fp32 1e-5, fp64 1e-9, ...``."""
    return ", ".join(f"{name} {_short(value)}" for name, value in table.items())


def _short(value: float) -> str:
    """``1e-05`` as ``1e-5``, ``0.05`` as ``5e-2``: every digit kept, none padded."""
    mantissa, exponent = f"{value:e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"
