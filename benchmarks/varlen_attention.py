"""Attention over packed sequences on this CPU: forward + backward of one attention layer's
core (queries, keys and values in, outputs out) for the sequences of a packed row, by each
way torch offers here, against the one verlite uses.

grouped   ``verlite.models.varlen``: the sequences regrouped by length (within 2^(1/4)),
          SDPA with ``is_causal`` on each group as a padded batch;
dense     SDPA over the whole packed row with a block-diagonal causal boolean mask
          (T x T): exact, but every pair of tokens costs, across sequences too;
nested    SDPA on a nested (jagged) tensor of the sequences, where torch supports it;
flex      ``flex_attention`` with a document block mask, compiled, where it compiles.

Lengths: the long-tailed batch of ``benchmarks.dynamic_batching`` (16..1024), packed into
rows of at most 4,096 tokens as ``PackedTokenPartition`` packs them; 4 heads of 32 (hidden
128), float32, one thread. Each way's outputs and gradients must match the per-sequence
reference; the figures are seconds per packed row relative to ``grouped``, interleaved.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
from torch.nn import functional as F

from benchmarks.common import (
    add_repeats,
    emit,
    interleaved,
    median,
    paired_ratio,
    quartiles,
    ratios,
)
from benchmarks.dynamic_batching import skewed_lengths
from verlite.arguments import positive_int
from verlite.core.partition import PackedTokenPartition
from verlite.models.varlen import PackedAttention, varlen_attention

HEADS, DIM = 4, 32


def grouped(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    packed = PackedAttention.from_lengths(lengths)
    out, _ = varlen_attention(None, q, k, v, None, verlite_packed=packed)
    return out[0]  # (T, heads, dim)


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    doc = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    pos = torch.arange(len(doc))
    mask = (doc[:, None] == doc[None, :]) & (pos[:, None] >= pos[None, :])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)[0].transpose(0, 1)


def nested(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])

    def jag(x: torch.Tensor) -> torch.Tensor:
        return torch.nested.nested_tensor_from_jagged(x[0].transpose(0, 1), offsets).transpose(1, 2)

    out = F.scaled_dot_product_attention(jag(q), jag(k), jag(v), is_causal=True)
    return out.transpose(1, 2).values()


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    outs, start = [], 0
    for n in lengths.tolist():
        s = slice(start, start + n)
        outs.append(
            F.scaled_dot_product_attention(q[:, :, s], k[:, :, s], v[:, :, s], is_causal=True)[
                0
            ].transpose(0, 1)
        )
        start += n
    return torch.cat(outs)


def flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    from torch.nn.attention.flex_attention import create_block_mask

    doc = torch.repeat_interleave(torch.arange(len(lengths)), lengths)

    def causal_within(b: Any, h: Any, qi: Any, ki: Any) -> Any:
        return (doc[qi] == doc[ki]) & (qi >= ki)

    t = len(doc)
    block = create_block_mask(causal_within, None, None, t, t, device="cpu")
    return _compiled_flex()(q, k, v, block_mask=block)[0].transpose(0, 1)


_FLEX: list[Callable[..., Any]] = []


def _compiled_flex() -> Callable[..., Any]:
    if not _FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX.append(torch.compile(flex_attention))
    return _FLEX[0]


WAYS: dict[str, Callable[..., torch.Tensor]] = {
    "grouped": grouped,
    "dense": dense,
    "nested": nested,
    "flex": flex,
    "per_sequence": reference,
}


def fwd_bwd(
    way: Callable[..., torch.Tensor],
    tensors: tuple[torch.Tensor, ...],
    lengths: torch.Tensor,
    grad: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    q, k, v = (t.detach().requires_grad_() for t in tensors)
    out = way(q, k, v, lengths)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_repeats(parser, 5)
    parser.add_argument("--budget", type=positive_int, default=4096)
    args = parser.parse_args()
    torch.set_num_threads(1)
    lengths = skewed_lengths(128, seed=0)
    rows = PackedTokenPartition(lengths, max_tokens=args.budget).parts()
    row_lengths = [torch.tensor([lengths[i] for i in row]) for row in rows]
    gen = torch.Generator().manual_seed(0)
    inputs = [
        tuple(torch.randn(1, HEADS, int(n.sum()), DIM, generator=gen) for _ in range(3))
        for n in row_lengths
    ]
    grads = [torch.randn(int(n.sum()), HEADS, DIM, generator=gen) for n in row_lengths]
    status: dict[str, str] = {}
    working: dict[str, Callable[[], Any]] = {}
    for name, way in WAYS.items():
        try:
            for n, x, g in zip(row_lengths, inputs, grads, strict=True):
                want = fwd_bwd(reference, x, n, g)
                got = fwd_bwd(way, x, n, g)
                worst = max(float((a - b).abs().max()) for a, b in zip(got, want, strict=True))
                if worst > 1e-4:
                    raise AssertionError(f"differs from the per-sequence reference by {worst:.2g}")
        except Exception as exc:  # a way this torch cannot run here is reported, not timed
            status[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            continue
        status[name] = "ok"
        working[name] = lambda way=way: [
            fwd_bwd(way, x, n, g) for n, x, g in zip(row_lengths, inputs, grads, strict=True)
        ]
    seconds, _ = interleaved(working, repeats=args.repeats, warmup=1)
    emit(
        {
            "benchmark": "varlen_attention",
            "packed_rows": len(rows),
            "tokens": sum(lengths),
            "status": status,
            "seconds": {name: median(s) for name, s in seconds.items()},
            "vs_grouped": {
                name: paired_ratio(s, seconds["grouped"]) for name, s in seconds.items()
            },
            "vs_grouped_quartiles": {
                name: quartiles(ratios(s, seconds["grouped"])) for name, s in seconds.items()
            },
        }
    )


if __name__ == "__main__":
    main()
