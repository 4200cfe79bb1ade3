"""The static decode path (``verlite.generation.decode``) against the eager sampler: the same
tokens, log-probs and masks, bit for bit on CPU, with rows compacted out as they finish. Every
test here multiplies matrices a row at a time (``tests.batch_invariant_support``): the paths
multiply different numbers of rows, and a BLAS rounds a row by how many it multiplies."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import replace
from functools import partial
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from tensordict import TensorDict
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers.cache_utils import Cache

from tests.batch_invariant_support import RowByRowMatmul
from tests.generation.test_sampler import EOS, PAD, VOCAB, prompts
from tests.model_support import TINY_DECODER, tiny_mla, tiny_qwen2, tiny_sliding
from verlite.config import LoraConfig, ModelConfig
from verlite.generation import DecodeSettings, KeyedNoise, Sampler, SamplingParams, sample_keys
from verlite.generation import decode as decode_module
from verlite.generation.decode import (
    MAX_END_TOKENS,
    GraphCaptureFailed,
    StaticDecoder,
    buckets_for,
)
from verlite.generation.sampler import PreallocatedCacheLayer
from verlite.generation.static_cache import (
    StaticCache,
    StaticCacheLayer,
    cache_bytes,
    position_elements,
)
from verlite.models import build_policy
from verlite.models.lora import apply_lora
from verlite.models.precision import autocast, cache_dtype


@pytest.fixture(autouse=True)
def row_by_row() -> Iterator[None]:
    with RowByRowMatmul():
        yield


class RecordedGraphs(StaticDecoder):
    """``cuda_graphs`` on CPU: a 'captured graph' is the list of tensor ops its first step ran
    (:class:`RecordedOps`), replayed as a CUDA graph replays its kernels: on the tensors the
    capture saw, whatever Python has bound since (a buffer rebound rather than written in
    place is never read again), with every Python number the step computed then."""

    captured: int = 0

    def _check_device(self, device: torch.device) -> None:
        pass

    def _capture(self, step: Callable[[], None]) -> SimpleNamespace:  # type: ignore[override]
        self.captured += 1
        ops = RecordedOps()
        with ops:
            step()
        return SimpleNamespace(replay=ops.replay)


class RecordedOps(TorchDispatchMode):
    """The aten ops run in the block, each with the tensors it read and wrote. :meth:`replay`
    runs them again as a CUDA graph would: an in-place op writes the same tensor again, an
    op that makes a new tensor writes its result into the tensor it made when recorded (the
    address the graph reads it at), a view still views what it viewed; a host number an op
    returned must come out the same (a graph cannot return one)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, tuple[Any, ...], dict[str, Any], Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out

    def replay(self) -> None:
        for func, args, kwargs, out in self.ops:
            if func._schema.is_mutable:
                func(*args, **kwargs)
                continue
            if any(result.alias_info is not None for result in func._schema.returns):
                continue  # a view: of the same memory as when recorded
            new = func(*args, **kwargs)
            for held, now in zip(tree_flatten(out)[0], tree_flatten(new)[0], strict=True):
                if isinstance(held, torch.Tensor):
                    held.copy_(now)
                else:
                    assert held == now, f"{func} returned {now} on the host, {held} at capture"


def llama(dtype: str) -> torch.nn.Module:
    return build_policy(ModelConfig(precision=dtype), vocab_size=VOCAB, max_positions=96, seed=0)


def sampler(model: torch.nn.Module, decode: DecodeSettings, eos: int = EOS) -> Sampler:
    out = Sampler(model, eos_token_id=eos, pad_token_id=PAD, lockstep=False, decode=decode)
    if decode.mode == "cuda_graphs":
        out.static = RecordedGraphs(
            model, eos_token_id=eos, pad_token_id=PAD, lockstep=False, settings=decode
        )
    return out


def ragged_eos(model: torch.nn.Module, td: TensorDict, params: SamplingParams, seed: int) -> int:
    """A token that, taken as EOS, ends the rows at many different steps (a random model
    rarely draws the real one): the token first drawn at the most distinct positions."""
    probe = sampler(model, DecodeSettings("eager"))
    drawn = probe.generate(td, replace(params, ignore_eos=True), noise(td, seed, 14))["responses"]
    firsts = {}
    for token in drawn.unique().tolist():
        hit = drawn == token
        firsts[token] = len(set(hit.int().argmax(-1)[hit.any(-1)].tolist()))
    return max(firsts, key=firsts.__getitem__)


def noise(td: TensorDict, seed: int, horizon: int) -> KeyedNoise:
    return KeyedNoise(sample_keys(seed, 1, len(td), 1), horizon=horizon)


def assert_same(a: TensorDict, b: TensorDict) -> None:
    assert set(a.keys()) == set(b.keys())
    for key in a.keys():  # noqa: SIM118 (a TensorDict iterates over its rows)
        if isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


SETTINGS = {
    "greedy": SamplingParams(14, temperature=0.0),
    "sampled": SamplingParams(14),
    "top_k_top_p": SamplingParams(14, temperature=0.8, top_k=9, top_p=0.85),
}


@pytest.mark.parametrize("dtype", ["fp32", "fp64"])
@pytest.mark.parametrize("name", list(SETTINGS))
@pytest.mark.parametrize("buckets", [None, (1, 3, 5, 8)])
def test_static_matches_eager_bit_for_bit(dtype: str, name: str, buckets) -> None:
    model, td, params = llama(dtype), prompts(batch=12, width=9, seed=1), SETTINGS[name]
    eos = ragged_eos(model, td, params, 4)
    eager = sampler(model, DecodeSettings("eager"), eos).generate(td, params, noise(td, 4, 14))
    static = sampler(model, DecodeSettings("static", batch_buckets=buckets), eos)
    calls: list[int] = []
    forward = static.static._forward  # type: ignore[union-attr]
    static.static._forward = lambda rows, span, p: (calls.append(rows), forward(rows, span, p))  # type: ignore[union-attr,method-assign]
    assert_same(static.generate(td, params, noise(td, 4, 14)), eager)
    # Step t ran on the smallest bucket holding the rows unfinished before step t - 1 (the
    # host reads a step's flags while the next step runs: its choice lags a step, compacted
    # as rows finish), and the steps stopped one step after the last row finished.
    lengths = eager["response_mask"].sum(-1)
    sizes = buckets_for(len(td), buckets)
    expected = [
        next(b for b in sizes if b >= int((lengths > t - 1).sum()))
        for t in range(1, min(int(lengths.max()) + 1, params.max_new_tokens))
    ]
    assert calls == expected and len(set(calls)) > 1


def unpadded_models() -> dict[str, Callable[[], torch.nn.Module]]:
    from verlite.models.varlen import enable_packing

    def packed() -> torch.nn.Module:
        model = llama("fp32")
        enable_packing(model)
        return model

    return {
        "llama": lambda: llama("fp32"),
        "llama_packing": packed,
        "qwen2_lora": lambda: apply_lora(
            tiny_qwen2(tied=True, vocab_size=VOCAB), LoraConfig(rank=4), seed=0
        ),
        **{kind: partial(tiny_sliding, kind, 9 + 14, vocab_size=VOCAB) for kind in WINDOWED},
    }


