"""A KV cache of fixed shape for the static decode path (``verlite.generation.decode``).

Every layer holds one key and one value buffer of ``(rows, heads, capacity, width)``, the
heads and width of what the layer caches (its config's KV heads x head dim for most models;
DeepSeek-V3's latent attention caches other tensors), allocated at its first write for the
largest batch and the longest sequence a generation needs, and kept between generations;
:func:`cache_bytes` counts it before it is allocated, from what the model's layers write.
Left-padded prompts fill positions ``0 .. width`` of every row; decode step ``t`` writes
position ``width + t`` of every row, at an index held in a device tensor
(``slot``) that the step advances itself: nothing in a decode step depends on a Python
number that changes from step to step, so the step can be captured once as a CUDA graph and
replayed.

A step runs on the first ``rows`` rows (its batch-size bucket: compaction moves the
unfinished rows to the front) and attends to the first ``span`` positions, which the
attention mask (``(rows, 1, 1, capacity)``, True where a row may attend) limits to what the
row has filled. Both are fixed per captured graph; views of the same buffers keep their
addresses, so one allocation serves every bucket.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import Cache, CacheLayerMixin

from verlite.errors import one_line, shown
from verlite.models import meta_causal_lm

_log = logging.getLogger(__name__)


class UnsupportedModel(ValueError):
    """The model's attention cannot run on the static cache."""


