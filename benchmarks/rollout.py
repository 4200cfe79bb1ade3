"""Rollout: generated tokens per second of ``Sampler`` against Hugging Face ``generate``.

The same randomly initialized Llama (built from a config, no download), the same
left-padded prompts, the same sampling settings — greedy, sampled at temperature 1, and
sampled with top-k 50 and top-p 0.9 — and the same EOS and maximum length. Both run the full batch until every
row has ended or the maximum length is reached; a row's generated tokens are those up to
and including its EOS. Greedy outputs must be identical (checked). The figure is the median
over repetitions of native / HF tokens per second, paired by repetition. Each also reports
its model FLOPs utilization: the useful FLOPs of the run (``generation_flops``) per second
over this machine's 1-thread float32 matmul peak (``common.matmul_peak``); decoding one
token per row at a time is bound by memory, not compute, so it is far below an update's.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from tensordict import TensorDict

from benchmarks.common import (
    emit,
    interleaved,
    matmul_peak,
    median,
    paired_ratio,
    quartiles,
    ratios,
)
from verlite.config import ModelConfig, load_config
from verlite.data import load_tokenizer, position_ids
from verlite.generation import KeyedNoise, Sampler, SamplingParams, StreamNoise, sample_keys
from verlite.memory import retain_freed_memory
from verlite.models import build_policy
from verlite.models.flops import decoder_flops

EOS, PAD = 2, 0
MAIN_JOB = "configs/ppo_tiny.yaml"


def prompts(batch: int, width: int, vocab: int, *, seed: int = 0) -> TensorDict:
    """Left-padded prompts of width/2..width tokens, in verlite's layout."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(width // 2, width + 1, (batch,), generator=gen)
    mask = (torch.arange(width) >= width - lengths[:, None]).long()
    ids = torch.randint(3, vocab, (batch, width), generator=gen) * mask
    return TensorDict(
        {
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": position_ids(mask),
        },
        batch_size=[batch],
    )


def response_lengths(responses: torch.Tensor) -> torch.Tensor:
    """Tokens of each row up to and including its first EOS (all of them when none)."""
    is_eos = responses == EOS
    return torch.where(is_eos.any(-1), is_eos.int().argmax(-1) + 1, responses.shape[1])


def hf_generate(model: torch.nn.Module, td: TensorDict, params: SamplingParams) -> torch.Tensor:
    """The new tokens of Hugging Face ``generate`` with the settings of ``params``."""
    sample = params.temperature > 0
    with torch.no_grad():
        out = model.generate(
            input_ids=td["input_ids"],
            attention_mask=td["attention_mask"],
            max_new_tokens=params.max_new_tokens,
            do_sample=sample,
            temperature=params.temperature if sample else None,
            top_k=params.top_k if sample else None,
            top_p=params.top_p if sample else None,
            eos_token_id=EOS,
            pad_token_id=PAD,
        )
    return out[:, td["input_ids"].shape[1] :]


def generation_flops(model: torch.nn.Module, td: TensorDict, generated: torch.Tensor) -> float:
    """The useful FLOPs of generating ``generated`` tokens per row after ``td``'s prompts
    (``verlite.models.flops.decoder_flops``): the prompts' causal prefill, then each new token attending
    to its prompt and the tokens before it. Rows that ended early count nothing after."""
    prompt = td["attention_mask"].sum(-1).double()
    new = generated.double()
    attended = prompt**2 / 2 + new * prompt + new * (new + 1) / 2
    return decoder_flops(
        model,
        tokens=float((prompt + new).sum()),
        attended=float(attended.sum()),
        backward=False,
    )


