"""One actor update of a Qwen2-0.5B-shaped policy on one GPU: bf16 mixed precision (fp32 master
weights, bf16 autocast) against pure bf16 and a plain PyTorch loop, on the same tokens.

A randomly initialized decoder of Qwen2-0.5B's shape (hidden 896, 24 layers, 14 heads / 2 KV
heads, MLP 4864, vocab 151936, tied embeddings; nothing downloaded) takes one optimizer step
over ``--rows`` rows of ``--tokens`` real tokens (prompt 64, the rest response) through
``TrainEngine.train_step`` with the PPO loss, in ``bf16-mixed`` and in pure ``bf16``, and
through a plain loop (fp32 parameters, the forward under bf16 autocast, a policy-gradient loss
over the same response tokens, AdamW). The three take turns repetition by repetition
(``common.interleaved``); reported: median seconds and quartiles, tokens/s, MFU (the FLOPs of
``verlite.models.flops.decoder_flops`` with backward over the real tokens, per second, over the
GPU's dense bf16 peak, ``verlite.models.flops.bf16_peak_flops``) and each variant's peak memory
(``torch.cuda.max_memory_allocated`` over a step of that variant built alone, its optimizer
state made by a first step). ``--tiny`` runs a tiny model of the same layout on few tokens:
what CI runs on CPU (no MFU or memory figure there).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
from tensordict import TensorDict
from transformers import AutoModelForCausalLM, Qwen2Config

from benchmarks.common import add_repeats, emit, interleaved, median, quartiles, update_batch
from verlite.arguments import positive_int
from verlite.config import ActorConfig, ModelConfig
from verlite.models.flops import bf16_peak_flops, causal_pairs, decoder_flops
from verlite.models.logits_chunk import set_logits_chunk_tokens
from verlite.models.precision import param_dtype
from verlite.workers.objectives import ActorLossSettings, ppo_loss
from verlite.workers.train_engine import TrainEngine

QWEN2_05B = {
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
}
TINY = {
    "vocab_size": 256,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
PROMPT = 64
LR = 1e-6
VARIANTS = ("bf16-mixed", "bf16", "plain_loop")


def build(shape: dict[str, int], *, tokens: int, dtype: torch.dtype, device: torch.device) -> Any:
    """The random decoder of ``shape`` (the same weights every time on one device), tied
    embeddings, initialized where it runs; on the meta device, its shape alone."""
    torch.manual_seed(0)
    config = Qwen2Config(
        **shape,
        max_position_embeddings=tokens,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    with device:
        return AutoModelForCausalLM.from_config(config).to(dtype=dtype)


def batch_of(rows: int, tokens: int, vocab: int) -> TensorDict:
    """``rows`` rows of ``tokens`` real tokens, the first :data:`PROMPT` the prompt (one
    mini-batch: the ``(1, rows)`` share ``train_step`` takes)."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (rows, tokens), generator=gen)
    return update_batch(ids, torch.ones_like(ids), PROMPT, gen=gen).unsqueeze(0)


def engine_step(
    precision: str, shape: dict[str, int], td: TensorDict, micro: int, device: torch.device
) -> Callable[[], Any]:
    """One ``TrainEngine.train_step`` of the PPO loss over ``td`` in ``precision``
    (``verlite.models.precision``: bf16-mixed, fp32 parameters and the forward under bf16
    autocast; bf16, bf16 parameters), log-probs ``model.logits_chunk_tokens`` (its default)
    tokens at a time."""
    rows = td.batch_size[1]
    cfg = ActorConfig(
        strategy="none",
        ppo_mini_batch_size=rows,
        micro_batch_size_per_worker=micro,
        optim={"lr": LR, "warmup_steps": 0},
    )
    dtype = param_dtype(precision)
    model = build(shape, tokens=td["input_ids"].shape[-1], dtype=dtype, device=device)
    set_logits_chunk_tokens(model, ModelConfig().logits_chunk_tokens)
    engine = TrainEngine(
        model,
        cfg=cfg,
        total_updates=1000,
        metric_prefix="actor",
        device=device,
        precision=precision,
    )
    loss_fn = partial(ppo_loss, settings=ActorLossSettings.from_config(cfg))
    return partial(engine.train_step, td, loss_fn)


