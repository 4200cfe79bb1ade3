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
(``benchmarks.common.decoder_flops``: 6 x the model's non-embedding parameters x tokens,
plus causal attention, 6 x layers x hidden x the sum of squared lengths) per second, as a
share of this machine's measured float32 matrix-multiply peak on the same thread count
(``benchmarks.common.matmul_peak``).
The packed cost fit: see :func:`fit_packed_cost`.
Peak memory: the resident set of a fresh process at the peak of an update of the layout
(its second; Linux's high-water mark reset in between), above what it held before.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from tensordict import TensorDict

from benchmarks.common import (
    decoder_flops,
    emit,
    interleaved,
    matmul_peak,
    median,
    paired_ratio,
    quartiles,
    ratios,
    time_call,
)
from verlite.config import ActorConfig, ModelConfig
from verlite.core.losses import GlobalCounts
from verlite.memory import retain_freed_memory
from verlite.models import attention_crossover, build_policy
from verlite.step_batch import stamp_counts, trim_padding
from verlite.workers.engine import TrainEngine, micro_batch
from verlite.workers.objectives import ActorLossSettings, ppo_loss

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
    response_mask = mask[:, prompt_width:].clone()
    td = TensorDict(
        {
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": (mask.cumsum(-1) - 1).clamp(min=0) * mask,
            "responses": ids[:, prompt_width:],
            "response_mask": response_mask,
            "advantages": torch.randn(n, width, generator=gen),
            # Old log-probs near a uniform policy's, so ratios stay finite.
            "old_log_probs": torch.full((n, width), -6.2) * response_mask,
        },
        batch_size=[n],
    )
    td.set_non_tensor("temperature", 1.0)
    return td


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


def update_flops(batch: TensorDict) -> float:
    """The FLOPs of one update over the batch's real tokens (``common.decoder_flops``)."""
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
    model_cfg = MODEL
    rows = batch.batch_size[0]
    base = ActorConfig(strategy="none", ppo_mini_batch_size=rows)
    configs = layout_configs(base, budget)
    loss_fn = partial(ppo_loss, settings=ActorLossSettings.from_config(base))
    real_tokens = int(batch["attention_mask"].sum())
    engines, layouts, losses = {}, {}, {}
    for name, cfg in configs.items():
        policy = build_policy(model_cfg, vocab_size=VOCAB, max_positions=2 * LONGEST, seed=0)
        engines[name] = TrainEngine(policy, cfg=cfg, total_updates=100, metric_prefix="actor")
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


def fit_packed_cost(trials: int = 40, seed: int = 3) -> dict[str, float]:
    """What a packed micro-batch's update costs, measured: forward and backward of packed
    rows of 1,500..4,000 tokens drawn from short, long and mixed sequences, fitted by least
    squares as a x tokens + b x sum of squared lengths + c. Its crossover a / b is the length
    at which attention costs what the weights do, against the FLOP model's
    (``models.attention_crossover``), which the DP shares of packed roles use."""
    batch = skewed_batch(256, seed=seed, prompt_len=(8, 64))
    cfg = ActorConfig(strategy="none", ppo_mini_batch_size=256, packing=True)
    policy = build_policy(MODEL, vocab_size=VOCAB, max_positions=2 * LONGEST, seed=0)
    engine = TrainEngine(policy, cfg=cfg, total_updates=100, metric_prefix="actor")
    loss_fn = partial(ppo_loss, settings=ActorLossSettings.from_config(cfg))
    lengths = batch["attention_mask"].sum(1).tolist()
    by_length = sorted(range(len(lengths)), key=lambda i: lengths[i])
    pools = [by_length[:160], by_length[100:230], by_length[200:], by_length]
    rng = random.Random(seed)
    rows_x, times = [], []
    for trial in range(trials):
        pool = list(pools[trial % len(pools)])
        rng.shuffle(pool)
        target, rows, total = rng.randint(1500, 4000), [], 0
        for i in pool:
            if total + lengths[i] <= target:
                rows.append(i)
                total += lengths[i]
        micro = micro_batch(batch, sorted(rows), device=torch.device("cpu"), packing=True)
        stamp_counts(micro, GlobalCounts(1, int(micro["response_mask"].sum()), len(rows)))

        def update(micro: TensorDict = micro) -> None:
            loss, _ = loss_fn(engine.model, micro)
            loss.backward()
            engine.model.zero_grad(set_to_none=True)

        update()
        times.append(min(time_call(update)[0] for _ in range(3)))
        squares = sum(lengths[i] ** 2 for i in rows)
        rows_x.append([float(total), float(squares), 1.0])
    x = torch.tensor(rows_x, dtype=torch.float64)
    y = torch.tensor(times, dtype=torch.float64)[:, None]

    def r_squared(columns: list[int]) -> tuple[torch.Tensor, float]:
        coef = torch.linalg.lstsq(x[:, columns], y).solution
        residual = float(((y - x[:, columns] @ coef) ** 2).sum())
        return coef[:, 0], 1.0 - residual / float(((y - y.mean()) ** 2).sum())

    coef, fit = r_squared([0, 1, 2])
    _, tokens_only = r_squared([0, 2])
    return {
        "us_per_token": float(coef[0]) * 1e6,
        "ns_per_squared_token": float(coef[1]) * 1e9,
        "r_squared": fit,
        "r_squared_tokens_only": tokens_only,
        "measured_crossover": float(coef[0] / coef[1]),
        "flop_model_crossover": attention_crossover(MODEL),
    }


def one_update_memory(prompts: tuple[int, int], layout: str, rows: int, budget: int) -> int:
    """Bytes of resident memory an update of ``layout`` adds at its peak, in this (fresh)
    process: a first update warms up (the optimizer's state, the allocator's pools), the
    kernel's high-water mark is reset, and the second update's peak is read."""
    batch = skewed_batch(rows, seed=0, prompt_len=prompts)
    cfg = layout_configs(ActorConfig(strategy="none", ppo_mini_batch_size=rows), budget)[layout]
    policy = build_policy(MODEL, vocab_size=VOCAB, max_positions=2 * LONGEST, seed=0)
    engine = TrainEngine(policy, cfg=cfg, total_updates=100, metric_prefix="actor")
    loss_fn = partial(ppo_loss, settings=ActorLossSettings.from_config(cfg))
    engine.train_mini_batch(batch.clone(), loss_fn)
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # resets VmHWM to the current resident set
    before = _status_kib("VmRSS")
    engine.train_mini_batch(batch.clone(), loss_fn)
    return (_status_kib("VmHWM") - before) * 1024


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(f"{field}:"))
    return int(line.split()[1])


