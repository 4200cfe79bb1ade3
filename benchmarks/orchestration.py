r"""Orchestration overhead: one PPO step through verlite's Ray worker groups against the same
step with the same workers called directly in this process.

verlite: ``Trainer.train_step`` with its actor and critic groups started as in a run (an
embedded local Ray, one actor and one critic worker colocated in one bundle).
in-process: ``Trainer.train_step`` of a second trainer handed :class:`InProcessGroup`\ s
instead — an ``ActorWorker`` and a ``CriticWorker`` (world size 1) built in this process,
whose methods are called directly in the same order with the same batches: no Ray, no
transport, no serialization. Everything else, including the driver's math and the
one-rank dispatch and collect, is the same code.

Both trainers start from the same seeds, so step k does the same work in both (their
metrics are checked to match). Steps alternate between the two, and the figure is the
median over steps of verlite / in-process step time. Model FLOPs utilization: each step's
FLOPs (``benchmarks.common.rl_step_flops``) per second of it, as a share of this machine's
float32 matrix-multiply peak with a thread per core (``common.machine_peak``).
"""

from __future__ import annotations

import argparse
import tempfile
from typing import Any

import torch

from benchmarks.common import (
    emit,
    machine_peak,
    median,
    paired_ratio,
    quartiles,
    ratios,
    rl_step_flops,
    time_call,
)
from verlite.arguments import positive_int
from verlite.config import load_config
from verlite.controller import dispatch as dispatching
from verlite.controller import ray_session
from verlite.driver.preflight import RunInputs
from verlite.driver.run import start_groups
from verlite.driver.trainer import RunGroups, Trainer
from verlite.workers.actor import ActorWorker
from verlite.workers.critic import CriticWorker

# A step of ~0.8 s on 2 cores: a wider, deeper model and longer responses than the
# main job's, so that the ratio measures overhead against real work.
OVERRIDES = [
    "model.hidden_size=128",
    "model.num_layers=4",
    "model.intermediate_size=256",
    "data.train_batch_size=128",
    "rollout.max_response_length=16",
    "trainer.total_steps=1000",
    "trainer.val_freq=0",
    "critic.warmup_steps=0",  # every measured step updates the actor too
]
# Worker-group calls of one PPO step with a critic: rollout (with log-probs), values, two updates.
CALLS_PER_STEP = 4


class InProcessGroup:
    """One worker in this process behind ``WorkerGroup.call``'s signature: the arguments of
    its one rank dispatched, the method called directly, the result collected."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker

    def call(
        self,
        method: str,
        *args: Any,
        dispatch: Any = "broadcast",
        collect: str = "list",
        **kwargs: Any,
    ) -> Any:
        plan = dispatching.dispatch(dispatch, 1, args, kwargs)
        result = getattr(self.worker, method)(*plan.args[0], **plan.kwargs[0])
        return dispatching.collect(collect, [result], plan.restore)


def in_process_trainer(cfg: Any, inputs: RunInputs) -> Trainer:
    """A trainer whose actor and critic groups are workers built in this process."""
    tokenizer = inputs.tokenizer
    base = {"rank": 0, "world_size": 1, "torch_threads": cfg.trainer.torch_threads_per_worker}
    actor = ActorWorker(
        role="actor",
        cfg=cfg,
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **base,
    )
    critic = CriticWorker(role="critic", cfg=cfg, vocab_size=len(tokenizer), **base)
    for worker in (actor, critic):
        worker.init_model()
    groups = RunGroups(actor=InProcessGroup(actor), critic=InProcessGroup(critic), rollout=None)
    return Trainer(cfg, inputs, groups=groups)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=positive_int, default=30)
    parser.add_argument("--config", default="configs/ppo_tiny.yaml")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(args.config, [*OVERRIDES, f"trainer.output_dir={out}"])
        inputs = RunInputs.load(cfg)
        local = in_process_trainer(cfg, inputs)
        with ray_session(None), start_groups(cfg, inputs.tokenizer) as groups:
            remote = Trainer(cfg, inputs, groups=groups)
            seconds: dict[str, list[float]] = {"verlite": [], "in_process": []}
            flops: list[float] = []
            step_flops = rl_step_flops(cfg, vocab_size=len(inputs.tokenizer))
            worst = 0.0
            # Step 1 warms both up (lazy imports, allocator, Ray's first transfers).
            for step in range(1, args.steps + 2):
                # Which trainer goes first alternates, so neither always follows the other.
                if step % 2:
                    t_remote, m_remote = time_call(lambda step=step: remote.train_step(step))
                    t_local, m_local = time_call(lambda step=step: local.train_step(step))
                else:
                    t_local, m_local = time_call(lambda step=step: local.train_step(step))
                    t_remote, m_remote = time_call(lambda step=step: remote.train_step(step))
                for key in ("critic/score/mean", "actor/pg_loss", "critic/vf_loss"):
                    a, b = m_remote[key], m_local[key]
                    worst = max(worst, abs(a - b) / max(abs(b), 1e-8))
                if step > 1:
                    seconds["verlite"].append(t_remote)
                    seconds["in_process"].append(t_local)
                    tokens = m_remote["perf/throughput"] * m_remote["timing_s/train"]
                    flops.append(step_flops(tokens))
    assert worst < 1e-4, f"the two trainers diverged (relative metric difference {worst:.2e})"
    peak = machine_peak()
    emit(
        {
            "benchmark": "orchestration",
            "config": args.config,
            "overrides": OVERRIDES,
            "steps": args.steps,
            "torch_threads": torch.get_num_threads(),
            "verlite_step_s": median(seconds["verlite"]),
            "in_process_step_s": median(seconds["in_process"]),
            "ratio": paired_ratio(seconds["verlite"], seconds["in_process"]),
            "ratio_quartiles": quartiles(ratios(seconds["verlite"], seconds["in_process"])),
            "overhead_ms_per_call": 1000
            * median(
                [a - b for a, b in zip(seconds["verlite"], seconds["in_process"], strict=True)]
            )
            / CALLS_PER_STEP,
            "max_rel_metric_diff": worst,
            "step_gflop": median(flops) / 1e9,
            "machine_matmul_peak_gflops": peak / 1e9,
            "mfu": {
                name: median([f / t / peak for f, t in zip(flops, s, strict=True)])
                for name, s in seconds.items()
            },
            "goal": "ratio <= 1.10",
        }
    )


if __name__ == "__main__":
    main()
