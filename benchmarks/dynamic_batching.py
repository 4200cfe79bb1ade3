"""Dynamic batching and packing: update throughput, padding and memory on a length-skewed
batch.

One actor update (``TrainEngine.train_mini_batch``: forward, backward and optimizer step
over every micro-batch) of the same batch — sequence lengths 16..1024, long-tailed, most
rows short — split three ways at the same peak token budget B:

fixed         micro-batches of B // longest rows, so the worst micro-batch fits B padded
              tokens;
token_budget  ``use_dynamic_bsz`` with ``max_token_len_per_worker`` = B: rows of similar
              length together, rows x (longest prompt + longest response) <= B;
packed        the same budget with ``packing``: each micro-batch one packed row of at most
              B real tokens, no padding.

Two batches: prompts of one length, and ragged prompts (8..64 tokens, so a short prompt's
row may carry the longest response and widen its micro-batch). Throughput counts real
tokens (attention mask) per second of update; padding is the share of the tokens the model
ran on (each micro-batch trimmed to its own longest prompt and response, as the engine
does) that are padding (none when packed). The losses of the layouts must agree: grouping
never changes the math.

Model FLOPs utilization: the FLOPs of an update over the real tokens
(``verlite.models.flops.decoder_flops``: 6 x the model's non-embedding parameters x tokens,
plus causal attention, 6 x layers x hidden x the sum of squared lengths) per second, as a
share of this machine's measured float32 matrix-multiply peak on the same thread count
(``benchmarks.common.matmul_peak``).
The packed cost fit: see :func:`fit_packed_cost`.
Peak memory: the most bytes of tensors live at once during an update of the layout (its
second), above those live when it began, from the allocations torch's profiler records:
exact and repeatable, unlike the resident set, which moves with the C allocator's caching.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from tensordict import TensorDict

from benchmarks.common import (
    add_repeats,
    emit,
    interleaved,
    matmul_peak,
    median,
    paired_ratio,
    peak_tensor_bytes,
    quartiles,
    ratios,
    update_batch,
)
from verlite.arguments import positive_int
from verlite.config import ActorConfig, ModelConfig
from verlite.memory import retain_freed_memory
from verlite.models import build_policy
from verlite.models.flops import decoder_flops
from verlite.models.packing_cost import flop_crossover, measure_packed_cost
from verlite.models.varlen import enable_packing
from verlite.step_batch import trim_padding
from verlite.workers.objectives import ActorLossSettings, ppo_loss
from verlite.workers.train_engine import TrainEngine

VOCAB = 512
LONGEST = 1024


def skewed_lengths(n: int, *, seed: int, shortest: int = 16, longest: int = LONGEST) -> list[int]:
    """Long-tailed lengths (Pareto, shape 1.2, from ``shortest``): most rows short, a few
    at the maximum."""
    rng = random.Random(seed)
    return [min(longest, int(shortest * rng.paretovariate(1.2))) for _ in range(n)]


def skewed_batch(n: int, *, seed: int, prompt_len: tuple[int, int]) -> TensorDict:
    """A step batch whose rows have the skewed total lengths; prompts of ``prompt_len`` tokens."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed + 1)
    totals = skewed_lengths(n, seed=seed)
    # Every row keeps at least one response token, as a generated response does.
    prompts = [min(rng.randint(*prompt_len), total - 1) for total in totals]
    prompt_width, width = max(prompts), max(t - p for t, p in zip(totals, prompts, strict=True))
    cols = torch.arange(prompt_width + width)
    p = torch.tensor(prompts)[:, None]
    r = torch.tensor(totals)[:, None] - p
    mask = (
        (cols < prompt_width) & (cols >= prompt_width - p)
        | (cols >= prompt_width) & (cols < prompt_width + r)
    ).long()
    ids = torch.randint(1, VOCAB, mask.shape, generator=gen) * mask
    return update_batch(ids, mask, prompt_width, gen=gen)


