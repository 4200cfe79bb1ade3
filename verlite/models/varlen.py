"""Attention confined to each of several sequences packed end to end (``actor.packing``,
``critic.packing``), for the Hugging Face model classes verlite trains.

A packed micro-batch is one row of ``T`` tokens: the real tokens of its sequences laid end
to end, positions restarting at 0 for each. The linear layers, the MLPs and the LM head
then run on real tokens only. Attention must stay within each sequence: it runs here on the
sequences regrouped by length, each group a (sequences, heads, longest, dim) batch with
``is_causal`` (a sequence's pad keys come after every real query, so causal masking alone
keeps them out), and the outputs go back to the packed order. A sliding-window layer (Hugging
Face's window: query i attends key j iff 0 <= i - j < window) attends exactly this way when
no sequence of the row is longer than its window; a row with a longer one is refused (the
start-up check, ``models.support.check_packing_supported``, refuses a run whose sequences could be).
Lengths within a group differ by at most a factor of ``GROUP_SPREAD``, which bounds the
attention spent on pads; the grouping is computed once per micro-batch
(:class:`PackedAttention`), not per layer, and every index it needs with it: a layer only
gathers, so it never waits for the device (a boolean mask as an index would, to count it).

The attention function is registered with Hugging Face as ``verlite_varlen``; without the
packed structure among a call's keyword arguments it is Hugging Face's SDPA attention,
unchanged (generation and the padded layout take that path). Its mask function is SDPA's,
decided from the padding the host knows where a pass says it (:func:`known_padding`, as
``workers.forward`` does for the micro-batches the engine built on the CPU, the sampler for
the prompts' padding, ``generation.sampling.prompt_padding``, and the reward model's scoring
for its texts'): Hugging Face's own checks read the device once per forward (whether a 2-D
mask is all ones; without a mask and a cache, whether the positions restart), which on a
GPU waits for its queue. The engine, the sampler and the reward model's loading switch the
models they run passes with to it (:func:`use_verlite_attention`);
:func:`enable_packing` also proves on the model itself that packed sequences do not see each
other (a model whose attention ignores the structure is refused).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTENTION = "verlite_varlen"
# Attention arguments packed attention does not implement: a model that passes any of them
# is refused rather than trained with another attention than it generates with.
UNSUPPORTED = ("softcap", "s_aux")
KWARG = "verlite_packed"  # the keyword argument that carries a PackedAttention
GROUP_SPREAD = 2**0.25  # the longest sequence of a group / its shortest, at most


@dataclass(frozen=True)
class _Group:
    index: torch.Tensor  # (sequences, longest): packed positions, pads clamped to a real one
    # (sequence, offset) of each real token of ``index``, in row-major order: what a
    # (sequences, longest) mask of the real tokens selects, as the indices it stands for
    real: tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class PackedAttention:
    """The sequences of a packed row, regrouped by length for attention."""

    groups: tuple[_Group, ...]
    order: torch.Tensor  # packed position of each row of the groups' outputs, concatenated
    restore: torch.Tensor  # the inverse: where each packed position's output is
    longest: int  # tokens of the row's longest sequence

    @classmethod
    def from_lengths(cls, lengths: torch.Tensor) -> PackedAttention:
        """The structure of a row packing sequences of ``lengths`` (1-D, all > 0) in order,
        on the device of ``lengths``: build it from lengths on the CPU and move it
        (:meth:`apply`), as ``workers.packing`` does, since each step here reads values
        (``tolist``, ``nonzero``) and would wait for a GPU to finish its queue."""
        device = lengths.device
        starts = torch.cumsum(lengths, 0) - lengths
        # Lengths binned by a factor of GROUP_SPREAD: one group per occupied bin.
        bins = torch.ceil(torch.log2(lengths.double()) / math.log2(GROUP_SPREAD)).long()
        groups = []
        for value in torch.unique(bins).tolist():
            members = (bins == value).nonzero().flatten()
            longest = int(lengths[members].max())
            offsets = torch.arange(longest, device=device)
            real = offsets[None, :] < lengths[members, None]
            index = starts[members, None] + torch.minimum(
                offsets[None, :], lengths[members, None] - 1
            )
            rows, columns = real.nonzero().unbind(1)
            groups.append(_Group(index, (rows, columns)))
        order = torch.cat([group.index[group.real] for group in groups])
        longest = max(int(group.index.shape[1]) for group in groups)
        return cls(tuple(groups), order, torch.argsort(order), longest)

    def apply(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> PackedAttention:
        """The same structure with ``fn`` applied to each of its tensors (a copy to a device)."""
        groups = tuple(
            _Group(fn(group.index), (fn(group.real[0]), fn(group.real[1]))) for group in self.groups
        )
        return PackedAttention(groups, fn(self.order), fn(self.restore), self.longest)


def varlen_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Hugging Face's attention interface: (1, heads, T, dim) queries of a packed row in,
    (1, T, heads, dim) out; SDPA's when no :class:`PackedAttention` is passed, with the
    keyword arguments the model's attention layer gave (``is_causal``, ``sliding_window``,
    ...: whatever its class passes, of their own types)."""
    packed = kwargs.pop(KWARG, None)
    if not isinstance(packed, PackedAttention):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    unsupported = [name for name in UNSUPPORTED if kwargs.get(name) is not None]
    if unsupported:
        raise PackingUnsupported(
            f"{type(module).__name__} attends with {', '.join(unsupported)}, which packed "
            "attention does not apply (it would attend without the cap or the sinks)"
        )
    window = kwargs.get("sliding_window")
    if window is not None and packed.longest > int(window):
        raise PackingUnsupported(
            f"{type(module).__name__} attends through a sliding window of {window} tokens and "
            f"a packed sequence has {packed.longest}: packed attention applies no window (it "
            "is the window's for sequences no longer than it)"
        )
    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    outputs = []
    for group in packed.groups:
        # (heads, sequences, longest, dim) -> (sequences, heads, longest, dim)
        q, k, v = (x[0][:, group.index].transpose(0, 1) for x in (query, key, value))
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=dropout, scale=scaling
        )
        outputs.append(out.transpose(1, 2)[group.real])  # (real tokens, heads, dim)
    return torch.cat(outputs)[packed.restore][None], None


