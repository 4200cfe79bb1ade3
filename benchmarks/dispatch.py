"""Dispatch + collect of a 64 MB step batch over 4 workers, against bare Ray transfers.

verlite: ``WorkerGroup.call("echo", batch, dispatch="dp_split", collect="concat")`` — the
token-balanced split, one ``ray.put`` per rank, a worker method that returns its share,
and the concatenation back in the original row order.
bare: the same tensors cut into 4 contiguous chunks beforehand, each ``ray.put`` and sent
to one of 4 plain actors that return it, then ``ray.get`` — the transfers alone, nothing
verlite adds. The figure is the median of verlite / bare, paired by repetition.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import ray
import torch
from tensordict import TensorDict

from benchmarks.common import (
    add_repeats,
    emit,
    interleaved,
    median,
    paired_ratio,
    quartiles,
    ratios,
)
from verlite.arguments import positive_int
from verlite.controller import ResourcePool, Worker, WorkerGroup, start_ray, stop_ray
from verlite.data import position_ids
from verlite.memory import retain_freed_memory

WORLD = 4
# Ray workers cannot import the benchmarks package; the worker classes travel by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class EchoWorker(Worker):
    """A rank of the verlite group: returns the share it was given."""

    def echo(self, td: TensorDict) -> TensorDict:
        return td


class BareEcho:
    """A plain actor with nothing of verlite: returns what it was given."""

    def echo(self, chunk: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return chunk


def step_batch(rows: int, prompt: int, response: int, *, seed: int = 0) -> TensorDict:
    """A step batch in verlite's layout with ragged lengths (so the split balances rows)."""
    gen = torch.Generator().manual_seed(seed)
    width = prompt + response
    prompt_lens = torch.randint(1, prompt + 1, (rows,), generator=gen)
    response_lens = torch.randint(1, response + 1, (rows,), generator=gen)
    cols = torch.arange(width)
    mask = (
        (cols < prompt) & (cols >= prompt - prompt_lens[:, None])
        | (cols >= prompt) & (cols < prompt + response_lens[:, None])
    ).long()
    ids = torch.randint(0, 32000, (rows, width), generator=gen) * mask
    td = TensorDict(
        {
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": position_ids(mask),
            "responses": ids[:, prompt:].clone(),
            "response_mask": mask[:, prompt:].clone(),
            **{
                key: torch.randn(rows, response, generator=gen)
                for key in ("old_log_probs", "values", "advantages", "returns")
            },
        },
        batch_size=[rows],
    )
    td.set_non_tensor("temperature", 1.0)
    return td


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=positive_int, default=1024)
    add_repeats(parser, 31)
    args = parser.parse_args()

    retain_freed_memory()  # as the driver of `verlite train` does
    batch = step_batch(args.rows, prompt=256, response=1024)
    tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    megabytes = sum(v.numel() * v.element_size() for v in tensors.values()) / 1e6
    # Contiguous, self-owning chunks: a slice would pickle its whole parent storage.
    chunk_rows = args.rows // WORLD
    chunks = [
        {k: v[r * chunk_rows : (r + 1) * chunk_rows].clone() for k, v in tensors.items()}
        for r in range(WORLD)
    ]

    start_ray(None, num_cpus=2 * WORLD)
    pool = ResourcePool(
        "bench",
        nnodes=1,
        workers_per_node=WORLD,
        cpus_per_worker=1.0,
        gpus_per_worker=0.0,
        timeout_s=60,
    )
    group = WorkerGroup(
        "echo", EchoWorker, pool, share=1.0, worker_kwargs={}, torch_threads=1, run_id="bench"
    )
    bare_actors: list[Any] = [
        ray.remote(BareEcho).options(num_cpus=1).remote() for _ in range(WORLD)
    ]
    try:

        def verlite_call() -> TensorDict:
            return group.call("echo", batch, dispatch="dp_split", collect="concat")

        def bare_call() -> list[dict[str, torch.Tensor]]:
            refs = [a.echo.remote(ray.put(c)) for a, c in zip(bare_actors, chunks, strict=True)]
            return ray.get(refs)

        out = verlite_call()
        assert (out == batch).all(), "dispatch + collect must return the batch unchanged"
        seconds, _ = interleaved(
            {"verlite": verlite_call, "bare": bare_call}, repeats=args.repeats, warmup=2
        )
    finally:
        group.shutdown()
        pool.remove()
        stop_ray()
    emit(
        {
            "benchmark": "dispatch",
            "megabytes": megabytes,
            "workers": WORLD,
            "verlite_s": median(seconds["verlite"]),
            "bare_s": median(seconds["bare"]),
            "ratio": paired_ratio(seconds["verlite"], seconds["bare"]),
            "ratio_quartiles": quartiles(ratios(seconds["verlite"], seconds["bare"])),
            "goal": "ratio <= 1.2",
        }
    )


if __name__ == "__main__":
    main()
