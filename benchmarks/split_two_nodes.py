"""A split run on a simulated 2-node cluster learns: ``configs/grpo_tiny.yaml`` with 2 actor
workers and 1 rollout worker on each node (``ray.cluster_utils.Cluster``, 2 CPUs per node,
all on loopback: a layout check and a learning check, not a speed figure).

Prints where the workers ran (from ``workers.json``), the mean score of the first and the
last ``--window`` steps, the validation scores, and the largest staleness and sync size.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import Counter
from pathlib import Path

from ray.cluster_utils import Cluster

from benchmarks.common import emit
from verlite.arguments import non_negative_int, positive_int
from verlite.config import load_config
from verlite.controller import start_ray, stop_ray
from verlite.driver.preflight import RunInputs
from verlite.driver.run import run
from verlite.memory import retain_freed_memory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=positive_int, default=400)
    parser.add_argument("--window", type=positive_int, default=10)
    parser.add_argument("--staleness", type=non_negative_int, default=1)
    args = parser.parse_args()
    if args.window > args.steps:
        parser.error(f"--window {args.window}: at most --steps ({args.steps}), the scores it means")
    retain_freed_memory()
    node: dict[str, object] = {"num_cpus": 2, "node_ip_address": "127.0.0.1"}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    cluster.add_node(**node)
    cluster.wait_for_nodes()
    try:
        start_ray(cluster.address)
        with tempfile.TemporaryDirectory() as tmp:
            cfg = load_config(
                "configs/grpo_tiny.yaml",
                [
                    "trainer.nnodes=2",
                    "trainer.cpus_per_worker=0.5",
                    "actor.workers_per_node=2",
                    "actor.micro_batch_size_per_worker=32",
                    "actor.ppo_mini_batch_size=128",
                    "rollout.placement=split",
                    "rollout.workers_per_node=1",
                    f"rollout.max_staleness={args.staleness}",
                    "algorithm.rollout_correction=tis",
                    f"trainer.total_steps={args.steps}",
                    "trainer.val_freq=25",
                    "trainer.loggers=[jsonl]",
                    f"trainer.output_dir={tmp}",
                ],
            )
            run(cfg, RunInputs.load(cfg))
            placement = json.loads((Path(tmp) / "workers.json").read_text())
            lines = (Path(tmp) / "metrics.jsonl").read_text().splitlines()
            records = [json.loads(line) for line in lines]
    finally:
        stop_ray()
        cluster.shutdown()
    nodes = sorted({w["node_id"] for w in placement})
    layout = {
        role: [Counter(w["node_id"] for w in placement if w["role"] == role)[n] for n in nodes]
        for role in ("actor", "rollout")
    }
    scores = [r["critic/score/mean"] for r in records]
    emit(
        {
            "benchmark": "split_two_nodes",
            "workers_per_node": layout,
            "steps": len(records),
            "score_first": sum(scores[: args.window]) / args.window,
            "score_last": sum(scores[-args.window :]) / args.window,
            "val_score": {r["step"]: r["val/score/mean"] for r in records if "val/score/mean" in r},
            "staleness_max": max(r["rollout/staleness/max"] for r in records),
            "weight_sync_bytes": max(r.get("perf/weight_sync_bytes", 0.0) for r in records),
            "seconds_per_step": sum(r["timing_s/step"] for r in records) / len(records),
        }
    )


if __name__ == "__main__":
    main()
