"""Asynchronous against synchronous training: steps per second of ``rollout.max_staleness=1``
over ``max_staleness=0``, and the score of both over wall time; and the step time that
``algorithm.recompute_old_log_probs=auto`` saves on-policy.

Both variants are the same GRPO run with ``rollout.placement=split``, one rollout worker and
one actor worker (1 CPU each, one torch thread), on a Llama of hidden 256 and 4 layers, 64
sequences a step (8 prompts x 8 samples) of up to 64 response tokens, the actor cutting
micro-batches by a token budget (``use_dynamic_bsz``), the same seed. With
staleness 0 the rollout worker waits while the actor trains and the other way round; with
staleness 1 it generates the next batch meanwhile. A third variant is staleness 0 with
``recompute_old_log_probs=auto``: the sampler's log-probs serve as the old ones, and the
actor's forward pass over the batch is skipped; a fourth is staleness 0 with
``actor.packing`` (the actor's passes over packed rows, the same token budget of real
tokens). A repetition is one run of each variant
(the order reverses every repetition); the figures are the medians over repetitions of the
paired ratios of steady-state steps per second (the steps after the first ``--warmup``,
timed by the step times the run logs), with quartiles; these runs use a learning rate of
1e-9, so that all variants generate the same responses and do the same work. ``--plot-steps N`` then trains each
staleness for N steps and draws the scores over wall time in ``docs/async_training.png``.
Model FLOPs utilization of each variant's steady steps: as ``benchmarks.orchestration``
counts it (the passes its config runs), over this machine's peak with a thread per core.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import (
    add_repeats,
    emit,
    machine_peak,
    median,
    paired_ratio,
    quartiles,
    ratios,
    rl_step_flops,
)
from verlite.arguments import non_negative_int, positive_int
from verlite.config import Config, load_config
from verlite.controller import start_ray, stop_ray
from verlite.data.tokenizer import load_tokenizer
from verlite.driver.preflight import RunInputs
from verlite.driver.run import run
from verlite.memory import retain_freed_memory

OVERRIDES = [
    "model.hidden_size=256",
    "model.num_layers=4",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.intermediate_size=1024",
    "data.train_batch_size=8",
    "rollout.n=8",
    "rollout.max_response_length=64",
    "actor.ppo_mini_batch_size=64",
    "actor.use_dynamic_bsz=true",
    "actor.max_token_len_per_worker=1024",
    "rollout.placement=split",
    "trainer.workers_per_node=1",
    "trainer.val_freq=0",
    "trainer.loggers=[jsonl]",
]
# The timed runs barely move the weights, so that every variant generates (nearly) the same
# responses step by step and the ratio compares the same work: the response length of an
# untrained policy swings from 3 to 60 tokens between steps. The curves learn.
TIMING_LR, CURVE_LR = 1e-9, 1e-3
PLOT = Path(__file__).resolve().parents[1] / "docs" / "async_training.png"


# variant: (rollout.max_staleness, algorithm.recompute_old_log_probs, .rollout_correction,
# actor.packing)
VARIANTS = {
    "sync": (0, "always", "none", False),
    "async": (1, "always", "none", False),
    "sync_auto": (0, "auto", "none", False),
    "sync_packed": (0, "always", "none", True),
    "async_tis": (1, "always", "tis", False),
}
TIMED = ("sync", "async", "sync_auto", "sync_packed")
CURVES = ("sync", "async", "async_tis")


def variant_config(folder: Path, variant: str, steps: int, *, lr: float) -> Config:
    staleness, recompute, correction, packing = VARIANTS[variant]
    return load_config(
        "configs/grpo_tiny.yaml",
        [
            *OVERRIDES,
            f"actor.optim.lr={lr}",
            f"rollout.max_staleness={staleness}",
            f"algorithm.recompute_old_log_probs={recompute}",
            f"algorithm.rollout_correction={correction}",
            f"actor.packing={str(packing).lower()}",
            f"trainer.total_steps={steps}",
            f"trainer.output_dir={folder}",
        ],
    )


def one_run(cfg: Config) -> list[dict[str, Any]]:
    """The metrics records of a run of ``cfg``."""
    run(cfg, RunInputs.load(cfg))
    lines = (Path(cfg.trainer.output_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def steps_per_second(records: list[dict[str, Any]], warmup: int) -> float:
    steady = records[warmup:]
    return len(steady) / sum(r["timing_s/step"] for r in steady)


def utilization(cfg: Config, records: list[dict[str, Any]], warmup: int, peak: float) -> float:
    """Model FLOPs utilization of the steady steps: their FLOPs (``common.rl_step_flops``)
    over their time, as a share of ``peak`` FLOP/s."""
    steady = records[warmup:]
    step_flops = rl_step_flops(
        cfg, vocab_size=len(load_tokenizer(cfg.model.path, task=cfg.data.task))
    )
    flops = sum(step_flops(r["perf/throughput"] * r["timing_s/train"]) for r in steady)
    return flops / sum(r["timing_s/step"] for r in steady) / peak


def plot(curves: dict[str, list[dict[str, Any]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    for variant, records in curves.items():
        staleness, _, correction, _ = VARIANTS[variant]
        label = f"max_staleness={staleness}" + (", tis" if correction == "tis" else "")
        scores = [r["critic/score/mean"] for r in records]
        elapsed, total = [], 0.0
        for r in records:
            total += r["timing_s/step"]
            elapsed.append(total)
        by_step.plot([r["step"] for r in records], scores, label=label, linewidth=1)
        by_time.plot(elapsed, scores, label=label, linewidth=1)
    by_step.set_xlabel("step")
    by_time.set_xlabel("wall time of the steps (s)")
    by_step.set_ylabel("mean score of the step's batch")
    by_step.legend()
    fig.suptitle("GRPO, split rollout: synchronous vs one step off-policy")
    fig.tight_layout()
    fig.savefig(PLOT, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_repeats(parser, 3)
    parser.add_argument("--steps", type=positive_int, default=8)
    parser.add_argument("--warmup", type=non_negative_int, default=2)
    parser.add_argument(
        "--plot-steps",
        type=non_negative_int,
        default=0,
        help=f"steps of each curve in {PLOT.name} (0: none)",
    )
    args = parser.parse_args()
    if args.warmup >= args.steps:
        parser.error(
            f"--warmup {args.warmup}: below --steps ({args.steps}), the steps timed after it"
        )
    retain_freed_memory()
    rates: dict[str, list[float]] = {name: [] for name in TIMED}
    mfu: dict[str, list[float]] = {name: [] for name in TIMED}
    peak = machine_peak()
    shares: list[float] = []
    curves: dict[str, list[dict[str, Any]]] = {}
    start_ray(None, num_cpus=2)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for repeat in range(args.repeats):
                names = TIMED if repeat % 2 == 0 else TIMED[::-1]
                for name in names:
                    cfg = variant_config(
                        Path(tmp) / f"{repeat}-{name}", name, args.steps, lr=TIMING_LR
                    )
                    records = one_run(cfg)
                    rates[name].append(steps_per_second(records, args.warmup))
                    mfu[name].append(utilization(cfg, records, args.warmup, peak))
                    if name == "sync":
                        shares += [
                            r["timing_s/weight_sync"] / r["timing_s/step"]
                            for r in records[args.warmup :]
                        ]
            for name in CURVES if args.plot_steps else ():
                curves[name] = one_run(
                    variant_config(Path(tmp) / f"curve-{name}", name, args.plot_steps, lr=CURVE_LR)
                )
    finally:
        stop_ray()
    if curves:
        plot(curves)
    emit(
        {
            "benchmark": "async_training",
            "steps": args.steps,
            "steps_per_s": {name: median(v) for name, v in rates.items()},
            "machine_matmul_peak_gflops": peak / 1e9,
            "mfu": {name: median(v) for name, v in mfu.items()},
            "ratio": paired_ratio(rates["async"], rates["sync"]),
            "ratio_quartiles": quartiles(ratios(rates["async"], rates["sync"])),
            "auto_recompute_ratio": paired_ratio(rates["sync_auto"], rates["sync"]),
            "auto_recompute_quartiles": quartiles(ratios(rates["sync_auto"], rates["sync"])),
            "packing_ratio": paired_ratio(rates["sync_packed"], rates["sync"]),
            "packing_quartiles": quartiles(ratios(rates["sync_packed"], rates["sync"])),
            "weight_sync_share_of_step": median(shares),
            "curves": {
                name: {
                    "steps": len(records),
                    "wall_s": sum(r["timing_s/step"] for r in records),
                    "score_first10": sum(r["critic/score/mean"] for r in records[:10]) / 10,
                    "score_last10": sum(r["critic/score/mean"] for r in records[-10:]) / 10,
                }
                for name, records in curves.items()
            },
            "goal": "ratio >= 1.6",
        }
    )


if __name__ == "__main__":
    main()
