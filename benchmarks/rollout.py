"""Rollout: generated tokens per second of ``Sampler`` against Hugging Face ``generate``.

Two comparisons. ``--compare noise`` (the default on CPU, what ``make bench`` runs): the
same randomly initialized Llama (built from a config, no download), the same left-padded
prompts, the same sampling settings — greedy, sampled at temperature 1, and sampled with
top-k 50 and top-p 0.9 — and the same EOS and maximum length. Both run the full batch until every
row has ended or the maximum length is reached; a row's generated tokens are those up to
and including its EOS. Greedy outputs must be identical (checked). The figure is the median
over repetitions of native / HF tokens per second, paired by repetition. Each also reports
its model FLOPs utilization: the useful FLOPs of the run (``generation_flops``) per second
over this machine's 1-thread float32 matmul peak (``common.matmul_peak``); decoding one
token per row at a time is bound by memory, not compute, so it is far below an update's.

``--compare decode`` (the default with ``--device cuda``; issue 36): the decode engines side by
side on a Qwen2-0.5B-shaped random policy (hidden 896, 24 layers, 14 / 2 heads, MLP 4864,
vocab 32,000, untied head: 0.42B parameters; ``--shape tiny`` for a tiny one) stored as a
rollout worker stores it (``verlite.models.precision.store_for_inference`` under bf16-mixed:
linear layers bf16, embeddings and norms fp32) and run under bf16 autocast as it runs it:
256 and 64 left-padded prompts of 32-64 tokens, 256 new tokens at temperature 1 with
``ignore_eos`` (Hugging Face: ``eos_token_id=None``), so every row generates every token.
Variants, interleaved (``common.interleaved``; median and quartiles): the native sampler in
``rollout.decode`` cuda_graphs (static on CPU, where graphs do not exist), in eager (the
sampler before issue 36) and Hugging Face ``generate``; tokens/s, the ratios native / eager
and native / HF, and the share of the roofline: per decode step, every weight but the input
embedding (a lookup) in the bytes they are stored in, plus the KV cache filled so far (per
layer 2 x KV heads x head dim x 2 bytes x each row's real prompt + the tokens generated,
averaged over the steps), read at the GPU's HBM bandwidth, or 2 x dense parameters x rows
FLOPs at its dense bf16 peak (``verlite.models.flops``), whichever takes longer. A profile
(``torch.profiler``) says what bounds a decode step of each native mode: the GPU's busy time
(kernels and copies, their intervals merged) over the step's wall time, both per step as the
difference between a short and a longer generation (so prefill and set-up cancel out), the
wall time measured without the profiler. A variant that fails (graphs that cannot be
captured) is reported under ``errors`` and the rest still run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable
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
    quartiles,
    ratios,
)
from verlite.arguments import positive_int
from verlite.config import ModelConfig, load_config
from verlite.data import load_tokenizer, position_ids
from verlite.generation import (
    DecodeSettings,
    KeyedNoise,
    Sampler,
    SamplingParams,
    StreamNoise,
    sample_keys,
)
from verlite.memory import retain_freed_memory
from verlite.models import build_policy
from verlite.models.flops import DecoderShape, bf16_peak_flops, decoder_flops, hbm_bandwidth
from verlite.models.precision import autocast, store_for_inference
from verlite.workers.forward import response_log_probs

EOS, PAD = 2, 0
MAIN_JOB = "configs/ppo_tiny.yaml"
# --compare decode: the policy's shapes (``--shape``) and its vocabulary.
DECODE_SHAPES = {
    "qwen2-0.5b": (
        ModelConfig(
            arch="qwen2",
            hidden_size=896,
            num_layers=24,
            num_heads=14,
            num_kv_heads=2,
            intermediate_size=4864,
            precision="bf16-mixed",
        ),
        32_000,
    ),
    "tiny": (
        ModelConfig(
            arch="qwen2",
            hidden_size=32,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=64,
            precision="bf16-mixed",
        ),
        256,
    ),
}
# What a decode step's KV cache holds: the keys and values bf16 autocast computes.
KV_BYTES = torch.bfloat16.itemsize
# At or above this share of a decode step's wall time busy, the GPU bounds the step; below it
# the GPU waits on the CPU that launches its kernels.
GPU_BOUND_SHARE = 0.5


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
    """The new tokens of Hugging Face ``generate`` with the settings of ``params`` (with
    ``ignore_eos``, no EOS: every row runs to ``max_new_tokens``)."""
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
            eos_token_id=None if params.ignore_eos else EOS,
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


def compare_noise(args: argparse.Namespace, shapes: list[tuple[int, int]]) -> dict[str, Any]:
    """``--compare noise``: native (keyed and stream noise) against HF on CPU."""
    peak = matmul_peak()

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
    return {
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


def roofline(
    model: torch.nn.Module, td: TensorDict, new_tokens: int, device_name: str
) -> dict[str, Any] | None:
    """The fastest ``model`` could generate ``new_tokens`` tokens per row of ``td`` on the GPU
    ``device_name`` (the module docstring's roofline); None for a device the tables of
    ``verlite.models.flops`` do not know (a CPU)."""
    bandwidth, peak = hbm_bandwidth(device_name), bf16_peak_flops(device_name)
    if bandwidth is None or peak is None:
        return None
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    weight_bytes = sum(
        p.numel() * p.element_size() for p in model.parameters() if p is not embedding or p is head
    )
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_position = config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * KV_BYTES
    rows = len(td)
    # Step t reads each row's prompt and the t tokens before it: the mean over the steps.
    filled = float(td["attention_mask"].sum()) + rows * (new_tokens - 1) / 2
    step_bytes = weight_bytes + per_position * filled
    step_flops = 2.0 * DecoderShape.of(model).dense_params * rows
    memory_s, compute_s = step_bytes / bandwidth, step_flops / peak
    step_s = max(memory_s, compute_s)
    return {
        "tokens_per_s": rows / step_s,
        "step_ms": step_s * 1e3,
        "bound_by": "memory" if memory_s >= compute_s else "compute",
        "weight_gb": weight_bytes / 1e9,
        "kv_cache_gb_mean": per_position * filled / 1e9,
        "hbm_tb_per_s": bandwidth / 1e12,
        "bf16_peak_tflops": peak / 1e12,
    }


def _error(exc: Exception) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:300]


def _synchronized(device: torch.device, fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` returning once the device has run all it queued (timing a call measures it)."""

    def call() -> Any:
        result = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return result

    return call


def _generated(td: TensorDict) -> int:
    return int(td["response_mask"].sum())


def gpu_busy_seconds(profile: torch.profiler.profile) -> float:
    """The time the GPU ran anything (kernels, copies) in ``profile``: its events' intervals,
    merged where they overlap."""
    spans = sorted(
        (event.start_ns(), event.end_ns())
        for event in profile.profiler.kineto_results.events()
        if event.device_type() == torch.autograd.DeviceType.CUDA
    )
    busy, end = 0, None
    for start, stop in spans:
        if end is None or start > end:
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    return busy / 1e9


def profile_decode(
    sampler: Sampler,
    td: TensorDict,
    params: SamplingParams,
    steps: tuple[int, int],
    device: torch.device,
    repeats: int,
) -> dict[str, Any]:
    """Wall and GPU-busy time per decode step of ``sampler``: the difference between
    generating ``steps[1]`` and ``steps[0]`` tokens per row, over the steps between. The wall
    time is the difference of the two lengths' medians over ``repeats`` interleaved
    repetitions (each length run once first, to warm it up), measured without the profiler;
    the GPU's is measured once per length with it; on CPU there is no GPU time."""
    keys = sample_keys(0, 1, len(td), 1).to(device)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)

    def generating(new_tokens: int) -> Callable[[], Any]:
        length = dataclasses.replace(params, max_new_tokens=new_tokens)
        return _synchronized(
            device, lambda: sampler.generate(td, length, KeyedNoise(keys, horizon=new_tokens))
        )

    runs = {str(new_tokens): generating(new_tokens) for new_tokens in steps}
    seconds, _ = interleaved(runs, repeats=repeats)
    busy = []
    for run in runs.values():
        with torch.profiler.profile(activities=activities) as profile:
            run()
        busy.append(gpu_busy_seconds(profile))
    count = steps[1] - steps[0]
    step_s = (median(seconds[str(steps[1])]) - median(seconds[str(steps[0])])) / count
    result: dict[str, Any] = {"step_ms": step_s * 1e3, "gpu_ms": None, "gpu_busy_share": None}
    if device.type == "cuda":
        gpu_s = (busy[1] - busy[0]) / count
        share = gpu_s / step_s
        result.update(
            gpu_ms=gpu_s * 1e3,
            gpu_busy_share=share,
            bound_by="gpu" if share >= GPU_BOUND_SHARE else "cpu (launching kernels)",
        )
    return result