WINDOWED = ("mistral", "qwen2", "gemma3")


@pytest.mark.parametrize("name", list(SETTINGS))
@pytest.mark.parametrize("kind", ["llama", "llama_packing", "qwen2_lora", *WINDOWED])
def test_prompts_without_padding_decode_statically_as_eagerly(name: str, kind: str) -> None:
    """No prompt padded: the eager sampler's Hugging Face attention drops its mask, and SDPA
    without a mask rounds otherwise than with one; a static step then attends without one
    too: bit for bit in float32, whatever attention the model runs (packing's, a window no
    sequence passes)."""
    model, td, params = unpadded_models()[kind](), prompts(batch=8, width=9, seed=3), SETTINGS[name]
    td["attention_mask"] = torch.ones_like(td["attention_mask"])
    td["input_ids"] = td["input_ids"].clamp(min=3)
    td["position_ids"] = torch.arange(9).expand(8, 9).clone()
    eager = sampler(model, DecodeSettings("eager")).generate(td, params, noise(td, 6, 14))
    static = sampler(model, DecodeSettings("static")).generate(td, params, noise(td, 6, 14))
    assert_same(static, eager)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_replayed_steps_match_eager(name: str) -> None:
    """cuda_graphs' bookkeeping on CPU (a 'graph' replays its first step's ops): one capture per
    (bucket, span, settings), replayed; the span rounded up to kv_block adds masked positions
    to the attention sums: the same tokens, log-probs identical in float64, within a float32
    rounding in float32."""
    params = SETTINGS[name]
    decode = DecodeSettings("cuda_graphs", batch_buckets=(2, 4, 8), kv_block=4)
    for dtype in ("fp64", "fp32"):
        model, td = llama(dtype), prompts(batch=12, width=9, seed=2)
        eos = ragged_eos(model, td, params, 5)
        eager = sampler(model, DecodeSettings("eager"), eos).generate(td, params, noise(td, 5, 14))
        graphs = sampler(model, decode, eos)
        out = graphs.generate(td, params, noise(td, 5, 14))
        decoder = graphs.static
        assert isinstance(decoder, RecordedGraphs)
        steps = int(eager["response_mask"].sum(-1).max()) - 1
        assert 1 < decoder.captured < steps  # shapes repeat: replayed, not captured again
        for key in ("responses", "response_mask", "input_ids", "attention_mask"):
            assert torch.equal(out[key], eager[key]), key
        diff = (out["rollout_log_probs"] - eager["rollout_log_probs"]).abs().max()
        assert diff == 0 if dtype == "fp64" else diff < 1e-5
        # A second generation replays what the first captured (same shapes and settings).
        before = decoder.captured
        assert torch.equal(
            graphs.generate(td, params, noise(td, 5, 14))["responses"], out["responses"]
        )
        assert decoder.captured == before


def test_buffers_are_reused_across_generations_of_other_shapes() -> None:
    """One decoder, generations of other batches, widths, lengths and stop tokens in turn
    (the buffers grow, and what an earlier one left in them is never read): each as eager."""
    model = llama("fp64")  # exact with rounded spans
    static = sampler(model, DecodeSettings("cuda_graphs", kv_block=8))
    eager = sampler(model, DecodeSettings("eager"))
    for batch, width, new, stop in [
        (6, 5, 8, ()),
        (12, 9, 14, (7,)),
        (3, 11, 5, ()),
        (12, 4, 20, (9, 11)),
    ]:
        td = prompts(batch=batch, width=width, seed=batch + width)
        params = SamplingParams(new, stop_token_ids=stop)
        expected = eager.generate(td, params, noise(td, 3, new))
        assert_same(static.generate(td, params, noise(td, 3, new)), expected)


@pytest.mark.parametrize("tied", [True, False])
def test_qwen2_and_lora_match_eager(tied: bool) -> None:

    for model in (
        tiny_qwen2(tied=tied, vocab_size=VOCAB).double(),
        apply_lora(tiny_qwen2(tied=tied, vocab_size=VOCAB), LoraConfig(rank=4), seed=0),
    ):
        td, params = prompts(batch=10, width=7, seed=3), SETTINGS["top_k_top_p"]
        eos = ragged_eos(model, td, params, 6)
        eager = sampler(model, DecodeSettings("eager"), eos).generate(td, params, noise(td, 6, 14))
        static = sampler(model, DecodeSettings("static"), eos).generate(
            td, params, noise(td, 6, 14)
        )
        assert_same(static, eager)


def test_a_layer_caching_tensors_of_its_own_shapes_decodes_statically_as_eagerly() -> None:
    """DeepSeek-V3's latent attention caches a one-head latent and a one-head rotary key of
    other widths than its config's KV heads x head dim (which the eager cache never reads):
    each layer's static buffers take the shapes of what the layer writes. Static and
    replayed decoding give eager decoding's tokens and float64 log-probs, compacted."""
    model = tiny_mla(vocab_size=VOCAB).double()
    td, params = prompts(batch=10, width=7, seed=3), SETTINGS["top_k_top_p"]
    eos = ragged_eos(model, td, params, 6)
    eager = sampler(model, DecodeSettings("eager"), eos).generate(td, params, noise(td, 6, 14))
    assert len(set(eager["response_mask"].sum(-1).tolist())) > 2  # rows end apart: compacted
    for decode in (
        DecodeSettings("static", batch_buckets=(2, 4, 8)),
        DecodeSettings("cuda_graphs", batch_buckets=(2, 4, 8), kv_block=4),
    ):
        assert_same(sampler(model, decode, eos).generate(td, params, noise(td, 6, 14)), eager)


@pytest.mark.parametrize("kind", ["mistral", "qwen2", "gemma3"])
def test_a_window_no_sequence_passes_decodes_statically_as_eagerly(kind: str) -> None:
    """A sliding window as long as the longest sequence (prompts of up to 7 tokens and 14
    new ones: 21) never binds: static and replayed (cuda_graphs on CPU) decoding, whose
    masks apply no window, give eager decoding's tokens and float64 log-probs, Hugging
    Face's window applied, bit for bit. A window a sequence passes does bind there, which
    is why the static modes refuse it (``check_mode_supported``)."""
    from verlite.generation.decode import check_mode_supported

    td, params = prompts(batch=10, width=7, seed=3), SETTINGS["top_k_top_p"]
    longest = 7 + params.max_new_tokens
    model = tiny_sliding(kind, longest, vocab_size=VOCAB).double()
    for mode in ("static", "cuda_graphs"):
        check_mode_supported(model.config, mode, longest=longest)  # type: ignore[arg-type]
    eos = ragged_eos(model, td, params, 6)
    eager = sampler(model, DecodeSettings("eager"), eos).generate(td, params, noise(td, 6, 14))
    assert int(eager["attention_mask"].sum(-1).max()) > longest - 3  # rows near the window
    for decode in (DecodeSettings("static"), DecodeSettings("cuda_graphs", kv_block=4)):
        assert_same(sampler(model, decode, eos).generate(td, params, noise(td, 6, 14)), eager)
    binding = tiny_sliding(kind, 6, vocab_size=VOCAB).double()
    eager = sampler(binding, DecodeSettings("eager"), eos).generate(td, params, noise(td, 6, 14))
    static = sampler(binding, DecodeSettings("static"), eos).generate(td, params, noise(td, 6, 14))
    assert not torch.equal(static["rollout_log_probs"], eager["rollout_log_probs"])