def attention_shape(config: PretrainedConfig, *, longest: int) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of a Hugging Face decoder ``config`` whose every layer
    attends as full causal attention on sequences of up to ``longest`` tokens (the run's
    ``max_sequence_length``): full-attention layers, and sliding-window ones whose window is
    ``longest`` or more (Hugging Face's window: query i attends key j iff 0 <= i - j <
    window; a row's real tokens are contiguous, so no two are ``longest`` apart).
    :class:`UnsupportedModel` for a window a sequence could pass, and for other layer types:
    the static path builds full-attention masks."""
    window = getattr(config, "sliding_window", None)
    kinds = set(getattr(config, "layer_types", None) or ())
    if not kinds:
        kinds = {"full_attention" if window is None else "sliding_attention"}
    if not kinds <= {"full_attention", "sliding_attention"}:
        raise UnsupportedModel(
            f"this {config.model_type} model has attention layers of kinds {sorted(kinds)}; "
            "the static decode path supports full and sliding-window attention only: use "
            "rollout.decode=eager"
        )
    if "sliding_attention" in kinds and window is not None and longest > window:
        raise UnsupportedModel(
            f"this {config.model_type} model attends through a sliding window of {window} "
            f"tokens (sliding_window) and a sequence can be {longest} tokens; the static decode "
            f"path applies no window, which is the model's attention only for sequences of at "
            f"most {window} tokens: use rollout.decode=eager or keep sequences to {window} tokens"
        )
    return _cache_dimensions(config)


def _cache_dimensions(config: PretrainedConfig) -> tuple[int, int, int]:
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return config.num_hidden_layers, kv_heads, head_dim


def check_capturable(config: PretrainedConfig, *, longest: int) -> None:
    """A decode step of a model of ``config`` can be captured as a CUDA graph: attention the
    static path runs on sequences of up to ``longest`` tokens (:func:`attention_shape`), and
    rotary embeddings that do not read the positions on the host (the ``dynamic`` and
    ``longrope`` kinds compare the largest position with a cached length at every step);
    :class:`UnsupportedModel` otherwise."""
    attention_shape(config, longest=longest)
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    if kind in ("dynamic", "longrope"):
        raise UnsupportedModel(
            f"this {config.model_type} model's rotary embeddings (rope_type {kind}) read the "
            "positions on the host at every step, which a CUDA graph cannot capture: use "
            "rollout.decode=static"
        )


def cache_bytes(config: PretrainedConfig, rows: int, capacity: int, dtype: torch.dtype) -> int:
    """Bytes of a KV cache of ``rows`` x ``capacity`` positions in ``dtype`` for a model of
    ``config``: what the static cache allocates (:class:`StaticCacheLayer`, the heads and
    width of what each layer writes), and what the eager sampler's preallocates for a
    generation of ``rows`` rows of ``capacity`` positions (prompt width + new tokens): both
    store keys and values in ``dtype`` (:func:`autocast_dtype`, else the model's);
    :func:`position_elements` counts a position."""
    return rows * capacity * position_elements(config) * dtype.itemsize


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype a KV cache stores keys and values in on ``device`` under autocast (None
    without): autocast's, which attention reads them in. Under bf16 autocast a rotated key
    comes out of the model in float32 (its rotary cosines are float32; DeepSeek-V3's latent
    and rotary key, and so its values, too) and attention casts it to bf16: stored cast, the
    cache holds the bits attention reads (the same tokens and log-probs, bit for bit) at half
    a float32 key's memory, the static cache and the eager sampler's alike."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return None


def position_elements(config: PretrainedConfig) -> int:
    """The elements a model of ``config`` caches per position of a row, keys and values of
    every layer: heads x width of what each layer writes, found by running the model. It is
    built on the meta device (no memory) with eager attention and batched experts (what
    runs there: the default grouped experts' kernel refuses a meta model's float32) and
    prefills one token into a :class:`StaticCache` of one row and one position there:
    about 0.35 s of one CPU core for a Qwen2.5-7B-shaped config (28 layers), 1.1 s for
    DeepSeek-V3's 61 layers of 256 experts. Not the config's KV heads x head dim in every
    layer: DeepSeek-V2/V3's and LongCat-Flash's latent attention write a one-head latent
    and a one-head rotary key (DeepSeek-V3: 1/28 of that count, V2-Lite 1/3.6), Gemma-3n's
    later layers reuse earlier layers' keys and values and write none.

    A model whose forward cannot run on the meta device is counted by its config's KV
    heads x head dim in every layer (exact for such layers), and a warning says so in one
    line, naming its model type and why: one that reads a value on the host (dynamic rotary
    scaling compares the largest position with a cached length, an ``.item()``: torch's
    ``RuntimeError``, as for any op the meta device has no kernel for), and one whose layers
    need a cache class of their own (Qwen3-Next's and Falcon-H1's linear attention,
    MiniMax's: Hugging Face's ``ValueError``), which the static cache does not run (the model
    itself then raises where it runs, with its own message). Any error of the forward is
    taken as that (a model class fails on the meta device in as many ways as it reads
    values or checks its cache), and said: the count is wanted either way, and the config's
    rule counted no fewer bytes than the layers write for every model tried. Building the
    model and the cache is outside: an error there is raised."""
    model = meta_causal_lm(config, attn_implementation="eager", experts_implementation="batched_mm")
    cache = StaticCache(config, rows=1, capacity=1, dtype=model.dtype, device=torch.device("meta"))
    cache.state.prefilling = True
    try:
        with torch.no_grad():
            model(
                input_ids=torch.zeros((1, 1), dtype=torch.int64, device="meta"),
                cache=cache,
                use_cache=True,
                logits_to_keep=1,
            )
    except Exception as exc:  # the config's rule (above), said
        layers, kv_heads, head_dim = _cache_dimensions(config)
        reason = shown(one_line(f"{type(exc).__name__}: {exc}"), 200, str)
        _log.warning(
            "the KV cache of this %s model is counted by its config (KV heads x head dim in "
            "every layer): its forward does not run on the meta device with a static cache (%s)",
            config.model_type,
            reason,
        )
        return 2 * layers * kv_heads * head_dim
    return sum(buffer.numel() for buffer in cache.buffers())


@dataclass
class StepState:
    """What every layer's update reads of the step being run: whether the prompts are being
    written (``prefilling``), the position a decode step writes (``slot``, a (1,) int64
    device tensor) and how many positions it attends to (``span``). Shared by the layers,
    with no link back to the cache (a cycle would keep a dropped cache's buffers alive until
    Python's cycle collector ran)."""

    slot: torch.Tensor
    span: int
    prefilling: bool = False


class StaticCacheLayer(CacheLayerMixin):  # type: ignore[no-untyped-call]  # transformers leaves CacheLayerMixin.__init_subclass__ unannotated
    """One layer's key and value buffers, ``(rows, heads, capacity, width)`` each in ``dtype``,
    of the heads and width of what the layer writes (its keys', and its values' own),
    allocated at its first write (a prefill), as Hugging Face's static layers are: a model's
    cached tensors need not be its config's KV heads x head dim (DeepSeek-V3's latent
    attention caches a one-head latent and a one-head rotary key, of two other widths)."""

    def __init__(self, state: StepState, *, rows: int, capacity: int, dtype: torch.dtype) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # transformers leaves CacheLayerMixin.__init__ unannotated
        self.state = state
        self.rows, self.capacity, self.dtype = rows, capacity, dtype
        self.key_buffer: torch.Tensor | None = None
        self.value_buffer: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        # Zeroed, not empty: rows a bucket carries past the unfinished ones read them, and
        # garbage there could hold NaN (harmless to the other rows, but never sampled from).
        self.key_buffer, self.value_buffer = (
            states.new_zeros(
                (self.rows, states.shape[1], self.capacity, states.shape[-1]), dtype=self.dtype
            )
            for states in (key_states, value_states)
        )
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        key_buffer, value_buffer = self.key_buffer, self.value_buffer
        assert key_buffer is not None and value_buffer is not None
        state = self.state
        rows, length = key_states.shape[0], key_states.shape[-2]
        if state.prefilling:  # the prompts, positions 0 .. width
            key_buffer[:rows, :, :length] = key_states
            value_buffer[:rows, :, :length] = value_states
            return key_buffer[:rows, :, :length], value_buffer[:rows, :, :length]
        keys, values = key_buffer[:rows], value_buffer[:rows]
        keys.index_copy_(2, state.slot, key_states.to(keys.dtype))
        values.index_copy_(2, state.slot, value_states.to(values.dtype))
        return keys[:, :, : state.span], values[:, :, : state.span]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Only the prefill builds its mask from these; a decode step passes a 4-D mask.
        return query_length, 0

    def get_seq_length(self) -> int:
        return 0  # nothing precedes the prompts: the prefill's mask starts at position 0

    def get_max_length(self) -> int:
        return self.capacity


class StaticCache(Cache):
    """The static KV cache of a model: one :class:`StaticCacheLayer` per layer, in ``dtype``
    (under autocast, its dtype: a rotated key may come out in float32, but attention under
    autocast reads keys and values in the autocast dtype, so they are stored cast, at a
    fraction of the memory and of the bytes a step reads), and the :class:`StepState` they
    read."""

    def __init__(
        self,
        config: PretrainedConfig,
        *,
        rows: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.state = StepState(torch.zeros(1, dtype=torch.int64, device=device), capacity)
        super().__init__(
            layers=[
                StaticCacheLayer(self.state, rows=rows, capacity=capacity, dtype=dtype)
                for _ in range(config.num_hidden_layers)
            ]
        )
        self.rows, self.capacity, self.dtype = rows, capacity, dtype

    def buffers(self) -> Iterator[torch.Tensor]:
        """Every layer's key and value buffers (a layer that has written nothing holds none)."""
        for layer in self.layers:
            assert isinstance(layer, StaticCacheLayer)
            yield from (b for b in (layer.key_buffer, layer.value_buffer) if b is not None)

    def gather_rows(self, index: torch.Tensor) -> None:
        """Move rows ``index`` of every layer to the front (row ``i`` becomes ``index[i]``)."""
        count = len(index)
        for buffer in self.buffers():
            buffer[:count] = buffer[index]