def decode_variants(
    samplers: dict[str, Sampler], model: torch.nn.Module, td: TensorDict, params: SamplingParams
) -> dict[str, Callable[[], int]]:
    """Each native sampler's and Hugging Face's generation of ``td`` with ``params``: each
    returns the tokens it generated."""
    keys = sample_keys(0, 1, len(td), 1).to(td.device)

    def native(sampler: Sampler) -> Callable[[], int]:
        return lambda: _generated(
            sampler.generate(td, params, KeyedNoise(keys, horizon=params.max_new_tokens))
        )

    variants = {mode: native(sampler) for mode, sampler in samplers.items()}
    variants["hf"] = lambda: hf_generate(model, td, params).numel()
    return variants


def sampler_agreement(
    sampler: Sampler, model: torch.nn.Module, td: TensorDict, params: SamplingParams
) -> dict[str, float]:
    """How far the log-probs the sampler drew its tokens with are from those one forward pass
    over prompt + response gives (what the trainer recomputes, ``rollout/logprob_abs_diff``),
    per response token: median, mean and largest absolute difference."""
    keys = sample_keys(0, 1, len(td), 1).to(td.device)
    out = sampler.generate(td, params, KeyedNoise(keys, horizon=params.max_new_tokens))
    with torch.no_grad():
        recomputed, _ = response_log_probs(
            model, out, temperature=params.temperature, entropy="none"
        )
    mask = out["response_mask"].bool()
    diff = (recomputed.double() - out["rollout_log_probs"].double()).abs()[mask]
    return {
        "median": float(diff.median()),
        "mean": float(diff.mean()),
        "max": float(diff.max()),
        "tokens": int(mask.sum()),
    }


