"""Dynamic batching: update throughput and padding on a length-skewed batch.

One actor update (``TrainEngine.train_mini_batch``: forward, backward and optimizer step
over every micro-batch) of the same batch — sequence lengths 16..1024, long-tailed, most
rows short — split two ways at the same peak token budget B:

fixed         micro-batches of B // longest rows, so the worst micro-batch fits B padded
              tokens;
token_budget  ``use_dynamic_bsz`` with ``max_token_len_per_worker`` = B: rows of similar
              length together, rows x (longest prompt + longest response) <= B.

Two batches: prompts of one length, and ragged prompts (8..64 tokens, so a short prompt's
row may carry the longest response and widen its micro-batch). Throughput counts real
tokens (attention mask) per second of update; padding is the share of the tokens the model
ran on (each micro-batch trimmed to its own longest prompt and response, as the engine
does) that are padding. The losses of both layouts must agree: grouping never changes the
math.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from tensordict import TensorDict

from benchmarks.common import emit, interleaved, median, paired_ratio, quartiles, ratios
from verlite.config import ActorConfig, ModelConfig
from verlite.memory import retain_freed_memory
from verlite.models import build_policy
from verlite.step_batch import trim_padding
from verlite.workers.engine import TrainEngine
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


def compare(batch: TensorDict, *, budget: int, repeats: int) -> dict[str, Any]:
    """Both layouts of one batch, interleaved: their plans, tokens/s and the speedup."""
    model_cfg = ModelConfig(
        hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=256
    )
    rows = batch.batch_size[0]
    base = ActorConfig(strategy="none", ppo_mini_batch_size=rows)
    configs = {
        "fixed": base.model_copy(update={"micro_batch_size_per_worker": budget // LONGEST}),
        "token_budget": base.model_copy(
            update={"use_dynamic_bsz": True, "max_token_len_per_worker": budget}
        ),
    }
    loss_fn = partial(ppo_loss, settings=ActorLossSettings.from_config(base))
    real_tokens = int(batch["attention_mask"].sum())
    engines, layouts, losses = {}, {}, {}
    for name, cfg in configs.items():
        policy = build_policy(model_cfg, vocab_size=VOCAB, max_positions=2 * LONGEST, seed=0)
        engines[name] = TrainEngine(policy, cfg=cfg, total_updates=100, metric_prefix="actor")
        parts = engines[name].plan(batch, training=True).parts
        layouts[name] = {
            "micro_batches": len(parts),
            "padding": padding_fraction(batch, parts),
            "peak_padded_tokens": max(
                trim_padding(batch[torch.tensor(p)])["attention_mask"].numel() for p in parts
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
    return {
        "real_tokens": real_tokens,
        "layouts": layouts,
        "tokens_per_s": {name: real_tokens / median(s) for name, s in seconds.items()},
        "speedup": paired_ratio(seconds["fixed"], seconds["token_budget"]),
        "speedup_quartiles": quartiles(ratios(seconds["fixed"], seconds["token_budget"])),
    }


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
    prompts = {"one_prompt_length": (8, 8), "ragged_prompts": (8, 64)}
    results = {
        name: compare(
            skewed_batch(args.rows, seed=0, prompt_len=span),
            budget=args.budget,
            repeats=args.repeats,
        )
        for name, span in prompts.items()
    }
    emit(
        {
            "benchmark": "dynamic_batching",
            "rows": args.rows,
            "token_budget": args.budget,
            "fixed_micro_batch_size": args.budget // LONGEST,
            "prompt_lengths": prompts,
            "results": results,
            "max_padding": max(r["layouts"]["token_budget"]["padding"] for r in results.values()),
            "min_speedup": min(r["speedup"] for r in results.values()),
            "goal": "token_budget: padding <= 0.05 and speedup vs fixed >= 1.5",
        }
    )


if __name__ == "__main__":
    main()
