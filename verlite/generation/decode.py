"""The static decode path (``rollout.decode``): a KV cache of fixed shape, finished rows
compacted out, and on cuda every decode step captured once as a CUDA graph and replayed.

A decode step of a small model is a few hundred small kernels; launched one by one from
Python, the GPU waits for the CPU between them (``benchmarks/rollout.py --device cuda``
measures how much). Captured as a CUDA graph, the step's kernels are launched in one call.
A graph replays fixed addresses and shapes, so everything a step reads and writes lives in
buffers allocated once (:class:`StaticCache` and the per-row state of
:class:`StaticDecoder`), and everything that changes from step to step (the position a step
writes, the decode position its noise is keyed by) is a device tensor the step advances.

The shapes a step may take are few: its rows are a batch-size bucket (``batch_buckets``:
when the unfinished rows fit a smaller bucket, they are moved to the front and the next
steps run on that bucket only, so a long tail does not run the whole batch), and it attends
to the positions filled so far rounded up to a multiple of ``kv_block``. With graphs the
first steps run on a bucket too (``DecodeSettings.pad_to_bucket``, :func:`buckets_for`):
the smallest holding the batch (past the largest, the next power of two; or the rows the
buffers hold, when fewer; padding never grows them: a batch past them runs on itself), the
rows past the batch finished from the start:
they sample pads into a scratch response row, read a pad token at position 0, and what
they compute from their own cache rows (garbage an earlier generation left, NaN included)
reaches no real row and no flag. One graph is captured per (bucket, span, sampling
settings) the first time it is needed, its first run being a real step (the warm-up torch
asks for before capture), and kept while the model's parameters and the buffers stay where
they are: a run's validation batches, dynamic sampling's refills and multi-turn turns (the
rows still active) reuse the buckets' graphs instead of capturing a set per batch size,
each capture a device synchronization. The padding costs its rows until the unfinished
rows fit a smaller bucket (the steps the batch would have run on itself): a step reads the
weights once whatever its rows, but each padding row reads its own cache rows over the
whole span (attention reads masked positions too), which at long spans may outweigh the
weights (not measured).

The host reads one small tensor a step, the flags the step wrote itself (its unfinished
rows, the first position a row diverged at), a step behind: step t is launched and the copy
of its flags started (on cuda non-blocking, into pinned memory) before the flags of step
t - 1 are read, so the device has a step queued while the host decides whether to stop,
which bucket the next step runs on, and whether a row diverged. The decisions lag a step: a
bucket holds the rows unfinished a step earlier (at least those unfinished now, which
compaction moves), and one step runs after the last row finished, on finished rows only (it
writes pads and zero log-probs), within the ``max_new_tokens`` positions. What this saves
on a GPU is not measured.

Without graphs (``mode="static"``, what runs on CPU) the same step runs eagerly on the batch
itself (padded only where a test asks: the same tokens and float64 log-probs) and attends
to exactly the filled positions, with no mask when no prompt is padded (as the eager
sampler's Hugging Face attention then drops its mask: SDPA's kernels without a mask and with
one round differently): its tokens and log-probs are those of the eager sampler, bit for bit
in float64 (tests/generation/test_static_decode.py); in float32, a compacted or padded bucket's
matrix products may round a row otherwise than the whole batch's. With a rounded span a step's
attention also sums the masked positions' exact zeros, in another order: the same tokens,
log-probs within a float32 rounding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, TypedDict

import torch
from tensordict import TensorDict
from torch import nn
from transformers import PretrainedConfig

from verlite.distributed import all_reduce_max
from verlite.errors import RunFailure
from verlite.generation.noise import KeyedNoise, Noise, keyed_uniforms
from verlite.generation.sampling import (
    GenerationDiverged,
    SamplingParams,
    agree,
    build_step_batch,
    ended,
    prompt_padding,
    row_budgets,
    take_token,
)
from verlite.generation.static_cache import (
    StaticCache,
    UnsupportedModel,
    attention_shape,
    autocast_dtype,
    cache_bytes,
    check_capturable,
)
from verlite.models.varlen import Padding, known_padding

DecodeMode = Literal["eager", "static", "cuda_graphs"]
DECODE_MODES: tuple[DecodeMode, ...] = ("eager", "static", "cuda_graphs")


@dataclass(frozen=True)
class DecodeSettings:
    """How the sampler decodes (``rollout.decode``, resolved for the worker's device):
    ``eager`` (a cache grown step by step, one kernel launch per op), ``static`` (this
    module, steps run eagerly) or ``cuda_graphs`` (this module, steps replayed as graphs).
    ``batch_buckets``: ascending row counts a generation compacts its unfinished rows to
    (None: the powers of two below the batch); ``kv_block``: a captured step attends to its
    filled positions rounded up to a multiple of this; ``reserve``: (rows, positions) the
    cache holds from its first generation on, the most a run generates at once (a cache
    grown later drops the graphs captured on it); ``pad_to_bucket``: whether the first
    steps run on a bucket, the batch padded with finished rows (:func:`buckets_for`), not
    on the batch itself (None: with ``cuda_graphs`` only, whose graphs are then captured
    per bucket, not per batch size; on in ``static`` for tests, its results unchanged)."""

    mode: DecodeMode = "eager"
    batch_buckets: tuple[int, ...] | None = None
    kv_block: int = 64
    reserve: tuple[int, int] = (0, 0)
    pad_to_bucket: bool | None = None

    def __post_init__(self) -> None:
        if self.mode not in DECODE_MODES:
            raise ValueError(f"decode mode {self.mode!r}: choose one of {', '.join(DECODE_MODES)}")
        if self.kv_block < 1:
            raise ValueError(f"kv_block {self.kv_block}: must be at least 1")

    @property
    def pads_to_bucket(self) -> bool:
        """``pad_to_bucket`` resolved: on for ``cuda_graphs`` unless set."""
        if self.pad_to_bucket is None:
            return self.mode == "cuda_graphs"
        return self.pad_to_bucket


EAGER = DecodeSettings()


def check_mode_supported(config: PretrainedConfig, mode: DecodeMode, *, longest: int) -> None:
    """A model of ``config`` can decode sequences of up to ``longest`` tokens (the run's
    ``max_sequence_length``) in ``mode``: any model eagerly, statically one whose every layer
    then attends as full causal attention (full attention, or a sliding window no sequence
    passes), and for CUDA graphs rotary embeddings that keep to the device;
    :class:`~verlite.generation.static_cache.UnsupportedModel` otherwise."""
    if mode == "static":
        attention_shape(config, longest=longest)
    elif mode == "cuda_graphs":
        check_capturable(config, longest=longest)


def auto_mode(
    config: PretrainedConfig,
    *,
    device: torch.device,
    lockstep: bool,
    per_rank: bool,
    longest: int,
) -> DecodeMode:
    """``rollout.decode=auto``: cuda_graphs on cuda, or the fastest mode the run and the
    model allow: static in ``lockstep`` (FSDP's all-gathers cannot be captured) or for a
    step that cannot be captured; eager on CPU (where it is fastest), with a per-rank noise
    stream (``per_rank``: compaction would change its draws) and for a model the static
    path cannot run on sequences of ``longest`` tokens (:func:`check_mode_supported`)."""
    if device.type != "cuda" or per_rank:
        return "eager"
    modes: tuple[DecodeMode, ...] = ("static",) if lockstep else ("cuda_graphs", "static")
    for mode in modes:
        try:
            check_mode_supported(config, mode, longest=longest)
        except UnsupportedModel:
            continue
        return mode
    return "eager"


def buckets_for(
    batch: int, buckets: tuple[int, ...] | None, *, held: int | None = None
) -> tuple[int, ...]:
    """The row counts a generation of ``batch`` rows runs on, ascending, its first steps on
    the last: the buckets below it (None: the powers of two), then the batch itself; or,
    padded within buffers that hold ``held`` rows, the smallest bucket of at least ``batch``
    rows (past the largest, the next power of two) or ``held`` when fewer: a bounded set of
    row counts whatever the batch sizes. Padding never grows the buffers (the cache is kept
    between generations, and a padded validation batch of 1,319 rows would hold 2,048): a
    batch past ``held`` runs on itself, the buffers grown to it (which drops every graph
    anyway), and later batches pad within it."""
    top = batch
    if held is not None and held >= batch:
        above = [b for b in buckets or () if b >= batch]
        top = min(min(above) if above else 1 << (batch - 1).bit_length(), held)
    if buckets is None:
        buckets = tuple(2**k for k in range(top.bit_length()))
    return (*sorted({b for b in buckets if 0 < b < top}), top)


class GenerationTooLarge(RunFailure):
    """The KV cache of a generation does not fit the memory free on its device."""


class GraphCaptureFailed(RunFailure):
    """A decode step could not be captured as a CUDA graph."""


# Most distinct end tokens a static generation checks: EOS, a turn's stop token, model.path's
# own end tokens and rollout.stop_token_ids (at most MAX_STOP_TOKENS; checked at start-up).
MAX_END_TOKENS = 12
MAX_STOP_TOKENS = 6


class _Long(TypedDict):
    """The options of the int64 buffers a generation allocates on its device."""

    dtype: torch.dtype
    device: torch.device


def free_bytes(device: torch.device) -> int | None:
    """Bytes a new allocation can take on ``device``: free on the GPU, plus what torch's
    caching allocator holds unused; None on CPU (not checked)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


class StaticDecoder:
    """Samples like :class:`~verlite.generation.sampler.Sampler`, on a static KV cache."""

    def __init__(
        self,
        model: nn.Module,
        *,
        eos_token_id: int,
        pad_token_id: int,
        lockstep: bool,
        settings: DecodeSettings,
    ) -> None:
        if settings.mode == "eager":
            raise ValueError("StaticDecoder runs the static modes, not eager")
        self.model = model
        self.eos_token_id, self.pad_token_id = eos_token_id, pad_token_id
        self.lockstep = lockstep
        self.settings = settings
        self.cache: StaticCache | None = None
        self.graphs: dict[tuple[int, int, float, int, float], torch.cuda.CUDAGraph] = {}
        self._graph_pool: torch.cuda._POOL_HANDLE | None = None
        self._side_stream: torch.cuda.Stream | None = None  # where a capture's warm-up runs
        self._addresses: list[int] = []  # of the model's tensors, which the graphs read
        self.unmasked = False  # a generation's steps attend without a mask (``_start``)

    # ------------------------------------------------------------------ buffers
    def _kv_dtype(self, device: torch.device) -> torch.dtype:
        """The dtype attention reads keys and values in: autocast's, else the model's."""
        dtype = autocast_dtype(device)
        if dtype is not None:
            return dtype
        return next(p.dtype for p in self.model.parameters() if p.is_floating_point())

    def _ensure_buffers(self, rows: int, capacity: int, device: torch.device) -> None:
        """Buffers for ``rows`` rows of ``capacity`` positions (at least ``reserve``), the ones
        held if they are large enough (grown otherwise, the graphs captured on the old ones
        dropped)."""
        dtype = self._kv_dtype(device)
        rows, capacity = (
            max(rows, self.settings.reserve[0]),
            max(capacity, self.settings.reserve[1]),
        )
        cache = self.cache
        if cache is not None:
            if (
                cache.rows >= rows
                and cache.capacity >= capacity
                and cache.dtype == dtype
                and cache.state.slot.device == device
            ):
                return
            # grown, never shrunk: the next generations fit it too
            rows, capacity = max(rows, cache.rows), max(capacity, cache.capacity)
        if self.settings.mode == "cuda_graphs":
            block = self.settings.kv_block
            capacity = -(-capacity // block) * block
        self._release()  # the old buffers go before the new ones are counted and allocated
        # The model is a Hugging Face causal LM (FSDP2 keeps its class), or a peft model
        # around one, whose ``config`` is its base model's.
        config = self.model.config
        assert isinstance(config, PretrainedConfig)
        needed = cache_bytes(config, rows, capacity, dtype)
        free = free_bytes(device)
        fits = free is None or needed <= free
        if self.lockstep:  # every rank refuses, or none: FSDP's ranks all-gather together
            fits = not agree(torch.tensor([int(not fits)], device=device), lockstep=True)[0]
        if not fits:
            where = "on this rank" if free is not None and needed > free else "on another rank"
            raise GenerationTooLarge(
                f"rollout: the KV cache of {rows} rows x {capacity} positions "
                f"({needed / 2**30:.2f} GiB in {dtype}) does not fit the memory free {where}"
                f"{'' if free is None else f' ({free / 2**30:.2f} GiB on {device})'}: generate "
                "fewer rows per worker (data.train_batch_size x rollout.n / the generating "
                "workers) or shorter sequences (data.max_prompt_length, "
                "rollout.max_response_length)"
            )
        self.cache = StaticCache(config, rows=rows, capacity=capacity, dtype=dtype, device=device)
        long = _Long(dtype=torch.int64, device=device)
        self.ids = torch.zeros((rows, 1), **long)  # the token each row's next step reads
        self.positions = torch.zeros((rows, 1), **long)
        self.mask = torch.zeros((rows, 1, 1, capacity), dtype=torch.bool, device=device)
        self.keys = torch.zeros((rows, 2), **long)
        self.finished = torch.ones(rows, dtype=torch.bool, device=device)
        self.row_of = torch.zeros(rows, **long)  # its response row; ``rows``: the scratch row
        # Per response row, the last one a scratch row for the rows that carry no response.
        self.responses = torch.zeros((rows + 1, capacity), **long)
        self.log_probs = torch.zeros((rows + 1, capacity), dtype=torch.float32, device=device)
        self.lengths = torch.zeros(rows + 1, **long)
        self.budgets = torch.zeros(rows + 1, **long)  # per response row (``row_budgets``)
        self.ends = torch.full((MAX_END_TOKENS,), -1, **long)
        self.position = torch.zeros(1, **long)  # the decode position being sampled
        self.diverged = torch.full((2,), -1, **long)  # (decode position, rows) of the first
        # What the host reads of a step, written by the step itself (``_take``): its unfinished
        # rows, ``diverged``, and whether any row is unfinished / any diverged (those two
        # agreed over the ranks in lockstep); copied into one of two host buffers (pinned on
        # cuda, with the event that says the copy is done), a step's while the last is read.
        self.flags = torch.zeros(5, **long)
        pinned = device.type == "cuda"
        self.host_flags = [torch.zeros(5, dtype=torch.int64, pin_memory=pinned) for _ in range(2)]
        self.copied = [torch.cuda.Event() if pinned else None for _ in range(2)]  # type: ignore[no-untyped-call]  # torch leaves Event.__new__ unannotated

    def _check_device(self, device: torch.device) -> None:
        if self.settings.mode == "cuda_graphs" and device.type != "cuda":
            raise ValueError(
                f"rollout.decode=cuda_graphs captures CUDA graphs; this model generates on "
                f"{device}: use rollout.decode=static or eager (auto picks)"
            )

    def _release(self) -> None:
        """Drop the graphs, then the cache (its buffers freed at once: nothing else holds them)."""
        self._drop_graphs()
        self.cache = None

    def _drop_graphs(self) -> None:
        """Drop every graph and their pool (a pool id outlives no graph of it)."""
        self.graphs.clear()
        self._graph_pool = None

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate(
        self, prompts: TensorDict, params: SamplingParams, noise: Noise | None
    ) -> TensorDict:
        """Responses to ``prompts`` as :meth:`Sampler.generate` draws them (keyed noise, or
        greedy: a per-rank stream's draws depend on where each row sits, which compaction
        changes, so it is refused)."""
        if noise is None and params.temperature != 0:
            raise ValueError(f"sampling at temperature {params.temperature} needs noise")
        if noise is not None and not isinstance(noise, KeyedNoise):
            raise ValueError(
                f"rollout.decode={self.settings.mode} draws with per-sample keys only "
                "(rollout.randomness=per_sample); per_rank needs rollout.decode=eager"
            )
        ends = sorted(set(params.end_tokens(self.eos_token_id)))
        if len(ends) > MAX_END_TOKENS:
            raise ValueError(
                f"{len(ends)} tokens end a response; the static decode path checks at most "
                f"{MAX_END_TOKENS}"
            )
        input_ids, prompt_mask = prompts["input_ids"], prompts["attention_mask"]
        batch, width = input_ids.shape
        device, new = input_ids.device, params.max_new_tokens
        self._check_device(device)
        held = None
        if self.settings.pads_to_bucket:
            held = max(self.settings.reserve[0], 0 if self.cache is None else self.cache.rows)
        buckets = buckets_for(batch, self.settings.batch_buckets, held=held)
        rows = buckets[-1]  # the first steps' rows: the batch, then finished padding rows
        self._ensure_buffers(rows, width + new, device)
        cache = self.cache
        assert cache is not None
        self._check_addresses()
        padding = prompt_padding(prompts)
        self._start(prompts, ends, noise, row_budgets(prompts, params), padding)
        # The prompts: one eager forward on the real prompt width, which writes positions
        # 0 .. width of the cache, then the first token.
        cache.state.prefilling = True
        try:
            with known_padding(padding):  # Hugging Face's check would read the device
                out = self.model(
                    input_ids=input_ids,
                    attention_mask=prompt_mask,
                    position_ids=prompts["position_ids"],
                    cache=cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
        finally:
            cache.state.prefilling = False
        self._take(out.logits[:, -1], batch, params)
        self._send(0)
        t = 0
        # Step t goes out before the flags of step t - 1 are read (the module's docstring):
        # the next bucket holds the rows unfinished before step t, at least those after it.
        for t in range(1, new):
            self._step(rows, self._span(width + t), params)
            self._send(t)
            active, running = self._check(t - 1, batch)
            if not running or t == new - 1:
                break
            smaller = next(b for b in buckets if b >= max(active, 1))
            if smaller < rows:
                self._compact(rows, smaller)
                rows = smaller
        self._check(t, batch)  # the last step's flags: whether it diverged
        real = torch.arange(new, device=device) < self.lengths[:batch, None]
        return build_step_batch(
            prompts,
            self.responses[:batch, :new].clone(),
            real,
            self.log_probs[:batch, :new].clone(),
        )

    def _start(
        self,
        prompts: TensorDict,
        ends: list[int],
        noise: Noise | None,
        budgets: torch.Tensor,
        padding: Padding,
    ) -> None:
        """The per-row state of a new generation of ``prompts``, in the held buffers."""
        batch, width = prompts["input_ids"].shape
        prompt_mask = prompts["attention_mask"]
        cache = self.cache
        assert cache is not None
        # Rows past the batch (a padded bucket's among them) carry nothing: finished, their
        # response the scratch row, a valid token at position 0 attending to nothing but the
        # position a step writes, whatever an earlier generation left there (what they
        # compute from their cache rows, NaN included, stays in them and is never sampled).
        self.finished.fill_(True)
        self.finished[:batch] = False
        self.row_of.fill_(cache.rows)
        self.row_of[:batch] = torch.arange(batch, device=self.row_of.device)
        self.ids.fill_(self.pad_token_id)
        self.positions.zero_()
        self.mask.fill_(False)
        self.mask[:batch, 0, 0, :width] = prompt_mask.bool()
        # Every position a step attends to is filled when no prompt is padded (known on the
        # host: ``prompt_padding``); a captured step also attends past them (``_span``):
        # always masked.
        self.unmasked = self.settings.mode == "static" and padding is Padding.NONE
        if isinstance(noise, KeyedNoise):
            self.keys[:batch] = noise.keys
        self.responses.fill_(self.pad_token_id)
        self.log_probs.zero_()
        self.lengths.zero_()
        self.budgets.zero_()
        self.budgets[:batch] = budgets
        self.ends.fill_(-1)
        self.ends[: len(ends)] = torch.tensor(ends, dtype=torch.int64)
        # The first token is sampled at decode position 0 from the prefill; the step that
        # feeds it writes position ``width`` and reads the row's next position.
        self.position.zero_()
        self.positions[:batch] = prompt_mask.sum(-1, keepdim=True) - 1
        cache.state.slot.fill_(width - 1)
        self.diverged.fill_(-1)

    def _take(self, logits: torch.Tensor, rows: int, params: SamplingParams) -> None:
        """Sample decode position ``self.position`` for the first ``rows`` rows from their
        ``logits``, record it, write the step's ``flags`` and advance every device counter:
        no host number involved."""
        finished = self.finished[:rows]
        uniforms = (
            None if params.temperature == 0 else keyed_uniforms(self.keys[:rows], self.position)
        )
        token, log_prob, nonfinite = take_token(
            logits, params, uniforms, finished, self.pad_token_id
        )
        row_of = self.row_of[:rows]
        column = self.position.expand(rows)
        self.responses.index_put_((row_of, column), token)
        self.log_probs.index_put_((row_of, column), log_prob)
        self.lengths.index_add_(0, row_of, (~finished).long())
        finished |= ended(token, self.ends)
        finished |= self.lengths[row_of] >= self.budgets[row_of]
        # An unfinished row reads its next position; a finished one stays at the one it
        # read last, as eager's do.
        self.positions[:rows] += (~finished).long()[:, None]
        # The first position with a non-finite row, and how many rows it had.
        first = (self.diverged[0] < 0) & nonfinite.any()
        self.diverged.copy_(
            torch.where(first, torch.stack([self.position[0], nonfinite.sum()]), self.diverged)
        )
        unfinished = (~finished).sum().view(1)
        self.flags.copy_(
            torch.cat([unfinished, self.diverged, unfinished > 0, self.diverged[:1] >= 0])
        )
        self.ids[:rows, 0] = token
        cache = self.cache
        assert cache is not None  # ``generate`` allocated it before its first step
        cache.state.slot += 1
        self.position += 1

    def _forward(self, rows: int, span: int, params: SamplingParams) -> None:
        """One decode step on the first ``rows`` rows attending to ``span`` positions."""
        cache = self.cache
        assert cache is not None
        cache.state.span = span
        mask = None
        if not self.unmasked:
            mask = self.mask[:rows]
            mask.index_fill_(3, cache.state.slot, True)
            mask = mask[..., :span]
        out = self.model(
            input_ids=self.ids[:rows],
            attention_mask=mask,
            position_ids=self.positions[:rows],
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self._take(out.logits[:, -1], rows, params)

    def _span(self, filled: int) -> int:
        """The positions a step with ``filled`` of them filled attends to: exactly those
        eagerly, rounded up to a ``kv_block`` multiple when captured (fewer shapes)."""
        if self.settings.mode == "static":
            return filled
        block = self.settings.kv_block
        assert self.cache is not None
        return min(-(-filled // block) * block, self.cache.capacity)

    def _send(self, position: int) -> None:
        """Start copying the flags of decode position ``position``, the step just launched,
        to the host (in stream order after it, agreed over the ranks first in ``lockstep``):
        on cuda a non-blocking copy into pinned memory, its event recorded."""
        if self.lockstep:
            all_reduce_max(self.flags[3:])
        self.host_flags[position % 2].copy_(self.flags, non_blocking=True)
        event = self.copied[position % 2]
        if event is not None:
            event.record(torch.cuda.current_stream(self.flags.device))  # the copy's stream

    def _check(self, position: int, batch: int) -> tuple[int, bool]:
        """This rank's rows unfinished after decode position ``position``, and whether any
        rank has one, as ``_send`` copied them (waiting for that copy only: the one host read
        of a step); raises, on every rank, if a row sampled from non-finite logits."""
        event = self.copied[position % 2]
        if event is not None:
            event.synchronize()
        active, at, diverged_rows, running, diverged = self.host_flags[position % 2].tolist()
        if diverged:
            # A rank whose rows stayed finite names this position, as eager does.
            raise GenerationDiverged(at if at >= 0 else position, max(diverged_rows, 0), batch)
        return active, bool(running)

    def _compact(self, rows: int, target: int) -> None:
        """Move the unfinished of the first ``rows`` rows to the front, then fill up to
        ``target`` rows with finished ones whose responses go to the scratch row."""
        cache = self.cache
        assert cache is not None
        active = (~self.finished[:rows]).nonzero().flatten()
        count = len(active)
        # The filling rows copy an unfinished row (any row with no unfinished one: in lockstep,
        # or when the last ones finished at the step the lagged flags did not see yet).
        filler = active[:1] if count else active.new_zeros(1)
        index = torch.cat([active, filler.expand(target - count)])
        cache.gather_rows(index)
        for buffer in (self.ids, self.positions, self.mask, self.keys, self.finished, self.row_of):
            buffer[:target] = buffer[index]
        self.finished[count:target] = True
        self.row_of[count:target] = cache.rows

    def _step(self, rows: int, span: int, params: SamplingParams) -> None:
        """One decode step: run eagerly (``static``), or replay its graph, captured (its first
        run a real step) when this shape and these settings are new."""
        if self.settings.mode == "static":
            self._forward(rows, span, params)
            return
        key = (rows, span, params.temperature, params.top_k, params.top_p)
        graph = self.graphs.get(key)
        if graph is not None:
            graph.replay()
            return
        self.graphs[key] = self._capture(lambda: self._forward(rows, span, params))

    def _capture(self, step: Callable[[], None]) -> torch.cuda.CUDAGraph:
        """Run ``step`` once on a side stream (the warm-up capture needs, and a real step),
        then capture it. Autocast's weight cache is off while capturing: a cast cached
        during capture would be freed with the region, under the graph's feet."""
        device = self.responses.device
        autocast = torch.autocast(
            "cuda",
            dtype=torch.get_autocast_dtype("cuda"),
            enabled=torch.is_autocast_enabled("cuda"),
            cache_enabled=False,
        )
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]  # torch leaves Stream.__new__ unannotated
        side = self._side_stream
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side), autocast:
            step()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        failed: RuntimeError | None = None  # what the step raised while being captured
        try:
            with torch.cuda.graph(graph, pool=self._graph_pool), autocast:
                try:
                    step()
                except RuntimeError as exc:
                    failed = exc
                    raise
        except RuntimeError as exc:
            # An op the capture refuses (a host read, say) raises in the step and breaks the
            # capture; leaving torch.cuda.graph still ends it (capture_end), which then raises
            # CUDA's "operation failed due to a previous error during capture" in its place.
            cause = failed or exc
            raise GraphCaptureFailed(
                f"rollout: a decode step of {type(self.model).__name__} could not be captured "
                f"as a CUDA graph ({str(cause).splitlines()[0]}); use rollout.decode=static"
            ) from cause
        if self._graph_pool is None:
            self._graph_pool = graph.pool()
        return graph

    def _check_addresses(self) -> None:
        """Drop the graphs if the model's tensors moved since they were captured (a graph
        reads addresses: in-place updates, as an optimizer step and a weight sync on cuda
        make, keep them valid)."""
        if self.settings.mode != "cuda_graphs":
            return
        addresses = [t.data_ptr() for t in (*self.model.parameters(), *self.model.buffers())]
        if addresses != self._addresses:
            self._drop_graphs()
            self._addresses = addresses