def measure_memory(
    prompts: tuple[int, int], rows: int, budget: int, threads: int
) -> dict[str, int]:
    """Each layout's :func:`one_update_memory`, each in a fresh process."""
    out = {}
    for layout in ("fixed", "token_budget", "packed"):
        code = (
            "import torch, benchmarks.dynamic_batching as b; "
            f"torch.set_num_threads({threads}); "
            f"print(b.one_update_memory({prompts!r}, {layout!r}, {rows}, {budget}))"
        )
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        )
        out[layout] = int(done.stdout.split()[-1])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--budget", type=int, default=4 * LONGEST)
    parser.add_argument("--repeats", type=int, default=3)
    # One thread: torch's threads wait on each other at every op, so when other work shares
    # the cores a multi-threaded run slows erratically, a single thread proportionally.
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    retain_freed_memory()  # as every worker does
    peak = matmul_peak()
    prompts = {"one_prompt_length": (8, 8), "ragged_prompts": (8, 64)}
    results = {}
    for name, span in prompts.items():
        batch = skewed_batch(args.rows, seed=0, prompt_len=span)
        results[name] = compare(batch, budget=args.budget, repeats=args.repeats, peak=peak)
        results[name]["peak_memory_bytes"] = measure_memory(
            span, args.rows, args.budget, args.threads
        )
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
            ">= 1.5x token_budget, >= 3x fixed, memory <= token_budget's",
        }
    )


if __name__ == "__main__":
    main()