class Counting(StaticDecoder):
    """Records each check's count of unfinished rows, and the rows added to fill a bucket."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.counted: list[int] = []
        self.filled = 0

    def _check(self, position: int, batch: int) -> tuple[int, bool]:
        active, running = super()._check(position, batch)
        self.counted.append(active)
        return active, running

    def _compact(self, rows: int, target: int) -> None:
        self.filled += target - self.counted[-1]
        super()._compact(rows, target)


def test_rows_that_fill_a_bucket_carry_nothing() -> None:
    """Compacted to a bucket larger than the unfinished rows, the rows filling it are finished
    ones: each step counts exactly the rows that are unfinished (as eager's lengths say), and
    their responses are eager's."""
    model, params = llama("fp64"), SETTINGS["sampled"]
    filled = 0
    for seed in range(6):
        td = prompts(batch=12, width=9, seed=seed)
        eos = ragged_eos(model, td, params, seed)
        eager = sampler(model, DecodeSettings("eager"), eos).generate(
            td, params, noise(td, seed, 14)
        )
        static = sampler(model, DecodeSettings("eager"), eos)
        decoder = Counting(
            model,
            eos_token_id=eos,
            pad_token_id=PAD,
            lockstep=False,
            settings=DecodeSettings("static", batch_buckets=(3, 6, 9)),
        )
        static.static = decoder
        assert_same(static.generate(td, params, noise(td, seed, 14)), eager)
        lengths = eager["response_mask"].sum(-1)
        # (the check after the last position counts the rows that ran to the maximum too)
        steps = decoder.counted[: params.max_new_tokens - 1]
        assert steps == [int((lengths > t).sum()) for t in range(1, len(steps) + 1)]
        filled += decoder.filled
    assert filled > 0


class Ordered(RecordedGraphs):
    """Records in order each decode step launched, each step's flags sent to the host and
    each step's flags read there (the prefill's, decode position 0, are sent first)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.log: list[str] = []

    def _step(self, rows: int, span: int, params: SamplingParams) -> None:
        self.log.append(f"launch {sum(e.startswith('launch') for e in self.log) + 1}")
        super()._step(rows, span, params)

    def _send(self, position: int) -> None:
        self.log.append(f"send {position}")
        super()._send(position)

    def _check(self, position: int, batch: int) -> tuple[int, bool]:
        self.log.append(f"read {position}")
        return super()._check(position, batch)


@pytest.mark.parametrize("mode", ["static", "cuda_graphs"])
def test_the_host_reads_a_steps_flags_only_once_the_next_step_is_launched(mode: str) -> None:
    """Step t is launched and its flags' copy started before the flags of step t - 1 are
    read (the one host read of a step): on a GPU the host's read, choice of bucket and
    compaction overlap the next step instead of the GPU waiting for them. Only the last
    step's flags are read with no step after them: the one launched after the last row
    finished, which samples pads only, and the responses are still eager's."""
    from verlite.generation.sampling import BUDGET_KEY

    model, td, params = llama("fp64"), prompts(batch=12, width=9, seed=1), SETTINGS["sampled"]
    eos = ragged_eos(model, td, params, 4)
    td[BUDGET_KEY] = torch.arange(12) % 9 + 1  # every row ends before the last position
    eager = sampler(model, DecodeSettings("eager"), eos).generate(td, params, noise(td, 4, 14))
    decode = DecodeSettings(mode, batch_buckets=(2, 4, 8), kv_block=4)
    static = sampler(model, DecodeSettings("eager"), eos)
    decoder = Ordered(model, eos_token_id=eos, pad_token_id=PAD, lockstep=False, settings=decode)
    static.static = decoder
    assert_same(static.generate(td, params, noise(td, 4, 14)), eager)
    last = int(eager["response_mask"].sum(-1).max())  # the step after the last row's last
    assert last < params.max_new_tokens - 1
    expected = ["send 0"]
    for t in range(1, last + 1):
        expected += [f"launch {t}", f"send {t}", f"read {t - 1}"]
    assert decoder.log == [*expected, f"read {last}"]


def _ragged_lockstep(rank: int, world: int, eos: int) -> tuple[list[int], bool]:
    """Rank 0's rows stop within 6 tokens (their budgets), rank 1's at their end token."""
    from verlite.distributed import apply_fsdp
    from verlite.generation.sampling import BUDGET_KEY

    model, td = apply_fsdp(llama("fp64")), prompts(batch=12, width=9, seed=1 + rank)
    if rank == 0:
        td[BUDGET_KEY] = torch.tensor([1, 2, 3, 4, 5, 6] * 2)
    out = [
        Sampler(model, eos_token_id=eos, pad_token_id=PAD, lockstep=True, decode=decode).generate(
            td, SETTINGS["sampled"], noise(td, 4, 14)
        )
        for decode in (DecodeSettings("eager"), DecodeSettings("static", batch_buckets=(2, 4, 8)))
    ]
    try:
        assert_same(out[1], out[0])
    except AssertionError:
        return [], False
    return out[0]["response_mask"].sum(-1).tolist(), True


def test_fsdp_ranks_whose_rows_finish_at_different_steps_decode_statically_as_eagerly() -> None:
    """In FSDP lockstep over two gloo ranks, rows finishing at many different steps and one
    rank's long before the other's (it then steps on, compacted to its smallest bucket, on
    finished rows only): the static path's responses are eager's on every rank, its decisions
    taken on the flags of the step before, agreed over the ranks."""
    from verlite.distributed import run_on_ranks

    model, td = llama("fp64"), prompts(batch=12, width=9, seed=2)
    eos = ragged_eos(model, td, SETTINGS["sampled"], 4)
    (short, same0), (long, same1) = run_on_ranks(
        _ragged_lockstep, world_size=2, args=(eos,), timeout_s=120
    )
    assert same0 and same1
    assert max(short) <= 6 < max(long)
    assert len(set(short)) >= 4 and len(set(long)) >= 4


@pytest.mark.parametrize("pad", [False, True], ids=["exact", "padded"])
def test_a_cache_that_cannot_fit_is_refused_before_generating(
    monkeypatch: pytest.MonkeyPatch, pad: bool
) -> None:
    """The check counts the batch's rows, padded or not: padding never grows the buffers
    (a batch past what they hold runs on itself)."""
    from verlite.generation import decode

    model, td = llama("fp32"), prompts(batch=12, width=9)
    calls: list[int] = []
    model.register_forward_hook(lambda *args: calls.append(1))
    monkeypatch.setattr(decode, "free_bytes", lambda device: 1000)
    with pytest.raises(
        decode.GenerationTooLarge,
        match=r"rollout: the KV cache of 12 rows x 23 positions \(0\.00 GiB in "
        r"torch\.float32\) does not fit the memory free on this rank \(0\.00 GiB on cpu\)",
    ):
        sampler(model, DecodeSettings("static", pad_to_bucket=pad)).generate(
            td, SamplingParams(14), noise(td, 0, 14)
        )
    assert not calls


def tiny_causal_lm(kind: str, **settings: object) -> torch.nn.Module:
    """A ``kind`` causal LM of two layers of hidden size 32, 4 heads / 2 KV heads (unless
    ``settings`` say otherwise), float32."""
    from transformers import AutoConfig, AutoModelForCausalLM

    common: dict[str, object] = {"vocab_size": VOCAB, **TINY_DECODER}
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **{**common, **settings}))


