"""Multi-turn rollouts: the cost of turn boundaries.

The same randomly initialized Llama (hidden 256, 4 layers) and the same 32 left-padded
prompts of 16..32 tokens, ways to produce trajectories of the same total length:

single_turn  one generation of T = turns x turn + (turns - 1) x observation new tokens;
multi_turn   ``generate_multi_turn``: ``turns`` policy turns of ``turn`` tokens each, an
             environment answering each of the first ``turns - 1`` with an observation of
             ``observation`` tokens (appended as tokens, not sampled); every turn prefills
             each trajectory's whole sequence again, the cost this measures. The
             environment (``verlite.envs.Session``s on ``--env-threads`` threads, as
             ``rollout.multi_turn.env_threads``) takes ``--tool-latency-s`` a step and
             ``--reset-latency-s`` a ``reset`` (its sessions opened for each run);
multi_turn_one_thread  with either latency above 0, the same on one thread: its calls one
             after another, as every worker made them before a turn started all its steps
             (and a step all its resets) before waiting for any.
             ``concurrent_over_serial_time``: multi_turn / multi_turn_one_thread wall time.

Both sample at temperature 1 with keyed noise and never stop early (no token ends a row),
so both hold exactly T response tokens a row. The figure: multi_turn / single_turn wall
time, the median over interleaved repetitions with quartiles, and each variant's
trajectory tokens per second. MFU counts the useful FLOPs of the trajectories (each token
through the model once: ``benchmarks.rollout.generation_flops``) over this machine's
1-thread float32 matmul peak.
"""

from __future__ import annotations

import argparse
import time

import torch
from tensordict import TensorDict

from benchmarks.common import (
    add_repeats,
    emit,
    interleaved,
    matmul_peak,
    median,
    paired_ratio,
    quartiles,
    ratios,
)
from benchmarks.rollout import generation_flops, prompts
from verlite.arguments import non_negative_float, positive_int
from verlite.config import ModelConfig
from verlite.data import load_tokenizer
from verlite.data.files import PromptRecord
from verlite.envs import AbandonedCalls, SessionThreads, open_sessions
from verlite.envs.base import Turn
from verlite.generation import KeyedNoise, Sampler, SamplingParams, sample_keys
from verlite.generation.multi_turn import TurnLimits, generate_multi_turn
from verlite.generation.noise import turn_keys
from verlite.memory import retain_freed_memory
from verlite.models import build_policy

MODEL = ModelConfig(
    hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=512
)
NEVER = -1  # an end-of-sequence id no token has: rows run to their length