def compare(
    model: torch.nn.Module, td: TensorDict, params: SamplingParams, *, repeats: int, peak: float
) -> dict[str, Any]:
    """Tokens per second on ``td`` with ``params``, side by side: the native sampler with keyed
    noise (``rollout.randomness=per_sample``) and with a generator stream (``per_rank``, the
    draw before keyed noise), and Hugging Face ``generate``."""
    rollout = Sampler(model, eos_token_id=EOS, pad_token_id=PAD, lockstep=False)
    rows = len(td)
    if params.temperature == 0:
        ours = rollout.generate(td, params, None)["responses"]
        theirs = hf_generate(model, td, params)
        assert torch.equal(ours[:, : theirs.shape[1]], theirs), "greedy outputs differ"
    keys = sample_keys(0, 1, rows, 1)
    seconds, lengths = interleaved(
        {
            "keyed": lambda: response_lengths(
                rollout.generate(td, params, KeyedNoise(keys, horizon=params.max_new_tokens))[
                    "responses"
                ]
            ),
            "stream": lambda: response_lengths(
                rollout.generate(td, params, StreamNoise(0, rows, td.device))["responses"]
            ),
            "hf": lambda: response_lengths(hf_generate(model, td, params)),
        },
        repeats=repeats,
        warmup=1,
    )
    tokens = {
        k: [float(n.sum()) / s for n, s in zip(lengths[k], v, strict=True)]
        for k, v in seconds.items()
    }
    # The decode loop runs until its longest row ends: two noise sources draw different
    # samples, whose EOS may come at other steps, so they are compared per decode step.
    steps = {
        k: [float(n.max()) / s for n, s in zip(lengths[k], v, strict=True)]
        for k, v in seconds.items()
    }
    mfu = {
        k: [generation_flops(model, td, n) / s / peak for n, s in zip(lengths[k], v, strict=True)]
        for k, v in seconds.items()
    }
    return {
        "native_tokens_per_s": median(tokens["keyed"]),
        "hf_tokens_per_s": median(tokens["hf"]),
        "native_mfu": median(mfu["keyed"]),
        "hf_mfu": median(mfu["hf"]),
        "speedup": paired_ratio(tokens["keyed"], tokens["hf"]),
        "speedup_quartiles": quartiles(ratios(tokens["keyed"], tokens["hf"])),
        # decode steps per second with keyed noise against the generator stream it replaced
        "keyed_over_stream": paired_ratio(steps["keyed"], steps["stream"]),
        "keyed_over_stream_quartiles": quartiles(ratios(steps["keyed"], steps["stream"])),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--shapes", default="32x64,64x128", help="batch x new tokens, comma-separated"
    )
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    # One thread: torch's threads wait on each other at every op, so when other work shares
    # the cores a multi-threaded run slows erratically, a single thread proportionally.
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    retain_freed_memory()  # as every worker does
    peak = matmul_peak()
    shapes = [tuple(int(x) for x in shape.split("x")) for shape in args.shapes.split(",")]

    model_cfg = ModelConfig(
        hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=688
    )
    longest = args.prompt_len + max(new for _, new in shapes)
    model = build_policy(model_cfg, vocab_size=args.vocab, max_positions=longest, seed=0).eval()
    results = {}
    for batch, new_tokens in shapes:
        td = prompts(batch, args.prompt_len, args.vocab)
        settings = {
            "greedy": SamplingParams(new_tokens, temperature=0.0),
            "temperature": SamplingParams(new_tokens, temperature=1.0),
            "top_k_top_p": SamplingParams(new_tokens, temperature=1.0, top_k=50, top_p=0.9),
        }
        for name, params in settings.items():
            results[f"{name}_{batch}x{new_tokens}"] = compare(
                model, td, params, repeats=args.repeats, peak=peak
            )
    # The main job's generation (its model, prompts, batch and length), where a decode step
    # is shortest and the per-step cost of the noise weighs most.
    main_job = load_config(MAIN_JOB)
    main_vocab = len(load_tokenizer(main_job.model.path, task=main_job.data.task))
    main_model = build_policy(
        main_job.model,
        vocab_size=main_vocab,
        max_positions=main_job.max_sequence_length,
        seed=0,
    ).eval()
    batch, new_tokens = main_job.data.train_batch_size, main_job.rollout.max_response_length
    results[f"main_job_{batch}x{new_tokens}"] = compare(
        main_model,
        prompts(batch, main_job.data.max_prompt_length, main_vocab),
        SamplingParams(new_tokens, temperature=main_job.rollout.temperature),
        repeats=args.repeats * 4,
        peak=peak,
    )
    emit(
        {
            "benchmark": "rollout",
            "model": f"llama hidden 256, 4 layers, vocab {args.vocab}; main_job: {MAIN_JOB}'s",
            "prompt_len": args.prompt_len,
            "matmul_peak_gflops": peak / 1e9,
            "results": results,
            "min_speedup": min(r["speedup"] for r in results.values()),
            "min_keyed_over_stream": min(
                r["keyed_over_stream"] for name, r in results.items() if "greedy" not in name
            ),
            "goal": "speedup >= 1.0; keyed_over_stream >= 0.95 (sampled settings)",
        }
    )


if __name__ == "__main__":
    main()
