"""Weight sync from an actor worker to a rollout worker, against bare object-store transfers
of the same bytes, for policies of about 1M, 10M and 100M parameters.

verlite: as a run syncs after every update (``verlite.driver.step_source.queue_weight_sync``), one
``ActorWorker.put_bucket`` call per bucket of ``rollout.sync_bucket_mb`` (the tensors' bytes
and their checksum put in the object store, the reference returned) and one
``RolloutWorker.load_bucket`` call taking that reference (the model's tensors bound to the
received bytes, and the checksum of what is now in them checked): loads overlap the later
buckets' puts.
bare: the same two worker processes and the same bytes in buckets of the same size,
prepared beforehand as flat arrays: the actor ``ray.put``s every bucket, then the rollout
worker ``ray.get``s them and copies each into one flat tensor of its own (a sync that
copies lands the bytes in the receiver's memory). floor: the same without the copy, a bare
``ray.put`` and ``ray.get`` (a get maps the object store's copy). A verlite rollout worker
on the CPU makes its model's tensors views of the object store's copy, so its sync has no
copy there either. The figures are the medians of verlite / bare and verlite / floor,
paired by repetition, with seconds per GB of each.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np
import ray
import torch

from benchmarks.common import (
    add_repeats,
    emit,
    interleaved,
    median,
    paired_ratio,
    quartiles,
    ratios,
)
from verlite.arguments import positive_float
from verlite.config import RolloutConfig, load_config
from verlite.controller import ResourcePool, WorkerGroup, start_ray, stop_ray
from verlite.data import load_tokenizer
from verlite.driver.step_source import queue_weight_sync
from verlite.memory import retain_freed_memory
from verlite.workers.actor import ActorWorker
from verlite.workers.rollout import RolloutWorker

# Ray workers cannot import the benchmarks package; the worker classes travel by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

# hidden, layers, intermediate: Llama models of about 1M, 10M and 100M parameters
SIZES = {"1M": (128, 4, 512), "10M": (384, 5, 1536), "100M": (1024, 6, 4096)}


class BenchActor(ActorWorker):
    def prepare_bare(self, nbytes: int, bucket_bytes: int) -> None:
        sizes = [bucket_bytes] * (nbytes // bucket_bytes) + [nbytes % bucket_bytes]
        self.bare = [np.ones(n, np.uint8) for n in sizes if n]

    def bare_put(self) -> list[Any]:
        return [ray.put(array) for array in self.bare]

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.engine.model.parameters())


class BenchRollout(RolloutWorker):
    def prepare_bare(self, nbytes: int) -> None:
        self.flat = torch.empty(nbytes, dtype=torch.uint8)

    def bare_get(self, refs: list[Any], land: bool) -> None:
        offset = 0
        for ref in refs:
            array = ray.get(ref)
            if land:
                self.flat[offset : offset + array.nbytes].copy_(torch.from_numpy(array))
            offset += array.nbytes


def measure(name: str, repeats: int, bucket_mb: float) -> dict[str, Any]:
    hidden, layers, intermediate = SIZES[name]
    cfg = load_config(
        "configs/grpo_tiny.yaml",
        [
            f"model.hidden_size={hidden}",
            f"model.num_layers={layers}",
            f"model.intermediate_size={intermediate}",
            "model.num_heads=8",
            "model.num_kv_heads=4",
            "rollout.placement=split",
            f"rollout.sync_bucket_mb={bucket_mb}",
        ],
    )
    tokenizer = load_tokenizer(cfg.model.path, task=cfg.data.task)
    kwargs = {
        "cfg": cfg,
        "vocab_size": len(tokenizer),
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    pools = [
        ResourcePool(
            role,
            nnodes=1,
            workers_per_node=1,
            cpus_per_worker=1.0,
            gpus_per_worker=0.0,
            timeout_s=60,
        )
        for role in ("actor", "rollout")
    ]
    actor = WorkerGroup(
        "actor",
        BenchActor,
        pools[0],
        share=1.0,
        worker_kwargs=kwargs,
        torch_threads=1,
        run_id="bench",
    )
    rollout = WorkerGroup(
        "rollout",
        BenchRollout,
        pools[1],
        share=1.0,
        worker_kwargs=kwargs,
        torch_threads=1,
        run_id="bench",
    )
    try:
        for group in (actor, rollout):
            group.call("init_model")
        bucket_bytes = int(cfg.rollout.sync_bucket_mb * 2**20)
        layout = actor.call("weight_layout", collect="rank0")
        versions = iter(range(1, 10_000))

        def verlite_sync() -> None:
            sync = queue_weight_sync(actor, rollout, layout, next(versions))
            ((held, _),) = sync.loads[-1].result()
            assert held == sync.version

        nbytes = layout.nbytes
        actor.call("prepare_bare", nbytes, bucket_bytes)
        rollout.call("prepare_bare", nbytes)

        def bare(land: bool) -> None:
            refs = actor.call("bare_put")[0]
            rollout.call("bare_get", refs, land)

        seconds, _ = interleaved(
            {
                "verlite": verlite_sync,
                "bare": lambda: bare(land=True),
                "floor": lambda: bare(land=False),
            },
            repeats=repeats,
            warmup=3,
        )
        parameters = actor.call("num_parameters")[0]
    finally:
        for group in (actor, rollout):
            group.shutdown()
        for pool in pools:
            pool.remove()
    gigabytes = nbytes / 1e9
    result = {
        "parameters": parameters,
        "megabytes": nbytes / 1e6,
        "buckets": len(layout.buckets),
        "verlite_s_per_gb": median(seconds["verlite"]) / gigabytes,
    }
    for bare in ("bare", "floor"):
        result[f"{bare}_s_per_gb"] = median(seconds[bare]) / gigabytes
        result[f"ratio_vs_{bare}"] = paired_ratio(seconds["verlite"], seconds[bare])
        result[f"ratio_vs_{bare}_quartiles"] = quartiles(ratios(seconds["verlite"], seconds[bare]))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_repeats(parser, 21)
    parser.add_argument("--sizes", nargs="*", default=list(SIZES), choices=list(SIZES))
    parser.add_argument(
        "--bucket-mb",
        type=positive_float,
        default=RolloutConfig.model_fields["sync_bucket_mb"].default,
        help="rollout.sync_bucket_mb (default: the config's default)",
    )
    args = parser.parse_args()
    retain_freed_memory()
    start_ray(None, num_cpus=2)
    try:
        results = {name: measure(name, args.repeats, args.bucket_mb) for name in args.sizes}
    finally:
        stop_ray()
    emit(
        {
            "benchmark": "weight_sync",
            "bucket_mb": args.bucket_mb,
            "results": results,
            "goal": "ratio <= 1.3",
        }
    )


if __name__ == "__main__":
    main()
