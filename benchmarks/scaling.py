"""Scaling: PPO step time with 1, 2 and 4 data-parallel workers per role on this machine.

The same step as ``benchmarks.orchestration`` (actor and critic colocated, one torch
thread per worker) with ``trainer.workers_per_node`` = dp, each bundle taking 2 / dp of the
machine's CPUs. Every layout trains on the same global batch with the same mini-batches
(micro-batches of 4 sequences), so each does the same math; only its split differs. dp
layouts run one after another, each after a warm-up step, and the figure is the median
step time of each relative to dp = 1. With 2 cores, dp = 2 can use both and dp = 4
oversubscribes them: the model of ``benchmarks/README.md`` says what changes on GPU nodes.
Model FLOPs utilization: as ``benchmarks.orchestration`` counts it.
"""

from __future__ import annotations

import argparse
import tempfile

from benchmarks.common import emit, machine_peak, median, rl_step_flops, time_call
from benchmarks.orchestration import OVERRIDES
from verlite.arguments import positive_int
from verlite.config import load_config
from verlite.controller import ray_session
from verlite.driver.preflight import RunInputs
from verlite.driver.run import start_groups
from verlite.driver.trainer import Trainer

CORES = 2
STAGES = ("rollout", "values", "update_critic", "update_actor")


def step_times(dp: int, *, steps: int, config: str, peak: float) -> dict[str, float]:
    """Median step and stage times of ``steps`` steps with dp workers per role, and the
    steps' median model FLOPs utilization of ``peak`` FLOP/s."""
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(
            config,
            [
                *OVERRIDES,
                f"trainer.output_dir={out}",
                f"trainer.workers_per_node={dp}",
                f"trainer.cpus_per_worker={CORES / dp}",
                "actor.micro_batch_size_per_worker=4",
                "critic.micro_batch_size_per_worker=4",
            ],
        )
        inputs = RunInputs.load(cfg)
        with start_groups(cfg, inputs.tokenizer) as groups:
            trainer = Trainer(cfg, inputs, groups=groups)
            runs = [
                time_call(lambda step=step: trainer.train_step(step))
                for step in range(1, steps + 2)
            ]
    kept = runs[1:]  # the first step warms up
    step_flops = rl_step_flops(cfg, vocab_size=len(inputs.tokenizer))
    utilization = [
        step_flops(m["perf/throughput"] * m["timing_s/train"]) / seconds / peak
        for seconds, m in kept
    ]
    result = {"step_s": median([seconds for seconds, _ in kept]), "mfu": median(utilization)}
    for stage in STAGES:
        result[f"{stage}_s"] = median([m[f"timing_s/{stage}"] for _, m in kept])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=positive_int, default=5)
    parser.add_argument("--dp", default="1,2,4")
    parser.add_argument("--config", default="configs/ppo_tiny.yaml")
    args = parser.parse_args()
    peak = machine_peak()
    with ray_session(None):  # one embedded Ray; each layout places and releases its groups
        layouts = {
            int(dp): step_times(int(dp), steps=args.steps, config=args.config, peak=peak)
            for dp in args.dp.split(",")
        }
    base = layouts[min(layouts)]["step_s"]
    emit(
        {
            "benchmark": "scaling",
            "cores": CORES,
            "torch_threads_per_worker": 1,
            "machine_matmul_peak_gflops": peak / 1e9,
            "steps": args.steps,
            "layouts": {
                str(dp): {**t, "speedup_vs_dp1": base / t["step_s"]} for dp, t in layouts.items()
            },
        }
    )


if __name__ == "__main__":
    main()