class Padding(Enum):
    """What the host knows of a pass's padding before it runs (``known_padding``): built on
    the CPU, the micro-batch says whether a row is padded without reading the device."""

    NONE = "none"  # every token is real: the 2-D mask is all ones
    SOME = "some"  # a row is padded
    PACKED = "packed"  # a packed row: real tokens only, attention confined by PackedAttention


_KNOWN: ContextVar[Padding | None] = ContextVar("verlite_known_padding", default=None)


@contextlib.contextmanager
def known_padding(padding: Padding | None) -> Iterator[None]:
    """Mask creation in the block (:func:`_mask`) decides from ``padding`` instead of reading
    the 2-D mask on the device; None: it reads it, as Hugging Face's SDPA mask does."""
    token = _KNOWN.set(padding)
    try:
        yield
    finally:
        _KNOWN.reset(token)


def _mask(**kwargs: Any) -> Any:
    """SDPA's mask (``sdpa_mask``, once per forward and kind of layer), decided from the
    padding the host knows (:func:`known_padding`) where it is known: Hugging Face's check
    reads the 2-D mask (whether every token is real, so the mask may be left to SDPA's
    ``is_causal``), which on a GPU waits for the device to finish its queue. The masks are
    the same, bit for bit: no padding builds the mask of an all-ones 2-D mask (none where
    it may be skipped), padding the one it would build after its check failed. A packed row
    gets none: packed attention reads no mask. Without the padding known, none for a pass
    with neither padding nor a cache: Hugging Face would otherwise build a (T, T) mask from a
    packed row's restarting positions, which packed attention does not read (the padded
    fallback is then plain causal SDPA). Keyword arguments only, as transformers passes
    them: a positional one would raise here, where reading the offsets from the keywords
    would pass it by."""
    known = _KNOWN.get()
    if known is Padding.PACKED:
        return None
    if known is Padding.NONE:
        kwargs["attention_mask"] = None
    elif known is Padding.SOME:
        kwargs["allow_is_causal_skip"] = kwargs["allow_is_bidirectional_skip"] = False
    else:
        fresh = (
            kwargs.get("q_offset", 0) == 0
            and kwargs.get("kv_offset", 0) == 0
            and kwargs.get("kv_length") == kwargs.get("q_length")
        )
        if kwargs.get("attention_mask") is None and fresh:
            return None
    return sdpa_mask(**kwargs)


AttentionInterface.register(ATTENTION, varlen_attention)
AttentionMaskInterface.register(ATTENTION, _mask)


class PackingUnsupported(ValueError):
    """A model whose attention lets packed sequences see each other."""


def enable_packing(model: nn.Module) -> None:
    """Switch ``model`` (a Hugging Face model, or one that holds one) to varlen attention,
    and prove on it that packed sequences stay apart: the outputs of a sequence packed after
    another must not change when that other one changes. Raises :class:`PackingUnsupported`
    for a model whose attention ignores the packed structure (it would train on attention
    across sequences)."""
    hf = _hf_model(model)
    if hf is None:
        raise PackingUnsupported(f"{type(model).__name__} holds no Hugging Face model")
    hf.set_attn_implementation(ATTENTION)
    _check_confined(model, hf)


def use_verlite_attention(model: nn.Module, *, packing: bool) -> None:
    """Switch ``model`` (a Hugging Face model, or one that holds one; nothing to switch in
    another) to verlite's attention, for the engine's passes: SDPA's, bit for bit, its mask
    decided from the padding the host knows (:func:`known_padding`); with ``packing``, by
    :func:`enable_packing`, which also proves the packed sequences stay apart."""
    if packing:
        enable_packing(model)
    elif (hf := _hf_model(model)) is not None:
        hf.set_attn_implementation(ATTENTION)


def _hf_model(model: nn.Module) -> PreTrainedModel | None:
    return next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)


@torch.no_grad()
def _check_confined(model: nn.Module, hf: PreTrainedModel) -> None:
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(0)
    vocab = min(int(hf.config.vocab_size), 1000)
    lengths = torch.tensor([5, 3])
    first, later = (torch.randint(vocab, (n,), generator=generator) for n in (5, 3))
    other = (first + 1) % vocab
    positions = torch.cat([torch.arange(n) for n in lengths.tolist()])[None].to(device)
    packed = PackedAttention.from_lengths(lengths).apply(lambda t: t.to(device))

    def run(tokens: torch.Tensor) -> torch.Tensor:
        out = model(
            input_ids=torch.cat([tokens, later])[None].to(device),
            position_ids=positions,
            **{KWARG: packed},
        )
        logits: torch.Tensor = getattr(out, "logits", out)
        return logits[0, 5:].float()

    was_training = model.training
    model.eval()
    try:
        seen, changed = run(first), run(other)
    finally:
        model.train(was_training)
    if not torch.allclose(seen, changed, rtol=1e-3, atol=1e-4):
        raise PackingUnsupported(
            f"{type(hf).__name__} ({hf.config.model_type}) lets packed sequences attend to each "
            f"other (a sequence's outputs moved by {float((seen - changed).abs().max()):.2g} "
            "when the one packed before it changed): its attention does not go through Hugging "
            "Face's attention interface"
        )