CACHED_MODELS: dict[str, Callable[[], torch.nn.Module]] = {
    "llama": partial(llama, "fp32"),
    "qwen2-grouped-query": partial(tiny_qwen2, tied=False, vocab_size=VOCAB),
    "qwen3-head-dim-16-of-hidden-32-over-4-heads": partial(tiny_causal_lm, "qwen3", head_dim=16),
    "deepseek_v3-latent-attention-and-experts": partial(
        tiny_mla, vocab_size=VOCAB, first_k_dense_replace=1
    ),
    # Its last 2 of 4 layers read the keys and values of earlier layers, writing none.
    "gemma3n-kv-shared-layers": partial(
        tiny_causal_lm,
        "gemma3n_text",
        num_hidden_layers=4,
        num_kv_shared_layers=2,
        layer_types=["sliding_attention", "full_attention"] * 2,
        head_dim=8,
        intermediate_size=[64] * 4,
        activation_sparsity_pattern=[0.0] * 4,
        laurel_rank=4,
        altup_num_inputs=2,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=VOCAB,
    ),
    # Its rotary scaling reads the largest position on the host: not run on the meta device,
    # counted by the config's rule (exact for its layers).
    "llama-dynamic-rope": partial(
        tiny_causal_lm, "llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0}
    ),
}


