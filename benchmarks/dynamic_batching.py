"""Dynamic batching: update throughput and padding on a length-skewed batch.

One actor update (``TrainEngine.train_mini_batch``: forward, backward and optimizer step
over every micro-batch) of the same batch — sequence lengths 16..1024, long-tailed, most
rows short — split three ways at the same peak token budget B:

fixed   micro-batches of B // longest rows, so the worst micro-batch fits B padded tokens;
packed  token budget, token sums balanced (``cost="packed"``, the engine's partition today);
padded  token budget with rows of similar length together, rows x longest <= B
        (``cost="padded"``).

The engine's micro-batch planner calls ``partition_by_token_budget`` and
``count_token_budget_partitions``; for each variant both are set to that variant's cost in
this process, so every variant runs the unchanged engine. Throughput counts real tokens
(attention mask) per second of update; padding is the share of the tokens the model ran
on (each micro-batch trimmed to its own longest prompt and response, as the engine does)
that are padding. The losses of all variants must agree: grouping never changes the math.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from tensordict import TensorDict

import verlite.workers.engine as engine_module
from benchmarks.common import emit, interleaved, median, paired_ratio, quartiles, ratios
from verlite.batch import trim_padding
from verlite.config import ActorConfig, ModelConfig
from verlite.core import batching
from verlite.models import build_policy
from verlite.workers.engine import TrainEngine, plan_micro_batches
from verlite.workers.losses import ActorLossSettings, ppo_loss

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
    prompts = [rng.randint(*prompt_len) for _ in totals]
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


def use_cost(cost: str) -> None:
    """Point the engine's planner at partitions of this token cost, whatever cost it asks for."""
    for name in ("partition_by_token_budget", "count_token_budget_partitions"):
        setattr(engine_module, name, with_cost(getattr(batching, name), cost))


def with_cost(fn: Callable[..., Any], cost: str) -> Callable[..., Any]:
    return lambda *args, **kwargs: fn(*args, **{**kwargs, "cost": cost})


def padding_fraction(td: TensorDict, parts: list[list[int]]) -> float:
    """Padding share of the tokens the model runs on, each micro-batch trimmed as the engine does."""
    ran = sum(trim_padding(td[torch.tensor(p)])["attention_mask"].numel() for p in parts)
    return 1.0 - int(td["attention_mask"].sum()) / ran


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--budget", type=int, default=4 * LONGEST)
    parser.add_argument("--repeats", type=int, default=3)
    # One thread: torch's threads wait on each other at every op, so when other work shares
    # the cores a multi-threaded run slows erratically, a single thread proportionally.
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompt-min", type=int, default=8)
    parser.add_argument("--prompt-max", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    batch = skewed_batch(args.rows, seed=0, prompt_len=(args.prompt_min, args.prompt_max))
    model_cfg = ModelConfig(
        hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=256
    )
    base = ActorConfig(strategy="none", ppo_mini_batch_size=args.rows)
    configs = {
        "fixed": base.model_copy(update={"micro_batch_size_per_worker": args.budget // LONGEST}),
        "packed": base.model_copy(
            update={"use_dynamic_bsz": True, "max_token_len_per_worker": args.budget}
        ),
        "padded": base.model_copy(
            update={"use_dynamic_bsz": True, "max_token_len_per_worker": args.budget}
        ),
    }
    loss_fn = partial(ppo_loss, settings=ActorLossSettings.from_config(base))
    real_tokens = int(batch["attention_mask"].sum())

    # The token cost each variant's planner uses; fixed micro-batches never ask for one.
    costs = {"fixed": "packed", "packed": "packed", "padded": "padded"}
    engines, layouts, losses = {}, {}, {}
    for name, cfg in configs.items():
        use_cost(costs[name])
        policy = build_policy(model_cfg, vocab_size=VOCAB, max_positions=2 * LONGEST, seed=0)
        engines[name] = TrainEngine(policy, cfg=cfg, total_updates=100, metric_prefix="actor")
        parts, _ = plan_micro_batches(batch, cfg=cfg, device=torch.device("cpu"))
        layouts[name] = {
            "micro_batches": len(parts),
            "padding": padding_fraction(batch, parts),
            "peak_padded_tokens": max(
                trim_padding(batch[torch.tensor(p)])["attention_mask"].numel() for p in parts
            ),
        }

    def update(name: str) -> Callable[[], Any]:
        def run() -> Any:
            use_cost(costs[name])
            metrics = engines[name].train_mini_batch(batch.clone(), loss_fn)
            losses.setdefault(name, float(metrics["actor/pg_loss"].value))
            return metrics

        return run

    # The warm-up update is each engine's first, from the same weights: its losses compare.
    seconds, _ = interleaved(
        {name: update(name) for name in configs}, repeats=args.repeats, warmup=1
    )
    spread = max(losses.values()) - min(losses.values())
    assert spread <= 1e-5 * max(1.0, max(abs(v) for v in losses.values())), losses
    emit(
        {
            "benchmark": "dynamic_batching",
            "rows": args.rows,
            "real_tokens": real_tokens,
            "token_budget": args.budget,
            "fixed_micro_batch_size": args.budget // LONGEST,
            "layouts": layouts,
            "tokens_per_s": {name: real_tokens / median(s) for name, s in seconds.items()},
            "speedup_padded_vs_fixed": paired_ratio(seconds["fixed"], seconds["padded"]),
            "speedup_padded_vs_fixed_quartiles": quartiles(
                ratios(seconds["fixed"], seconds["padded"])
            ),
            "speedup_packed_vs_fixed": paired_ratio(seconds["fixed"], seconds["packed"]),
            "goal": "padded: padding <= 0.05 and speedup vs fixed >= 1.5",
        }
    )


if __name__ == "__main__":
    main()