def padding_fraction(td: TensorDict, parts: Sequence[Sequence[int]]) -> float:
    """Padding share of the tokens the model runs on, each micro-batch trimmed as the engine does."""
    ran = sum(trim_padding(td[torch.tensor(p)])["attention_mask"].numel() for p in parts)
    return 1.0 - int(td["attention_mask"].sum()) / ran


MODEL = ModelConfig(
    hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=256
)


def layout_configs(base: ActorConfig, budget: int) -> dict[str, ActorConfig]:
    budgeted = base.model_copy(update={"use_dynamic_bsz": True, "max_token_len_per_worker": budget})
    return {
        "fixed": base.model_copy(update={"micro_batch_size_per_worker": budget // LONGEST}),
        "token_budget": budgeted,
        "packed": budgeted.model_copy(update={"packing": True}),
    }


def actor_engine(cfg: ActorConfig) -> TrainEngine:
    """The benchmark's actor engine for ``cfg``: the same initial weights every time."""
    policy = build_policy(MODEL, vocab_size=VOCAB, max_positions=2 * LONGEST, seed=0)
    return TrainEngine(policy, cfg=cfg, total_updates=100, metric_prefix="actor")


def update_flops(batch: TensorDict) -> float:
    """The FLOPs of one update over the batch's real tokens (``verlite.models.flops.decoder_flops``)."""
    lengths = batch["attention_mask"].sum(1).double()
    policy = build_policy(MODEL, vocab_size=VOCAB, max_positions=8, seed=0)
    return decoder_flops(
        policy,
        tokens=float(lengths.sum()),
        attended=float((lengths**2).sum()) / 2,
        backward=True,
    )


def compare(batch: TensorDict, *, budget: int, repeats: int, peak: float) -> dict[str, Any]:
    """The layouts of one batch, interleaved: their plans, tokens/s, MFU and the speedups."""
    rows = batch.batch_size[0]
    base = ActorConfig(strategy="none", ppo_mini_batch_size=rows)
    configs = layout_configs(base, budget)
    loss_fn = partial(ppo_loss, settings=ActorLossSettings.from_config(base))
    real_tokens = int(batch["attention_mask"].sum())
    engines, layouts, losses = {}, {}, {}
    for name, cfg in configs.items():
        engines[name] = actor_engine(cfg)
        parts = engines[name].plan(batch, training=True).parts
        packed = cfg.packing
        layouts[name] = {
            "micro_batches": len(parts),
            "padding": 0.0 if packed else padding_fraction(batch, parts),
            "peak_tokens_run": max(
                int(batch["attention_mask"][torch.tensor(p)].sum())
                if packed
                else trim_padding(batch[torch.tensor(p)])["attention_mask"].numel()
                for p in parts
            ),
        }

    def update(name: str) -> Callable[[], Any]:
        def run() -> Any:
            metrics = engines[name].train_mini_batch(batch.clone(), loss_fn)
            losses.setdefault(name, float(metrics["actor/pg_loss"].value))
            return metrics

        return run

    # The warm-up update is each engine's first, from the same weights: its losses compare.
    seconds, _ = interleaved({name: update(name) for name in configs}, repeats=repeats, warmup=1)
    spread = max(losses.values()) - min(losses.values())
    assert spread <= 1e-5 * max(1.0, max(abs(v) for v in losses.values())), losses
    flops = update_flops(batch)
    return {
        "real_tokens": real_tokens,
        "update_gflop": flops / 1e9,
        "layouts": layouts,
        "tokens_per_s": {name: real_tokens / median(s) for name, s in seconds.items()},
        "mfu": {name: flops / median(s) / peak for name, s in seconds.items()},
        "speedup": paired_ratio(seconds["fixed"], seconds["token_budget"]),
        "speedup_quartiles": quartiles(ratios(seconds["fixed"], seconds["token_budget"])),
        "packed_vs_token_budget": paired_ratio(seconds["token_budget"], seconds["packed"]),
        "packed_vs_token_budget_quartiles": quartiles(
            ratios(seconds["token_budget"], seconds["packed"])
        ),
        "packed_vs_fixed": paired_ratio(seconds["fixed"], seconds["packed"]),
        "packed_vs_fixed_quartiles": quartiles(ratios(seconds["fixed"], seconds["packed"])),
    }


def fit_packed_cost(trials: int = 40) -> dict[str, float]:
    """What a packed row's forward and backward cost on this machine
    (``models.packing_cost``, as ``verlite measure-packing`` measures it): rows of up to the
    budget's 4,096 tokens, fitted as a x tokens + b x sum of squared lengths + c. Its
    crossover a / b against the FLOP count's (``models.packing_cost.flop_crossover``), which
    the DP shares of packed roles use unless ``model.attention_crossover`` is set."""
    policy = build_policy(MODEL, vocab_size=VOCAB, max_positions=2 * LONGEST, seed=0)
    enable_packing(policy)
    cost = measure_packed_cost(
        policy,
        precision="fp32",
        vocab_size=VOCAB,
        longest=LONGEST,
        budget=4 * LONGEST,
        trials=trials,
    )
    return {
        "us_per_token": cost.per_token * 1e6,
        "ns_per_squared_token": cost.per_squared_token * 1e9,
        "ns_per_squared_token_error": cost.per_squared_token_error * 1e9,
        "r_squared": cost.r_squared,
        "r_squared_tokens_only": cost.r_squared_tokens_only,
        "measured_crossover": cost.crossover,
        "flop_model_crossover": flop_crossover(MODEL),
    }


def update_memory(batch: TensorDict, budget: int) -> dict[str, int]:
    """Each layout's peak tensor memory during an update (its second: the first has built
    the optimizer's state), above what was live when it began (``common.peak_tensor_bytes``)."""
    rows = batch.batch_size[0]
    configs = layout_configs(ActorConfig(strategy="none", ppo_mini_batch_size=rows), budget)
    out = {}
    for layout, cfg in configs.items():
        engine = actor_engine(cfg)
        loss_fn = partial(ppo_loss, settings=ActorLossSettings.from_config(cfg))
        engine.train_mini_batch(batch.clone(), loss_fn)
        out[layout] = peak_tensor_bytes(partial(engine.train_mini_batch, batch.clone(), loss_fn))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=positive_int, default=128)
    parser.add_argument("--budget", type=positive_int, default=4 * LONGEST)
    add_repeats(parser, 3)
    # One thread: torch's threads wait on each other at every op, so when other work shares
    # the cores a multi-threaded run slows erratically, a single thread proportionally.
    parser.add_argument("--threads", type=positive_int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    retain_freed_memory()  # as every worker does
    peak = matmul_peak()
    prompts = {"one_prompt_length": (8, 8), "ragged_prompts": (8, 64)}
    results = {}
    for name, span in prompts.items():
        batch = skewed_batch(args.rows, seed=0, prompt_len=span)
        results[name] = compare(batch, budget=args.budget, repeats=args.repeats, peak=peak)
        results[name]["peak_memory_bytes"] = update_memory(batch, args.budget)
    cost = fit_packed_cost()
    emit(
        {
            "benchmark": "dynamic_batching",
            "packed_cost_fit": cost,
            "rows": args.rows,
            "token_budget": args.budget,
            "fixed_micro_batch_size": args.budget // LONGEST,
            "prompt_lengths": prompts,
            "matmul_peak_gflops": peak / 1e9,
            "results": results,
            "max_padding": max(r["layouts"]["token_budget"]["padding"] for r in results.values()),
            "min_speedup": min(r["speedup"] for r in results.values()),
            "min_packed_vs_token_budget": min(
                r["packed_vs_token_budget"] for r in results.values()
            ),
            "min_packed_vs_fixed": min(r["packed_vs_fixed"] for r in results.values()),
            "goal": "token_budget: padding <= 0.05 and speedup vs fixed >= 1.5; packed: "
            ">= 1.5x token_budget, >= 3x fixed, memory <= fixed's (the same tokens a micro-batch)",
        }
    )


if __name__ == "__main__":
    main()
