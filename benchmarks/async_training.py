"""Asynchronous against synchronous training: steps per second of ``trainer.max_staleness=1``
over ``max_staleness=0``, and the score of both over wall time.

Both variants are the same GRPO run with ``rollout.placement=split``, one rollout worker and
one actor worker (1 CPU each, one torch thread), on a Llama of hidden 256 and 4 layers, 64
sequences a step (8 prompts x 8 samples) of up to 64 response tokens, the same seed. With
staleness 0 the rollout worker waits while the actor trains and the other way round; with
staleness 1 it generates the next batch meanwhile. A repetition is one run of each variant
(the order reverses every repetition); the figure is the median over repetitions of the
paired ratio of steady-state steps per second (the steps after the first ``--warmup``,
timed by the step times the run logs), with its quartiles. The runs' scores over wall time
are drawn in ``docs/async_training.png`` (``--plot``).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import emit, median, paired_ratio, quartiles, ratios
from verlite.config import load_config
from verlite.controller import start_ray, stop_ray
from verlite.memory import retain_freed_memory
from verlite.run import run
from verlite.trainer import RunInputs

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
    "actor.micro_batch_size_per_worker=16",
    "rollout.placement=split",
    "trainer.workers_per_node=1",
    "trainer.val_freq=0",
    "trainer.loggers=[jsonl]",
]
PLOT = Path(__file__).resolve().parents[1] / "docs" / "async_training.png"


def one_run(folder: Path, staleness: int, steps: int) -> list[dict[str, Any]]:
    cfg = load_config(
        "configs/grpo_tiny.yaml",
        [
            *OVERRIDES,
            f"trainer.max_staleness={staleness}",
            f"trainer.total_steps={steps}",
            f"trainer.output_dir={folder}",
        ],
    )
    run(cfg, RunInputs.load(cfg))
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def steps_per_second(records: list[dict[str, Any]], warmup: int) -> float:
    steady = records[warmup:]
    return len(steady) / sum(r["timing_s/step"] for r in steady)


def plot(curves: dict[int, list[dict[str, Any]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for staleness, records in curves.items():
        elapsed, total = [], 0.0
        for r in records:
            total += r["timing_s/step"]
            elapsed.append(total)
        ax.plot(
            elapsed,
            [r["critic/score/mean"] for r in records],
            label=f"max_staleness={staleness}",
        )
    ax.set_xlabel("wall time of the steps (s)")
    ax.set_ylabel("mean score of the step's batch")
    ax.set_title("GRPO, split rollout: synchronous vs one step off-policy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(PLOT, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--plot", action="store_true", help=f"write {PLOT.name} from the runs")
    args = parser.parse_args()
    retain_freed_memory()
    rates: dict[int, list[float]] = {0: [], 1: []}
    curves: dict[int, list[dict[str, Any]]] = {}
    start_ray(None, num_cpus=2)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for repeat in range(args.repeats):
                for staleness in (0, 1) if repeat % 2 == 0 else (1, 0):
                    folder = Path(tmp) / f"{repeat}-{staleness}"
                    records = one_run(folder, staleness, args.steps)
                    rates[staleness].append(steps_per_second(records, args.warmup))
                    curves[staleness] = records
    finally:
        stop_ray()
    if args.plot:
        plot(curves)
    last = curves[1][-1]
    emit(
        {
            "benchmark": "async_training",
            "steps": args.steps,
            "steps_per_s": {str(k): median(v) for k, v in rates.items()},
            "ratio": paired_ratio(rates[1], rates[0]),
            "ratio_quartiles": quartiles(ratios(rates[1], rates[0])),
            "weight_sync_share_of_step": last["timing_s/weight_sync"] / last["timing_s/step"],
            "score_last": {str(k): v[-1]["critic/score/mean"] for k, v in curves.items()},
            "goal": "ratio >= 1.6",
        }
    )


if __name__ == "__main__":
    main()
