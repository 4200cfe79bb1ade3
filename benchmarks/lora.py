"""LoRA against full training: the actor's update step time, its peak memory, and the memory
of the reference policy, on the Llama of hidden 256 and 4 layers (``benchmarks.async_training``'s
model: 4 heads, 2 KV heads, MLP 1024).

full: every weight trains (AdamW), and a KL term's reference is a frozen copy of the initial
policy (``ActorWorker.init_model``). lora: ``actor.lora.rank`` (default 8) adapters on every
attention and MLP projection (peft), AdamW on the adapters alone, the reference the same
model with its adapters off (``models.lora.adapters_disabled``): no copy.

Update step: one ``TrainEngine.train_mini_batch`` (forward, backward and optimizer step over
every micro-batch of 8 rows) of 32 sequences of 32-token prompts and 32..128-token
responses; the two variants alternate within each repetition (``common.interleaved``); the
figure is the median of lora / full paired by repetition, with its quartiles, of the wall
time and of the CPU time of the (one) thread that runs it: on a machine shared with other
work the CPU time moves far less than the wall time.
Peak memory: the most bytes of tensors live at once during an update (the second: the first
builds the optimizer's state), above those live when it began (``common.peak_tensor_bytes``,
from the allocations torch's profiler records). Resident: the bytes of the tensors an actor
holds between steps (weights, gradients, optimizer state and the reference), counted once
per storage. Reference: the bytes the reference allocates, measured the same way as the
peak (the copy, or entering the adapters-off context).
MFU: the update's FLOPs over its median time, as a share of this machine's one-thread
matmul peak (``common.matmul_peak``). Full training does 3 forward passes' worth
(``verlite.models.flops.decoder_flops`` with backward); LoRA 2 (the forward and the input gradients
through the frozen base; the adapters' own products, under 1% of them, are not counted).
"""

from __future__ import annotations

import argparse
import copy
import time
from collections.abc import Callable
from functools import partial

import torch
from tensordict import TensorDict

from benchmarks.common import (
    add_repeats,
    emit,
    interleaved,
    matmul_peak,
    median,
    peak_tensor_bytes,
    quartiles,
    ratios,
    update_batch,
)
from verlite.arguments import positive_int
from verlite.config import ActorConfig, LoraConfig, ModelConfig
from verlite.memory import retain_freed_memory
from verlite.models import build_policy
from verlite.models.flops import decoder_flops
from verlite.models.lora import adapters_disabled
from verlite.workers.objectives import ActorLossSettings, ppo_loss
from verlite.workers.train_engine import TrainEngine

MODEL = ModelConfig(
    hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=1024
)
VOCAB = 512
PROMPT, RESPONSE = 32, 128


def batch(rows: int, *, seed: int = 0) -> TensorDict:
    """``rows`` sequences: prompts of ``PROMPT`` tokens, responses of 32..``RESPONSE``."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(RESPONSE // 4, RESPONSE + 1, (rows, 1), generator=gen)
    response_mask = (torch.arange(RESPONSE) < lengths).long()
    mask = torch.cat([torch.ones(rows, PROMPT, dtype=torch.long), response_mask], dim=1)
    ids = torch.randint(1, VOCAB, mask.shape, generator=gen) * mask
    return update_batch(ids, mask, PROMPT, gen=gen)


def engine(rank: int, rows: int) -> TrainEngine:
    policy = build_policy(
        MODEL,
        vocab_size=VOCAB,
        max_positions=PROMPT + RESPONSE,
        seed=0,
        lora=LoraConfig(rank=rank),
    )
    cfg = ActorConfig(strategy="none", ppo_mini_batch_size=rows, micro_batch_size_per_worker=8)
    return TrainEngine(policy, cfg=cfg, total_updates=100, metric_prefix="actor")


def resident_bytes(eng: TrainEngine, reference: torch.nn.Module | None) -> int:
    """Bytes of the distinct storages of the weights, gradients, optimizer state and
    reference that an actor holds between steps."""
    tensors = [*eng.model.parameters()]
    tensors += [p.grad for p in eng.model.parameters() if p.grad is not None]
    tensors += [v for state in eng.optimizer.state.values() for v in state.values()]
    if reference is not None:
        tensors += list(reference.parameters())
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in tensors
        if isinstance(t, torch.Tensor)
    }
    return sum(storages.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rank", type=positive_int, default=8)
    parser.add_argument("--rows", type=positive_int, default=32)
    add_repeats(parser, 9)
    # One thread, as the other benchmarks: steadier on a shared machine.
    parser.add_argument("--threads", type=positive_int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    retain_freed_memory()
    td = batch(args.rows)
    loss_fn = partial(ppo_loss, settings=ActorLossSettings.from_config(ActorConfig()))
    engines = {"full": engine(0, args.rows), "lora": engine(args.rank, args.rows)}

    def update(name: str) -> Callable[[], float]:
        """An update of ``name``; returns the CPU seconds this thread spent on it."""

        def run() -> float:
            started = time.thread_time()
            engines[name].train_mini_batch(td.clone(), loss_fn)
            return time.thread_time() - started

        return run

    seconds, cpu = interleaved({name: update(name) for name in engines}, repeats=args.repeats)
    peak = {name: peak_tensor_bytes(update(name)) for name in engines}

    kept: list[torch.nn.Module] = []

    def copy_reference() -> None:  # as ActorWorker.init_model does without LoRA
        kept.append(copy.deepcopy(engines["full"].model).requires_grad_(False))

    def disable_adapters() -> None:  # what a LoRA actor's reference pass adds
        with adapters_disabled(engines["lora"].model):
            pass

    reference_bytes = {
        "full": peak_tensor_bytes(copy_reference),
        "lora": peak_tensor_bytes(disable_adapters),
    }
    resident = {
        "full": resident_bytes(engines["full"], kept[0]),
        "lora": resident_bytes(engines["lora"], None),
    }
    trainable = {
        name: sum(p.numel() for p in eng.model.parameters() if p.requires_grad)
        for name, eng in engines.items()
    }
    lengths = td["attention_mask"].sum(1).double()
    forward = decoder_flops(
        engines["full"].model,
        tokens=float(lengths.sum()),
        attended=float((lengths**2).sum()) / 2,
        backward=False,
    )
    flops = {"full": 3 * forward, "lora": 2 * forward}
    machine = matmul_peak()
    step_ratios = ratios(seconds["lora"], seconds["full"])
    cpu_ratios = ratios(cpu["lora"], cpu["full"])
    emit(
        {
            "benchmark": "lora",
            "model": "llama hidden 256, 4 layers, 4/2 heads, MLP 1024, vocab 512, float32",
            "lora_rank": args.rank,
            "rows": args.rows,
            "trainable_parameters": trainable,
            "update_s": {name: median(s) for name, s in seconds.items()},
            "update_time_ratio": median(step_ratios),
            "update_time_ratio_quartiles": quartiles(step_ratios),
            "update_cpu_s": {name: median(s) for name, s in cpu.items()},
            "update_cpu_time_ratio": median(cpu_ratios),
            "update_cpu_time_ratio_quartiles": quartiles(cpu_ratios),
            "update_gflop": {name: f / 1e9 for name, f in flops.items()},
            "matmul_peak_gflops": machine / 1e9,
            "mfu": {name: flops[name] / median(seconds[name]) / machine for name in engines},
            "update_peak_bytes": peak,
            "update_peak_ratio": peak["lora"] / peak["full"],
            "reference_bytes": reference_bytes,
            "resident_bytes": resident,
            "resident_ratio": resident["lora"] / resident["full"],
        }
    )


if __name__ == "__main__":
    main()