def plain_step(
    shape: dict[str, int], td: TensorDict, micro: int, device: torch.device
) -> Callable[[], Any]:
    """The same update written plainly: fp32 parameters, the forward under bf16 autocast,
    log-probs of the response tokens in fp32, a token-mean policy-gradient loss, AdamW."""
    batch = td[0].to(device)
    ids, mask, adv = batch["input_ids"], batch["attention_mask"], batch["advantages"]
    model = build(shape, tokens=ids.shape[-1], dtype=torch.float32, device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    count = float(batch["response_mask"].sum())

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        for start in range(0, ids.shape[0], micro):
            rows = slice(start, start + micro)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                logits = model(input_ids=ids[rows], attention_mask=mask[rows]).logits
            log_probs = logits[:, PROMPT - 1 : -1].float().log_softmax(-1)
            taken = log_probs.gather(-1, ids[rows, PROMPT:, None]).squeeze(-1)
            (-(taken * adv[rows]).sum() / count).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    return step


def make_step(
    name: str, shape: dict[str, int], td: TensorDict, micro: int, device: torch.device
) -> Callable[[], Any]:
    """The update of variant ``name`` (one of :data:`VARIANTS`), its model built."""
    if name == "plain_loop":
        return plain_step(shape, td, micro, device)
    return engine_step(name, shape, td, micro, device)


@contextlib.contextmanager
def _synchronized(device: torch.device) -> Iterator[None]:
    yield
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_gb(
    shape: dict[str, int], td: TensorDict, micro: int, device: torch.device
) -> dict[str, float]:
    """Each variant built alone: ``torch.cuda.max_memory_allocated`` over its second step
    (the first made the optimizer's state), in GB."""
    out = {}
    for name in VARIANTS:
        step = make_step(name, shape, td, micro, device)
        step()
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        out[name] = torch.cuda.max_memory_allocated(device) / 1e9
        del step
        gc.collect()
        torch.cuda.empty_cache()
    return out


def run(*, tiny: bool, rows: int, tokens: int, micro: int, repeats: int) -> dict[str, Any]:
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    shape = TINY if tiny else QWEN2_05B
    td = batch_of(rows, tokens, shape["vocab_size"])
    memory = peak_memory_gb(shape, td, micro, device) if device.type == "cuda" else None
    steps = {name: make_step(name, shape, td, micro, device) for name in VARIANTS}

    def timed(fn: Callable[[], Any]) -> Callable[[], Any]:
        def call() -> Any:
            with _synchronized(device):
                return fn()

        return call

    seconds, _ = interleaved({k: timed(v) for k, v in steps.items()}, repeats=repeats)
    mask = td["attention_mask"][0]
    real = float(mask.sum())
    model = build(shape, tokens=tokens, dtype=torch.float32, device=torch.device("meta"))
    # The LM head over the positions that predict response tokens: verlite's log-prob pass runs
    # it there only (the plain loop, over every position, does more than is counted).
    responses = float(mask[:, PROMPT:].sum())
    flops = decoder_flops(
        model, tokens=real, attended=causal_pairs(mask), backward=True, head_tokens=responses
    )
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = bf16_peak_flops(name) if device.type == "cuda" else None
    return {
        "benchmark": "gpu_update",
        "device": name,
        "shape": "tiny" if tiny else "qwen2-0.5b",
        "parameters": sum(p.numel() for p in model.parameters()),
        "rows": rows,
        "tokens_per_row": tokens,
        "micro_batch_size": micro,
        "repeats": repeats,
        "update_tflop": flops / 1e12,
        "seconds": {k: median(s) for k, s in seconds.items()},
        "seconds_quartiles": {k: quartiles(s) for k, s in seconds.items()},
        "tokens_per_s": {k: real / median(s) for k, s in seconds.items()},
        "bf16_peak_tflops": None if peak is None else peak / 1e12,
        "mfu": None if peak is None else {k: flops / median(s) / peak for k, s in seconds.items()},
        "max_memory_allocated_gb": memory,
        "goal": "bf16-mixed: MFU >= 0.30 (issue 35)",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tiny", action="store_true", help="a tiny model on few tokens (CI)")
    parser.add_argument("--rows", type=positive_int, default=256)
    parser.add_argument("--tokens", type=positive_int, default=320)
    parser.add_argument("--micro", type=positive_int, default=16)
    add_repeats(parser, 5)
    args = parser.parse_args()
    emit(
        run(
            tiny=args.tiny,
            rows=args.rows,
            tokens=args.tokens,
            micro=args.micro,
            repeats=args.repeats,
        )
    )


if __name__ == "__main__":
    main()