class FixedObservation:
    """Answers every turn with the record's observation after ``latency_s``, reset after
    ``reset_latency_s``; never done."""

    latency_s = 0.0
    reset_latency_s = 0.0

    def reset(self, record: dict[str, str]) -> None:
        time.sleep(self.reset_latency_s)
        self.observation = record["answer"]

    def step(self, action: str) -> Turn:
        time.sleep(self.latency_s)
        return Turn(self.observation, 0.0, False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=positive_int, default=32)
    parser.add_argument("--turns", type=positive_int, default=4)
    parser.add_argument("--turn", type=positive_int, default=16, help="tokens of a policy turn")
    parser.add_argument(
        "--observation", type=positive_int, default=8, help="tokens of an observation"
    )
    add_repeats(parser, 7)
    parser.add_argument(
        "--tool-latency-s",
        type=non_negative_float,
        default=0.0,
        help="seconds an environment step takes",
    )
    parser.add_argument(
        "--reset-latency-s",
        type=non_negative_float,
        default=0.0,
        help="seconds an environment reset takes",
    )
    parser.add_argument("--env-threads", type=positive_int, default=32, help="threads of the steps")
    args = parser.parse_args()
    FixedObservation.latency_s = args.tool_latency_s
    FixedObservation.reset_latency_s = args.reset_latency_s
    torch.set_num_threads(1)
    retain_freed_memory()
    tokenizer = load_tokenizer(None, task="lookup")
    observation = "=" + "1234567890" * (args.observation // 10 + 1)
    observation = observation[: args.observation]
    assert len(tokenizer.encode(observation, add_special_tokens=False)) == args.observation
    total = args.turns * args.turn + (args.turns - 1) * args.observation
    model = build_policy(MODEL, vocab_size=len(tokenizer), max_positions=256, seed=0)
    sampler = Sampler(
        model, eos_token_id=NEVER, pad_token_id=tokenizer.pad_token_id, lockstep=False
    )
    td = prompts(args.rows, 32, len(tokenizer))
    td["uid"] = torch.arange(args.rows)
    td["sample_key"] = sample_keys(0, 1, args.rows, 1)

    def generate(batch: TensorDict, turn: int, max_new_tokens: int) -> TensorDict:
        params = SamplingParams(max_new_tokens=max_new_tokens)
        noise = KeyedNoise(turn_keys(batch["sample_key"], turn), horizon=max_new_tokens)
        return sampler.generate(batch, params, noise)

    limits = TurnLimits(
        max_turns=args.turns,
        width=total,
        turn_tokens=args.turn,
        end_token_ids=(),  # no token ends a trajectory
        pad_token_id=tokenizer.pad_token_id,
    )

    # One pool per thread count for every repetition, as a worker keeps one for its run: a
    # pool's threads wait for the next step's sessions, so a pool per run left them behind.
    pools = {n: SessionThreads(n, AbandonedCalls(0)) for n in {args.env_threads, 1}}

    def multi_turn(env_threads: int) -> TensorDict:
        threads = pools[env_threads]
        record = PromptRecord(prompt="", answer=observation)
        sessions = open_sessions(
            FixedObservation,
            [record] * args.rows,
            indices=range(args.rows),
            timeout_s=600,
            threads=threads,
        )
        try:
            return generate_multi_turn(generate, td, sessions, tokenizer, limits)
        finally:
            for session in sessions:
                session.close()

    variants = {
        "single_turn": lambda: generate(td, 0, total),
        "multi_turn": lambda: multi_turn(args.env_threads),
    }
    if args.tool_latency_s > 0 or args.reset_latency_s > 0:
        variants["multi_turn_one_thread"] = lambda: multi_turn(1)
    seconds, results = interleaved(variants, repeats=args.repeats)
    for name, result in results.items():
        held = result[0]["attention_mask"][:, -total:].sum(-1)
        assert bool((held == total).all()), (name, held)
    peak = matmul_peak()
    flops = generation_flops(model, td, torch.full((args.rows,), float(total)))
    tokens = args.rows * total
    serial = seconds.get("multi_turn_one_thread")
    emit(
        {
            "benchmark": "multi_turn",
            "rows": args.rows,
            "turns": args.turns,
            "turn_tokens": args.turn,
            "observation_tokens": args.observation,
            "tool_latency_s": args.tool_latency_s,
            "reset_latency_s": args.reset_latency_s,
            "env_threads": args.env_threads,
            "trajectory_tokens": total,
            "tokens_per_s": {name: tokens / median(s) for name, s in seconds.items()},
            "mfu": {name: flops / median(s) / peak for name, s in seconds.items()},
            "matmul_peak_gflops": peak / 1e9,
            "multi_over_single_time": paired_ratio(seconds["multi_turn"], seconds["single_turn"]),
            "quartiles": quartiles(ratios(seconds["multi_turn"], seconds["single_turn"])),
            **(
                {}
                if serial is None
                else {
                    "concurrent_over_serial_time": paired_ratio(seconds["multi_turn"], serial),
                    "concurrent_over_serial_quartiles": quartiles(
                        ratios(seconds["multi_turn"], serial)
                    ),
                }
            ),
            "goal": "measure: the cost of turn boundaries",
        }
    )


if __name__ == "__main__":
    main()
