"""What every benchmark shares: side-by-side timing, medians, ratios and the JSON it prints.

Every figure a benchmark reports is a ratio of two variants measured in the same process,
interleaved repetition by repetition, so a slower or busier machine moves both sides alike.
Absolute times are printed for reading only; nothing asserts them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from tensordict import TensorDict

from verlite.arguments import positive_int
from verlite.config import Config
from verlite.config.derived import old_log_probs_source
from verlite.data import position_ids
from verlite.models import build_policy, build_value_model
from verlite.models.flops import decoder_flops


def add_repeats(parser: argparse.ArgumentParser, default: int) -> None:
    """``--repeats``: the interleaved repetitions of each variant, at least two (the
    quartiles every benchmark reports need two; one is refused in a line, not a traceback)."""

    def repetitions(text: str) -> int:
        if positive_int(text) < 2:
            raise argparse.ArgumentTypeError(f"expected at least 2 (quartiles), got {text!r}")
        return int(text)

    parser.add_argument(
        "--repeats",
        type=repetitions,
        default=default,
        help=f"interleaved repetitions of each variant, at least 2 (default {default})",
    )


def time_call(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Wall time of one call and its result."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def interleaved(
    variants: Mapping[str, Callable[[], Any]], *, repeats: int, warmup: int = 1
) -> tuple[dict[str, list[float]], dict[str, list[Any]]]:
    """Seconds and result of each variant per repetition, the variants taking turns within a
    repetition (so drift in the machine's load spreads over all of them) in an order that
    reverses every repetition (so neither always runs right after the other); warm-up calls
    are not kept."""
    for _ in range(warmup):
        for fn in variants.values():
            fn()
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    results: dict[str, list[Any]] = {name: [] for name in variants}
    names = list(variants)
    for repeat in range(repeats):
        for name in names if repeat % 2 == 0 else reversed(names):
            elapsed, result = time_call(variants[name])
            seconds[name].append(elapsed)
            results[name].append(result)
    return seconds, results


def median(values: list[float]) -> float:
    return float(statistics.median(values))


def paired_ratio(numerator: list[float], denominator: list[float]) -> float:
    """Median over repetitions of numerator / denominator, pairing the same repetition."""
    return median(ratios(numerator, denominator))


def ratios(numerator: list[float], denominator: list[float]) -> list[float]:
    return [a / b for a, b in zip(numerator, denominator, strict=True)]


def quartiles(values: list[float]) -> list[float]:
    """First and third quartiles: how far repetitions spread around the median."""
    q1, _, q3 = statistics.quantiles(values, n=4)
    return [q1, q3]


def rounded(value: Any, digits: int = 4) -> Any:
    """Floats rounded to ``digits`` significant digits, recursively, for readable JSON."""
    if isinstance(value, float):
        return float(f"{value:.{digits}g}")
    if isinstance(value, dict):
        return {k: rounded(v, digits) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [rounded(v, digits) for v in value]
    return value


def emit(result: Mapping[str, Any]) -> None:
    """Print the benchmark's one JSON object as the last line of stdout (Ray may print
    worker logs before it; ``benchmarks.run_all`` reads the last line)."""
    print(json.dumps(rounded(dict(result))), flush=True)


def matmul_peak(*, size: int = 1024, repeats: int = 20) -> float:
    """This machine's float32 matrix-multiply FLOP/s on torch's current thread count: the
    best of ``repeats`` products of two ``size`` x ``size`` matrices (2 size^3 FLOPs each)."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b  # warm-up
    best = min(time_call(lambda: a @ b)[0] for _ in range(repeats))
    return 2.0 * size**3 / best


def peak_tensor_bytes(fn: Callable[[], Any]) -> int:
    """The most bytes of CPU tensors that ``fn`` holds live at once, above those live when it
    starts: the running sum of the allocations and frees torch's profiler records."""
    activity = torch.profiler.ProfilerActivity.CPU
    with torch.profiler.profile(activities=[activity], profile_memory=True) as profile:
        fn()
    changes = sorted(
        (event.start_ns(), event.nbytes())
        for event in profile.profiler.kineto_results.events()
        if event.name() == "[memory]" and event.device_type() == torch.autograd.DeviceType.CPU
    )
    live = peak = 0
    for _, nbytes in changes:
        live += nbytes
        peak = max(peak, live)
    return peak


def machine_peak() -> float:
    """:func:`matmul_peak` with a thread per core: the most this whole machine multiplies."""
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        return matmul_peak()
    finally:
        torch.set_num_threads(threads)


def rl_step_flops(cfg: Config, *, vocab_size: int) -> Callable[[float], float]:
    """The FLOPs of one RL step of ``cfg`` (past the critic's warm-up) as a function of the
    real tokens its batch holds over data.train_batch_size x rollout.n rows (the models are
    built once), counted as :func:`~verlite.models.flops.decoder_flops` counts a pass over every row: the policy's
    forward passes for generation (1), the old log-probs (1 when the actor recomputes them),
    the reference's log-probs (1 with a reference) and its update (3 per actor.ppo_epochs);
    with a critic, its values (1) and update (3 per critic.ppo_epochs). Attention is counted
    from the rows' mean length (a lower bound: the spread of lengths adds to it; at these
    benchmarks' lengths, far below their models' attention crossover, it is a small share)."""
    rows = cfg.data.train_batch_size * cfg.rollout.n
    recompute, _ = old_log_probs_source(cfg)
    build = {"vocab_size": vocab_size, "max_positions": cfg.max_sequence_length, "seed": 0}
    policy_passes = 1 + int(recompute) + int(cfg.use_reference) + 3 * cfg.actor.ppo_epochs
    passes = [(build_policy(cfg.model, **build), policy_passes)]
    if cfg.use_critic:
        passes.append((build_value_model(cfg.model, **build), 1 + 3 * cfg.critic.ppo_epochs))

    def count(tokens: float) -> float:
        attended = rows * (tokens / rows) ** 2 / 2
        return sum(
            n * decoder_flops(model, tokens=tokens, attended=attended, backward=False)
            for model, n in passes
        )

    return count


def update_batch(
    ids: torch.Tensor, mask: torch.Tensor, prompt_width: int, *, gen: torch.Generator
) -> TensorDict:
    """An actor update's batch over token ``ids`` (real where ``mask`` is 1; responses from
    column ``prompt_width``): advantages drawn from ``gen``, old log-probs near a uniform
    policy's, so that ratios stay finite."""
    rows, width = ids.shape[0], ids.shape[1] - prompt_width
    response_mask = mask[:, prompt_width:].clone()
    td = TensorDict(
        {
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": position_ids(mask),
            "responses": ids[:, prompt_width:],
            "response_mask": response_mask,
            "advantages": torch.randn(rows, width, generator=gen),
            "old_log_probs": torch.full((rows, width), -6.2) * response_mask,
        },
        batch_size=[rows],
    )
    td.set_non_tensor("temperature", 1.0)
    return td