def static_cache_of(model: torch.nn.Module, free: int | None = None) -> StaticCache:
    """The static cache a generation of 10 prompts of up to 7 tokens and 14 new ones leaves
    (10 rows x 21 positions), with ``free`` bytes of memory free (None: unbounded)."""
    td = prompts(batch=10, width=7, seed=3)
    static = sampler(model, DecodeSettings("static"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(decode_module, "free_bytes", lambda device: free)
        static.generate(td, SamplingParams(14), noise(td, 0, 14))
    assert static.static is not None and static.static.cache is not None
    return static.static.cache


def allocated_bytes(cache: StaticCache) -> int:
    """Of every layer's key and value buffers (each layer of these models writes)."""
    layers = [layer for layer in cache.layers if isinstance(layer, StaticCacheLayer)]
    assert len(layers) == len(cache.layers)
    return sum(
        buffer.nbytes
        for layer in layers
        for buffer in (layer.key_buffer, layer.value_buffer)
        if buffer is not None
    )


# What the count says of a model it counts by its config's rule (None: nothing).
FALLBACK_LINE = (
    "the KV cache of this {} model is counted by its config (KV heads x head dim in every "
    "layer): its forward does not run on the meta device with a static cache ({})"
)
SAID = {
    "llama-dynamic-rope": FALLBACK_LINE.format(
        "llama", "RuntimeError: Tensor.item() cannot be called on meta tensors"
    )
}


@pytest.mark.parametrize("name", CACHED_MODELS)
def test_the_memory_checks_count_what_the_static_cache_allocates(
    name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """``cache_bytes``, which the start-up check of a GPU's memory and the static path's
    check before it allocates both count, is what a generation's static cache allocates, to
    the byte, for grouped-query heads, heads wider than hidden size / heads, DeepSeek-V3's
    latent attention (through its experts too, on the meta device), Gemma-3n's layers that
    share earlier layers' keys and values, and a model the probe cannot run on the meta
    device (the config's rule, which a warning then says, in one line: nothing is said of a
    model the probe runs). The config's KV heads x head dim in every layer counted this
    DeepSeek-V3's cache 1.6 times over (the real model's 28 times), this Gemma-3n's twice."""
    model = CACHED_MODELS[name]()
    config = dict(vars(model.config))
    caplog.set_level(logging.WARNING)
    counted = cache_bytes(model.config, 10, 21, torch.float32)
    said = [record.getMessage() for record in caplog.records]
    assert said == ([SAID[name]] if name in SAID else [])
    assert vars(model.config) == config  # the probe's attention and experts not the model's
    cache = static_cache_of(model)
    assert (cache.rows, cache.capacity, cache.dtype) == (10, 21, torch.float32)
    assert allocated_bytes(cache) == counted


# Models whose layers need a cache class of their own (Hugging Face's ValueError on the
# static cache): two layers of 4 heads / 2 KV heads of width 8, their linear-attention or
# Mamba layers' sizes beside.
OWN_CACHE: dict[str, tuple[str, dict[str, object], str]] = {
    "qwen3_next": (
        "qwen3_next",
        {
            "layer_types": ["linear_attention", "full_attention"],
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 2,
            "linear_key_head_dim": 8,
            "linear_value_head_dim": 8,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 16,
        },
        "Cannot get recurrent state for non linear attention layer 0 of type StaticCacheLayer.",
    ),
    "falcon_h1": (
        "falcon_h1",
        {"mamba_d_ssm": 32, "mamba_n_heads": 4, "mamba_d_head": 8, "mamba_d_state": 8},
        "Cannot get conv state for non linear attention layer 0 of type StaticCacheLayer.",
    ),
    "minimax": (
        "minimax",
        {
            "layer_types": ["linear_attention", "full_attention"],
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
        },
        "MiniMax uses cache of its own and is not compatible with `cache` of type "
        "<class 'verlite.generation.static_cache.StaticCache'>.",
    ),
}


@pytest.mark.parametrize("name", OWN_CACHE)
def test_a_model_whose_layers_need_a_cache_of_their_own_is_counted_by_its_config(
    name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Qwen3-Next, Falcon-H1 and MiniMax refuse the static cache on the meta device (a
    ``ValueError``): counted by the config's rule, 2 x 2 layers x 2 KV heads x 8 elements a
    position, and said in one line naming the model type and the refusal. Mutation: only a
    ``RuntimeError`` taken as the model's (the dynamic rotary scaling's) raises here."""
    from transformers import AutoConfig

    kind, settings, refusal = OWN_CACHE[name]
    config = AutoConfig.for_model(kind, vocab_size=VOCAB, head_dim=8, **TINY_DECODER, **settings)
    caplog.set_level(logging.WARNING)
    assert position_elements(config) == 2 * 2 * 2 * 8
    assert [record.getMessage() for record in caplog.records] == [
        FALLBACK_LINE.format(kind, f"ValueError: {refusal}")
    ]


def test_any_error_of_the_probes_forward_is_counted_by_the_config_and_said(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An error of any kind in the meta-device forward (an ``AttributeError`` here, as a
    model class's own code or a bug in the cache's layer raises) is counted by the config's
    rule, which is never less than what such a model's layers write, and said in one line
    naming it: a start-up does not end in a traceback for a model the probe cannot run.
    Mutation: only ``RuntimeError`` and ``ValueError`` taken as the model's -> raised."""
    from transformers import LlamaConfig

    def broken(self: StaticCacheLayer, *args: object) -> None:
        raise AttributeError("no attribute\n'buffer'")

    monkeypatch.setattr(StaticCacheLayer, "lazy_initialization", broken)
    caplog.set_level(logging.WARNING)
    assert position_elements(LlamaConfig(**TINY_DECODER)) == 2 * 2 * 2 * 8
    assert [record.getMessage() for record in caplog.records] == [
        FALLBACK_LINE.format("llama", "AttributeError: no attribute 'buffer'")
    ]


@pytest.mark.parametrize("build", CACHED_MODELS.values(), ids=CACHED_MODELS.keys())
def test_the_memory_checks_count_what_the_eager_cache_holds_under_autocast(
    build: Callable[[], torch.nn.Module],
) -> None:
    """The eager sampler (what runs on CPU, with per-rank noise, and for a model the static
    path refuses) holds, after a generation of 10 prompts of up to 7 tokens and 14 new ones
    under bf16 autocast, the bytes the start-up check counts for 10 rows x 21 positions under
    bf16-mixed (``cache_bytes`` in ``cache_dtype``). It held a rotated key as the model
    computes it, in float32: 1.5 times that count (DeepSeek-V3, whose latent and values come
    out in float32 too, twice)."""
    model = build()
    caches: list[Cache] = []
    hook = model.register_forward_pre_hook(
        lambda _module, _args, kwargs: caches.append(kwargs["cache"]), with_kwargs=True
    )
    td = prompts(batch=10, width=7, seed=3)
    with autocast("bf16-mixed", torch.device("cpu")):
        sampler(model, DecodeSettings("eager")).generate(td, SamplingParams(14), noise(td, 0, 14))
    hook.remove()
    (cache,) = {id(cache): cache for cache in caches}.values()  # one cache, every step's
    held = sum(
        buffer.nbytes
        for layer in cache.layers
        if isinstance(layer, PreallocatedCacheLayer) and layer.is_initialized
        for buffer in (layer.key_buffer, layer.value_buffer)
    )
    assert held == cache_bytes(model.config, 10, 21, cache_dtype("bf16-mixed"))


def test_a_latent_attention_cache_that_fits_the_free_memory_to_the_byte_is_allocated() -> None:
    """The static path's check before it allocates counts what DeepSeek-V3's layers write, a
    one-head latent of width 16 and a one-head rotary key of width 4 in each of its 2 layers:
    10 rows x 21 positions x 2 x (16 + 4) x 4 bytes fit memory of as many bytes free, and
    are refused one byte less (its config's 4 KV heads x head dim 4 in every layer, 32 wide
    keys and values, not 20, refused the first)."""
    model, needed = tiny_mla(vocab_size=VOCAB, first_k_dense_replace=1), 10 * 21 * 2 * 20 * 4
    assert allocated_bytes(static_cache_of(model, free=needed)) == needed
    with pytest.raises(
        decode_module.GenerationTooLarge,
        match=r"rollout: the KV cache of 10 rows x 21 positions \(0\.00 GiB in torch\.float32\)",
    ):
        static_cache_of(model, free=needed - 1)


def test_what_the_static_path_does_not_run_is_refused_in_one_line() -> None:
    from transformers import MistralConfig

    from verlite.generation import StreamNoise
    from verlite.generation.static_cache import UnsupportedModel, attention_shape

    model, td = llama("fp32"), prompts(batch=4, width=5)
    static = sampler(model, DecodeSettings("static"))
    with pytest.raises(ValueError, match="draws with per-sample keys only"):
        static.generate(td, SamplingParams(4), StreamNoise(0, 4, td.device))
    graphs = Sampler(
        model,
        eos_token_id=EOS,
        pad_token_id=PAD,
        lockstep=False,
        decode=DecodeSettings("cuda_graphs"),
    )
    with pytest.raises(
        ValueError,
        match=r"rollout\.decode=cuda_graphs captures CUDA graphs; this model generates on cpu",
    ):
        graphs.generate(td, SamplingParams(4), noise(td, 0, 4))
    with pytest.raises(ValueError, match=f"at most {MAX_END_TOKENS}"):
        stops = tuple(range(3, 4 + MAX_END_TOKENS))
        static.generate(td, SamplingParams(4, stop_token_ids=stops), noise(td, 0, 4))
    with pytest.raises(
        UnsupportedModel,
        match=r"^this mistral model attends through a sliding window of 16 tokens "
        r"\(sliding_window\) and a sequence can be 17 tokens; .* use rollout\.decode=eager "
        r"or keep sequences to 16 tokens$",
    ):
        attention_shape(MistralConfig(sliding_window=16), longest=17)
    assert attention_shape(MistralConfig(sliding_window=16, num_hidden_layers=3), longest=16) == (
        3,
        8,
        128,
    )
    assert attention_shape(MistralConfig(sliding_window=None, num_hidden_layers=3), longest=99) == (
        3,
        8,
        128,
    )
    chunked = MistralConfig(num_hidden_layers=2, layer_types=["chunked_attention"] * 2)
    with pytest.raises(UnsupportedModel, match=r"kinds \['chunked_attention'\]"):
        attention_shape(chunked, longest=4)


def test_ignore_eos_runs_every_row_to_the_length_and_stop_tokens_still_end() -> None:
    model, td = llama("fp64"), prompts(batch=12, width=9, seed=1)
    params = SETTINGS["sampled"]
    eos = ragged_eos(model, td, params, 4)
    for mode in ("eager", "static"):
        decoder = sampler(model, DecodeSettings(mode), eos)
        full = decoder.generate(td, replace(params, ignore_eos=True), noise(td, 4, 14))
        assert (full["response_mask"].sum(-1) == 14).all()
        stopped = decoder.generate(
            td, replace(params, ignore_eos=True, stop_token_ids=(eos,)), noise(td, 4, 14)
        )
        assert_same(
            stopped,
            sampler(model, DecodeSettings("eager"), eos).generate(td, params, noise(td, 4, 14)),
        )


@pytest.mark.parametrize("tied", [False, True])
def test_a_colocated_actor_generates_from_its_refreshed_bf16_copy_what_it_would_itself(
    tied: bool,
) -> None:
    """Under bf16-mixed with CUDA graphs the actor samples from a bf16 copy of its fp32
    weights (``workers.actor.generation_copy``), refreshed before each generation: after an
    optimizer step, the same tokens and log-probs as the fp32 policy under autocast."""
    from verlite.config import load_config
    from verlite.distributed import first_names
    from verlite.models.precision import refresh_inference_copy
    from verlite.workers.actor import generation_copy

    bf16, fp32 = (
        load_config("configs/ppo_tiny.yaml", [f"model.precision={p}"])
        for p in ("bf16-mixed", "fp32")
    )
    policy = tiny_qwen2(tied=tied, vocab_size=VOCAB)
    assert generation_copy(policy, bf16, DecodeSettings("static")) is None
    assert generation_copy(policy, fp32, DecodeSettings("cuda_graphs")) is None
    copy = generation_copy(policy, bf16, DecodeSettings("cuda_graphs"))
    assert copy is not None and copy.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    # Its head is its own, in bf16, even where the policy's is tied to the embedding.
    assert copy.lm_head.weight.dtype == torch.bfloat16
    assert copy.model.embed_tokens.weight.dtype == torch.float32
    addresses = [p.data_ptr() for p in copy.parameters()]
    with torch.no_grad():  # an optimizer step on the fp32 master weights
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    state = policy.state_dict()
    refresh_inference_copy(copy, state.__getitem__, first_names(state))
    assert [p.data_ptr() for p in copy.parameters()] == addresses
    td, params = prompts(batch=10, width=7, seed=3), SETTINGS["sampled"]
    with autocast("bf16-mixed", torch.device("cpu")):
        ours = sampler(copy, DecodeSettings("static")).generate(td, params, noise(td, 2, 14))
        theirs = sampler(policy, DecodeSettings("eager")).generate(td, params, noise(td, 2, 14))
    assert_same(ours, theirs)


def test_auto_picks_the_fastest_mode_the_run_and_the_model_allow() -> None:
    from transformers import LlamaConfig, MistralConfig

    from verlite.generation.decode import auto_mode, check_mode_supported
    from verlite.generation.static_cache import UnsupportedModel

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    full = LlamaConfig(num_hidden_layers=2)
    dynamic = LlamaConfig(num_hidden_layers=2, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    sliding = MistralConfig(sliding_window=16)

    def auto(
        config: object,
        device: torch.device,
        lockstep: bool = False,
        per_rank: bool = False,
        longest: int = 17,
    ) -> str:
        return auto_mode(  # type: ignore[arg-type]
            config, device=device, lockstep=lockstep, per_rank=per_rank, longest=longest
        )

    assert auto(full, cuda) == "cuda_graphs"
    assert auto(full, cuda, lockstep=True) == "static"
    assert auto(dynamic, cuda) == "static"  # its rotary embedding reads positions on the host
    assert auto(sliding, cuda) == "eager"  # a sequence of 17 could pass its window of 16
    assert auto(sliding, cuda, longest=16) == "cuda_graphs"  # none can
    assert auto(sliding, cuda, lockstep=True, longest=16) == "static"
    assert auto(full, cuda, per_rank=True) == "eager"
    assert auto(full, cpu) == "eager"
    with pytest.raises(UnsupportedModel, match="rope_type dynamic"):
        check_mode_supported(dynamic, "cuda_graphs", longest=17)
    check_mode_supported(dynamic, "static", longest=17)
    check_mode_supported(sliding, "eager", longest=17)


@pytest.mark.parametrize("mode", ["eager", "static", "cuda_graphs"])
def test_a_row_budget_ends_a_row_as_an_end_token_does(mode: str) -> None:
    """Rows carrying a token budget (``sampling.BUDGET_KEY``, a multi-turn trajectory's
    room) stop there: each row's response is its unbudgeted one cut at the budget, whatever
    the budgets beside it, on every decode path."""
    from verlite.generation.sampling import BUDGET_KEY

    model, td, params = llama("fp64"), prompts(batch=12, width=9, seed=1), SETTINGS["sampled"]
    eos = ragged_eos(model, td, params, 4)
    free = sampler(model, DecodeSettings("eager"), eos).generate(td, params, noise(td, 4, 14))
    budgets = torch.tensor([1, 2, 3, 5, 8, 13, 14, 20, 1, 4, 6, 9])
    td[BUDGET_KEY] = budgets
    decode = DecodeSettings(mode, batch_buckets=(2, 5, 8), kv_block=4)
    out = sampler(model, decode, eos).generate(td, params, noise(td, 4, 14))
    lengths = torch.minimum(free["response_mask"].sum(-1), budgets)
    assert torch.equal(out["response_mask"].sum(-1), lengths)
    assert (lengths < free["response_mask"].sum(-1)).sum() >= 4  # budgets that cut rows
    kept = torch.arange(14) < lengths[:, None]
    assert torch.equal(out["responses"], free["responses"].where(kept, PAD))
    assert torch.equal(out["rollout_log_probs"], free["rollout_log_probs"].where(kept, 0.0))
    assert BUDGET_KEY not in set(out.keys())


class HostReads(RecordedGraphs):
    """``cuda_graphs`` on CPU, recording each host sync a captured step makes
    (``tests/host_sync_support.py``, every tensor taken as on the device): on a GPU, a host
    read or an op whose output's shape depends on the values (``nonzero``, ``unique``) fails
    the capture or bakes one step's value into the graph."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.found: list[str] = []

    def _capture(self, step: Callable[[], None]) -> SimpleNamespace:  # type: ignore[override]
        from tests.host_sync_support import DeviceSyncs, described

        syncs = DeviceSyncs()
        syncs.in_loop = syncs.everything = True
        with syncs:
            graph = super()._capture(step)
        self.found += described(syncs.hits)
        return graph


@pytest.mark.parametrize("autocast", [False, True])
def test_a_captured_decode_step_reads_nothing_on_the_host(autocast: bool) -> None:
    """Every step that ``cuda_graphs`` captures (Llama, and Qwen2 with a tied head; sampled
    with top-k and top-p; in fp32 and under bf16 autocast) makes no host read and no op whose
    shape depends on values: on a GPU the capture would fail, or replay one step's number at
    every step. The steps between (``_check``, ``_compact``) read on the host, outside."""
    decode = DecodeSettings("cuda_graphs", batch_buckets=(2, 4, 8), kv_block=4)
    for model in (llama("fp32"), tiny_qwen2(tied=True, vocab_size=VOCAB)):
        td, params = prompts(batch=12, width=9, seed=1), SETTINGS["top_k_top_p"]
        graphs = Sampler(model, eos_token_id=EOS, pad_token_id=PAD, lockstep=False, decode=decode)
        decoder = HostReads(
            model, eos_token_id=EOS, pad_token_id=PAD, lockstep=False, settings=decode
        )
        graphs.static = decoder
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            graphs.generate(td, params, noise(td, 4, 14))
        assert decoder.captured > 2 and decoder.found == []


class AddressedGraphs(RecordedGraphs):
    """``cuda_graphs`` on CPU whose 'graph' reads, as a real one, the addresses its model's
    tensors had at its capture: replayed after they moved, it fails."""

    def _capture(self, step: Callable[[], None]) -> SimpleNamespace:  # type: ignore[override]
        captured = [t.data_ptr() for t in self.model.parameters()]
        graph = super()._capture(step)

        def replay() -> None:
            now = [t.data_ptr() for t in self.model.parameters()]
            assert now == captured, "a graph replayed on model tensors that moved since its capture"
            graph.replay()

        return SimpleNamespace(replay=replay)


def test_graphs_replay_only_on_the_tensors_they_were_captured_on() -> None:
    """A weight sync on the CPU makes the model's tensors views of the received bytes (new
    addresses): the graphs captured before are dropped, and the tokens are the new weights'
    (as eager draws them), every replay on the tensors its graph was captured on. An
    in-place refresh (a colocated actor's generation copy; a sync on a GPU) keeps the
    addresses, and the graphs."""
    from tests.generation.test_weight_sync import deliver, sync
    from verlite.distributed import first_names
    from verlite.generation.weights import WeightReceiver
    from verlite.models.precision import refresh_inference_copy

    decode = DecodeSettings("cuda_graphs", batch_buckets=(2, 4, 8), kv_block=4)
    model, trained = llama("fp64"), llama("fp64")
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    td, params = prompts(batch=12, width=9, seed=2), SETTINGS["sampled"]
    graphs = Sampler(model, eos_token_id=EOS, pad_token_id=PAD, lockstep=False, decode=decode)
    decoder = AddressedGraphs(
        model, eos_token_id=EOS, pad_token_id=PAD, lockstep=False, settings=decode
    )
    graphs.static = decoder
    graphs.generate(td, params, noise(td, 5, 14))
    before = dict(decoder.graphs)
    receiver = WeightReceiver(model, who="rollout rank 0")
    deliver(receiver, sync(trained, version=1, bucket_bytes=4096))
    out = graphs.generate(td, params, noise(td, 5, 14))
    assert not any(decoder.graphs.get(key) is graph for key, graph in before.items())
    eager = sampler(trained, DecodeSettings("eager")).generate(td, params, noise(td, 5, 14))
    assert_same(out, eager)
    kept = dict(decoder.graphs)
    fresh = llama("fp64").state_dict()
    refresh_inference_copy(model, fresh.__getitem__, first_names(fresh))  # in place: graphs stay
    graphs.generate(td, params, noise(td, 5, 14))
    assert all(decoder.graphs[key] is graph for key, graph in kept.items())


class StandInCuda:
    """``torch.cuda``'s streams and graphs as ``StaticDecoder._capture`` uses them, stood in
    for on CPU: each wait, stream switch and capture goes to ``log``, and ending a capture
    whose step raised fails as CUDA's does (torch's ``capture_end``, which the context's
    ``__exit__`` runs whatever the step raised, reports the capture the error broke)."""

    ENDED = "CUDA error: operation failed due to a previous error during capture"

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, end_fails: bool = False) -> None:
        self.log: list[str] = []
        self.streams = 0
        self.current = self.stream("current")
        self.capturing = False
        log = self.log
        cuda = self

        class Graph:
            def __init__(self) -> None:
                self.id = len([entry for entry in log if entry.startswith("capture ")])

            def pool(self) -> str:
                return f"pool of graph {self.id}"

        class Capture:
            def __init__(self, graph: Graph, pool: str | None = None) -> None:
                log.append(f"capture {graph.id} into {pool}")

            def __enter__(self) -> None:
                cuda.capturing = True

            def __exit__(self, raised: type[BaseException] | None, *rest: object) -> None:
                cuda.capturing = False
                if raised is not None or end_fails:
                    raise RuntimeError(f"{cuda.ENDED}\nCUDA kernel errors might be reported later")

        @contextlib.contextmanager
        def on(stream: SimpleNamespace) -> Any:
            before, self.current = self.current, stream
            try:
                yield
            finally:
                self.current = before

        monkeypatch.setattr(torch.cuda, "Stream", lambda device: self.stream("side"))
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device: self.current)
        monkeypatch.setattr(torch.cuda, "stream", on)
        monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
        monkeypatch.setattr(torch.cuda, "graph", Capture)

    def stream(self, name: str) -> SimpleNamespace:
        self.streams += 1
        log = self.log
        return SimpleNamespace(
            name=name, wait_stream=lambda other: log.append(f"{name} waits for {other.name}")
        )

    def step(self, *, raising: str | None = None) -> Callable[[], None]:
        """A decode step that logs where it runs, and raises ``raising`` when captured."""

        def run() -> None:
            where = "captured" if self.capturing else f"run on {self.current.name}"
            cache = "on" if torch.is_autocast_cache_enabled() else "off"
            self.log.append(f"step {where}, autocast cache {cache}")
            if raising is not None and self.capturing:
                raise RuntimeError(f"{raising}\nCompile with `TORCH_USE_CUDA_DSA`")

        return run


def cuda_graphs_decoder() -> StaticDecoder:
    decoder = StaticDecoder(
        llama("fp32"),
        eos_token_id=EOS,
        pad_token_id=PAD,
        lockstep=False,
        settings=DecodeSettings("cuda_graphs"),
    )
    decoder._ensure_buffers(1, 1, torch.device("cpu"))
    return decoder


def test_each_step_runs_once_on_a_side_stream_then_is_captured_into_the_shared_pool(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What torch asks of a capture, which only a GPU runs (the CPU tests replay recorded ops):
    the step first runs for real on a side stream that waited for the current one (the
    warm-up; the current stream then waits for it), then is captured; autocast's weight
    cache is off for both (a cast cached in a capture is freed under the graph); the side
    stream is made once, and every graph after the first is captured into the first's pool."""
    cuda = StandInCuda(monkeypatch)
    decoder = cuda_graphs_decoder()
    decoder._capture(cuda.step())
    decoder._capture(cuda.step())
    warm_up = [
        "side waits for current",
        "step run on side, autocast cache off",
        "current waits for side",
    ]
    assert cuda.log == [
        *warm_up,
        "capture 0 into None",
        "step captured, autocast cache off",
        *warm_up,
        "capture 1 into pool of graph 0",
        "step captured, autocast cache off",
    ]
    assert cuda.streams == 2  # the current one, and one side stream
    assert torch.is_autocast_cache_enabled()  # as it was


@pytest.mark.parametrize("failing", ["step", "capture_end"])
def test_a_failed_capture_names_what_failed_not_the_capture_it_ended(
    monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    """On a GPU an op the capture refuses (a host read, say) raises in the captured step,
    and leaving ``torch.cuda.graph`` then ends the broken capture, which raises CUDA's own
    error in the step's place: the one line of ``GraphCaptureFailed`` names the step's
    error, what to fix, and a capture that fails only as it ends, that error."""
    refused = "CUDA error: operation not permitted when stream is capturing"
    cuda = StandInCuda(monkeypatch, end_fails=failing == "capture_end")
    decoder = cuda_graphs_decoder()
    with pytest.raises(GraphCaptureFailed) as raised:
        decoder._capture(cuda.step(raising=refused if failing == "step" else None))
    named = refused if failing == "step" else StandInCuda.ENDED
    assert str(raised.value) == (
        f"rollout: a decode step of {type(decoder.model).__name__} could not be captured as a "
        f"CUDA graph ({named}); use rollout.decode=static"
    )


class Stepped(StaticDecoder):
    """Records the rows each decode step runs on."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rows: list[int] = []

    def _step(self, rows: int, span: int, params: SamplingParams) -> None:
        self.rows.append(rows)
        super()._step(rows, span, params)


def stepped(model: torch.nn.Module, decode: DecodeSettings, eos: int = EOS) -> Sampler:
    out = sampler(model, DecodeSettings("eager"), eos)
    out.static = Stepped(model, eos_token_id=eos, pad_token_id=PAD, lockstep=False, settings=decode)
    return out


def test_a_padded_generation_starts_on_the_smallest_bucket_that_holds_its_batch() -> None:
    """The first steps' rows: the batch itself unpadded; padded, the smallest bucket of at
    least the batch (past the largest configured, the next power of two), or the rows the
    buffers hold when fewer; a batch past what the buffers hold runs on itself (padding
    never grows them)."""
    assert buckets_for(5, None) == (1, 2, 4, 5)
    assert buckets_for(5, None, held=8) == (1, 2, 4, 8)
    assert buckets_for(8, None, held=8) == (1, 2, 4, 8)
    assert buckets_for(1, None, held=8) == (1,)
    assert buckets_for(5, None, held=6) == (1, 2, 4, 6)
    assert buckets_for(5, None, held=16) == (1, 2, 4, 8)
    assert buckets_for(4, (3, 6, 9), held=9) == (3, 6)
    assert buckets_for(10, (3, 6, 9), held=16) == (3, 6, 9, 16)
    assert buckets_for(10, (3, 6, 9), held=12) == (3, 6, 9, 12)
    assert buckets_for(5, None, held=0) == (1, 2, 4, 5)  # the buffers grow to the batch
    assert buckets_for(10, (3, 6, 9), held=9) == (3, 6, 9, 10)
    assert DecodeSettings("cuda_graphs").pads_to_bucket
    assert not DecodeSettings("static").pads_to_bucket
    assert DecodeSettings("static", pad_to_bucket=True).pads_to_bucket


@pytest.mark.parametrize(
    ("batch", "buckets", "first"),
    [(3, None, 4), (5, None, 8), (6, None, 8), (7, None, 8), (3, (2, 5), 5), (6, (2, 5), 8)],
)
def test_a_batch_padded_to_its_bucket_decodes_as_eagerly(
    batch: int, buckets: tuple[int, ...] | None, first: int
) -> None:
    """Batch sizes that are not buckets, padded with finished rows to the next one: the
    eager sampler's tokens, log-probs and masks bit for bit in float64, for prompts of
    different lengths, a stop token, and a row that finishes at once (a budget of one)."""
    from verlite.generation.sampling import BUDGET_KEY

    model, td = llama("fp64"), prompts(batch=batch, width=9, seed=batch)
    stop = ragged_eos(model, td, SETTINGS["sampled"], 3)
    params = replace(SETTINGS["sampled"], stop_token_ids=(stop,))
    td[BUDGET_KEY] = torch.tensor([1, 14, 5, 14, 9, 14, 3][:batch])
    eager = sampler(model, DecodeSettings("eager")).generate(td, params, noise(td, 3, 14))
    decode = DecodeSettings("static", batch_buckets=buckets, reserve=(8, 0), pad_to_bucket=True)
    padded = stepped(model, decode)
    assert_same(padded.generate(td, params, noise(td, 3, 14)), eager)
    assert padded.static.rows[0] == first  # type: ignore[union-attr]
    assert eager["response_mask"][0].sum() == 1 and (eager["responses"] == stop).any()


def test_steps_run_on_buckets_whatever_the_batch_sizes() -> None:
    """Generations of 3, 5, 6 and 7 rows, one decoder whose buffers hold 8 (a run reserves
    its rows per worker): every step runs on a bucket of {1, 2, 4, 8}, statically and
    replayed (the graphs captured: one per bucket and span, not per batch size)."""
    model, params = llama("fp64"), SETTINGS["sampled"]
    static = stepped(model, DecodeSettings("static", reserve=(8, 0), pad_to_bucket=True))
    graphs = sampler(model, DecodeSettings("cuda_graphs", kv_block=4, reserve=(8, 0)))
    for batch in (3, 5, 6, 7):
        td = prompts(batch=batch, width=9, seed=batch)
        for decoder in (static, graphs):
            decoder.generate(td, params, noise(td, 1, 14))
    rows = static.static.rows  # type: ignore[union-attr]
    assert set(rows) <= {1, 2, 4, 8} and {4, 8} <= set(rows)
    assert {key[0] for key in graphs.static.graphs} <= {1, 2, 4, 8}  # type: ignore[union-attr]


@pytest.mark.parametrize("padded_prompts", [True, False])
def test_what_padding_rows_hold_cannot_reach_a_real_row(padded_prompts: bool) -> None:
    """Buffers an earlier generation left garbage in, past the batch: NaN keys and values
    in every position, token ids outside the vocabulary, far positions, masks open
    everywhere, rows unfinished and pointing at a real row's response. A batch of 5 padded
    to 8 rows still decodes as eagerly, and no divergence is flagged (a padding row is
    finished: its NaN logits are never sampled), with prompts padded (masked steps) or not
    (steps without a mask, which read a row's whole span)."""
    model, params = llama("fp64"), SETTINGS["top_k_top_p"]
    td = prompts(batch=5, width=9, seed=4)
    if not padded_prompts:
        td["attention_mask"] = torch.ones_like(td["attention_mask"])
        td["input_ids"] = td["input_ids"].clamp(min=3)
        td["position_ids"] = torch.arange(9).expand(5, 9).clone()
    eos = ragged_eos(model, td, params, 2)
    eager = sampler(model, DecodeSettings("eager"), eos).generate(td, params, noise(td, 2, 14))
    padded = stepped(model, DecodeSettings("static", pad_to_bucket=True), eos)
    decoder = padded.static
    assert isinstance(decoder, Stepped)
    decoder._ensure_buffers(8, 9 + 14, torch.device("cpu"))
    padded.generate(td, params, noise(td, 2, 14))  # the earlier one: its writes allocate them
    decoder.rows.clear()
    assert decoder.cache is not None
    for layer in decoder.cache.layers:
        layer.key_buffer[5:] = float("nan")  # type: ignore[attr-defined]
        layer.value_buffer[5:] = float("nan")  # type: ignore[attr-defined]
    decoder.ids[5:] = VOCAB + 7
    decoder.positions[5:] = 10**6
    decoder.keys[5:] = -1
    decoder.mask[5:] = True
    decoder.finished[5:] = False
    decoder.row_of[5:] = 0
    positions: list[int] = []  # the largest each step reads (a model with learned positions
    # indexes a table of max_position_embeddings with them)
    model.register_forward_pre_hook(
        lambda module, args, kwargs: positions.append(int(kwargs["position_ids"].max())),
        with_kwargs=True,
    )
    assert_same(padded.generate(td, params, noise(td, 2, 14)), eager)
    assert decoder.rows[0] == 8
    assert max(positions) < model.config.max_position_embeddings