def compare_decode(
    args: argparse.Namespace, shapes: list[tuple[int, int]], device: torch.device
) -> dict[str, Any]:
    """``--compare decode``: the native sampler in its fast mode (cuda_graphs; static on CPU)
    and in eager, and Hugging Face ``generate``, tokens/s and the roofline's share."""
    native = "cuda_graphs" if device.type == "cuda" else "static"
    model_cfg, vocab = DECODE_SHAPES[args.shape]
    longest = args.prompt_len + max(new for _, new in shapes)
    with device:  # initialized where it runs: seconds, not a minute, for 0.42B parameters
        model = build_policy(model_cfg, vocab_size=vocab, max_positions=longest, seed=0)
    model = store_for_inference(model, model_cfg.precision).eval()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    samplers, errors = {}, {}
    for mode in (native, "eager"):
        try:
            samplers[mode] = Sampler(
                model,
                eos_token_id=EOS,
                pad_token_id=PAD,
                lockstep=False,
                decode=DecodeSettings(mode),
            )
        except Exception as exc:  # reported in the JSON; the other variants still run
            errors[mode] = _error(exc)
    results = {}
    for batch, new_tokens in shapes:
        td = prompts(batch, args.prompt_len, vocab).to(device)
        params = SamplingParams(new_tokens, temperature=1.0, ignore_eos=True)
        variants = decode_variants(samplers, model, td, params)
        runs = {}
        for variant, fn in variants.items():
            if variant in errors:
                continue
            run = _synchronized(device, fn)
            try:
                with autocast(model_cfg.precision, device):
                    run()  # warm-up (graphs captured here), where a variant that fails shows
            except Exception as exc:  # reported in the JSON; the other variants still run
                errors[variant] = _error(exc)
                continue
            runs[variant] = run
        with autocast(model_cfg.precision, device):
            seconds, tokens = interleaved(runs, repeats=args.repeats, warmup=0)
        rates = {k: [n / s for n, s in zip(tokens[k], v, strict=True)] for k, v in seconds.items()}
        bound = roofline(model, td, new_tokens, name)
        result: dict[str, Any] = {
            # what one call generated: every row's every token when EOS is ignored
            "tokens_per_call": {k: v[0] for k, v in tokens.items()},
            "tokens_per_s": {k: median(v) for k, v in rates.items()},
            "tokens_per_s_quartiles": {k: quartiles(v) for k, v in rates.items()},
            "roofline": bound,
            "roofline_share": None
            if bound is None
            else {k: median(v) / bound["tokens_per_s"] for k, v in rates.items()},
        }
        for other in ("eager", "hf"):
            if native in rates and other in rates:
                result[f"native_over_{other}"] = paired_ratio(rates[native], rates[other])
                result[f"native_over_{other}_quartiles"] = quartiles(
                    ratios(rates[native], rates[other])
                )
        results[f"{batch}x{new_tokens}"] = result
        # In the log as soon as measured: a profile or a limit that kills the process later
        # must not take these figures with it (the JSON at the end holds them all).
        print(f"measured {batch}x{new_tokens}: {json.dumps(result)}", flush=True)
    # What bounds a decode step: at the first shape, each native mode.
    batch, new_tokens = shapes[0]
    td = prompts(batch, args.prompt_len, vocab).to(device)
    params = SamplingParams(new_tokens, temperature=1.0, ignore_eos=True)
    agreement: dict[str, Any] = {}
    if native in samplers:
        try:
            with autocast(model_cfg.precision, device):
                agreement = sampler_agreement(samplers[native], model, td, params)
        except Exception as exc:  # reported; the figures above stand
            errors["agreement"] = _error(exc)
    profile_steps = tuple(int(n) for n in args.profile_steps.split(","))
    profiles: dict[str, Any] = {}
    for mode, sampler in samplers.items():
        if mode in errors:
            continue
        try:
            with autocast(model_cfg.precision, device):
                profiles[mode] = profile_decode(
                    sampler, td, params, profile_steps, device, args.repeats
                )
        except Exception as exc:  # reported; the figures above stand
            errors[f"profile_{mode}"] = _error(exc)
    return {
        "benchmark": "rollout",
        "compare": "decode",
        "device": name,
        "model": f"{args.shape}-shaped qwen2, vocab {vocab}, "
        "stored by store_for_inference(bf16-mixed), bf16 autocast",
        "parameters": sum(p.numel() for p in model.parameters()),
        "prompt_len": f"{args.prompt_len // 2}-{args.prompt_len}",
        "native": native,
        "results": results,
        "profile": {"batch": batch, "steps": list(profile_steps), **profiles},
        "logprob_abs_diff": agreement,
        "errors": errors,
        "goal": "issue 36, 256x256 on a GPU: native >= 75k tok/s, native_over_eager >= 10, "
        "native_over_hf >= 6, roofline_share >= 0.08",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--compare",
        choices=("noise", "decode"),
        help="noise: native (keyed, stream) vs HF, CPU; decode: the decode modes vs HF and the "
        "roofline (default: noise on cpu, decode on cuda)",
    )
    parser.add_argument(
        "--shapes",
        help="batch x new tokens, comma-separated (default: 32x64,64x128; decode: 256x256,64x256)",
    )
    parser.add_argument(
        "--prompt-len",
        type=positive_int,
        help="prompts of half to all of it (default 32; decode: 64)",
    )
    parser.add_argument(
        "--vocab", type=positive_int, default=2048, help="noise: the model's vocabulary"
    )
    parser.add_argument("--shape", choices=sorted(DECODE_SHAPES), default="qwen2-0.5b")
    parser.add_argument(
        "--profile-steps",
        default="8,40",
        help="decode: the two generation lengths whose difference the profile measures",
    )
    add_repeats(parser, 5)
    # One thread: torch's threads wait on each other at every op, so when other work shares
    # the cores a multi-threaded run slows erratically, a single thread proportionally.
    parser.add_argument("--threads", type=positive_int, default=1)
    args = parser.parse_args()
    compare = args.compare or ("decode" if args.device == "cuda" else "noise")
    if compare == "noise" and args.device != "cpu":
        parser.error("--compare noise runs on --device cpu")
    decode = compare == "decode"
    args.prompt_len = args.prompt_len or (64 if decode else 32)
    default_shapes = "256x256,64x256" if decode else "32x64,64x128"
    shapes = [
        tuple(int(x) for x in s.split("x")) for s in (args.shapes or default_shapes).split(",")
    ]
    torch.set_num_threads(args.threads)
    retain_freed_memory()  # as every worker does
    if decode:
        emit(compare_decode(args, shapes, torch.device(args.device)))
    else:
        emit(compare_noise(args, shapes))


if __name__ == "__main__":
    main()
