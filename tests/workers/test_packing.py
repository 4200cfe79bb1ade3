"""Packed micro-batches (``actor.packing``, ``critic.packing``) on real Hugging Face models in
one process: a packed row gives the padded layout's log-probs, entropies, values and
gradients; a sequence never sees the ones packed with it; a model whose attention would mix
them is refused; the packed token budget counts real tokens. (Across spawned ranks and every
loss mode: tests/workers/test_train_engine_invariance.py.)"""

from pathlib import Path

import pytest
import torch
from transformers import AttentionInterface, Qwen3Config, Qwen3MoeConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from tests.model_support import tiny_sliding
from verlite.audit.invariance import make_batch
from verlite.config import ConfigError, ModelConfig, load_config
from verlite.core.partition import PackedTokenPartition
from verlite.models import build_policy, build_value_model
from verlite.models.logits_chunk import set_logits_chunk_tokens
from verlite.models.packing_cost import flop_crossover
from verlite.models.support import check_packing_supported
from verlite.models.varlen import (
    ATTENTION,
    GROUP_SPREAD,
    KWARG,
    PackedAttention,
    PackingUnsupported,
    enable_packing,
)
from verlite.step_batch import trim_padding
from verlite.workers.forward import mark_packed, response_log_probs, response_values
from verlite.workers.packing import pack_rows

# Long-tailed rows: prompts of 1..24 and responses of 1..40 tokens, in float64.
CFG = load_config(
    "configs/ppo_tiny.yaml",
    ["model.precision=fp64", "data.max_prompt_length=24", "rollout.max_response_length=40"],
)


def models():
    kwargs = {"vocab_size": 64, "max_positions": CFG.max_sequence_length, "seed": 3}
    return build_policy(CFG.model, **kwargs), build_value_model(CFG.model, **kwargs)


def batches():
    padded = trim_padding(make_batch(CFG, seed=1, num_sequences=24))
    packed = padded.clone()
    mark_packed(packed)
    return padded, packed


def test_the_long_tailed_batch_spans_several_attention_groups() -> None:
    padded, _ = batches()
    lengths = padded["attention_mask"].sum(1)
    assert int(lengths.max()) > 3 * int(lengths.min())
    attention = PackedAttention.from_lengths(lengths)
    assert len(attention.groups) >= 4
    for group in attention.groups:
        in_group = group.real[0].bincount()  # real tokens of each of its sequences
        assert float(in_group.max() / in_group.min()) <= GROUP_SPREAD
    # every packed position is produced exactly once
    assert torch.equal(torch.sort(attention.order).values, torch.arange(int(lengths.sum())))


def test_a_packed_row_gives_the_padded_outputs_and_gradients() -> None:
    policy, critic = models()
    padded, packed = batches()
    real = padded["attention_mask"][:, -padded["responses"].shape[1] :].bool()
    expected = response_log_probs(policy, padded, temperature=0.7, entropy="loss")
    values = response_values(critic, padded)
    expected_grads = torch.autograd.grad(
        (expected[0] * real).sum() + (values * real).sum(),
        [*policy.parameters(), *critic.parameters()],
    )
    enable_packing(policy)
    enable_packing(critic)
    got = response_log_probs(policy, packed, temperature=0.7, entropy="loss")
    got_values = response_values(critic, packed)
    for want, have in zip((*expected, values), (*got, got_values), strict=True):
        assert have.shape == want.shape
        assert torch.allclose(have[real], want[real], rtol=0, atol=1e-12)
        assert have[~real].eq(0).all()  # nothing where a row has no response token
    grads = torch.autograd.grad(
        (got[0] * real).sum() + (got_values * real).sum(),
        [*policy.parameters(), *critic.parameters()],
    )
    for want, have in zip(expected_grads, grads, strict=True):
        assert torch.allclose(have, want, rtol=1e-10, atol=1e-12)


def test_the_packed_row_holds_only_real_tokens() -> None:
    padded, _ = batches()
    rows = pack_rows(padded)
    mask = padded["attention_mask"].bool()
    assert rows.input_ids.shape == (1, int(mask.sum()))
    assert int(rows.position_ids.eq(0).sum()) == padded.batch_size[0]  # one start per row
    real = mask[:, -padded["responses"].shape[1] :]
    assert rows.predict.numel() == rows.slots.numel() == int(real.sum())
    assert torch.equal(rows.from_rows(padded["responses"]), padded["responses"][real])


@pytest.mark.parametrize("changed", [0, 1])
def test_a_sequence_never_sees_another_packed_with_it(changed: int) -> None:
    """Three sequences in one packed row: changing one leaves the others' outputs as they
    were, whether it comes before them or after."""
    policy, _ = models()
    enable_packing(policy)
    lengths = torch.tensor([6, 9, 5])
    tokens = torch.randint(1, 64, (int(lengths.sum()),), generator=torch.Generator().manual_seed(0))
    starts = [0, 6, 15]
    other = tokens.clone()
    span = slice(starts[changed], starts[changed] + int(lengths[changed]))
    other[span] = (other[span] + 7) % 64
    positions = torch.cat([torch.arange(n) for n in lengths.tolist()])[None]
    packed = PackedAttention.from_lengths(lengths)
    with torch.no_grad():
        before, after = (
            policy(input_ids=t[None], position_ids=positions, **{KWARG: packed}).logits[0]
            for t in (tokens, other)
        )
    kept = torch.ones(len(tokens), dtype=torch.bool)
    kept[span] = False
    assert torch.equal(before[kept], after[kept])
    assert not torch.allclose(before[~kept], after[~kept])


def test_without_a_packed_row_the_attention_is_sdpa_bit_for_bit() -> None:
    """Generation and padded passes go through the same model after ``enable_packing``."""
    policy, _ = models()
    padded, _ = batches()
    inputs = {k: padded[k] for k in ("input_ids", "attention_mask", "position_ids")}
    with torch.no_grad():
        before = policy(**inputs).logits
        enable_packing(policy)
        assert policy.config._attn_implementation == ATTENTION
        assert torch.equal(policy(**inputs).logits, before)


def _mixing_attention(module, query, key, value, attention_mask, **kwargs):
    """A packed row's attention over the whole row: what a model that ignores the packed
    structure does."""
    kwargs.pop(KWARG, None)
    return sdpa_attention_forward(module, query, key, value, None, is_causal=True, **kwargs)


def test_a_model_whose_attention_mixes_packed_sequences_is_refused(monkeypatch) -> None:
    monkeypatch.setitem(AttentionInterface._global_mapping, ATTENTION, _mixing_attention)
    policy, _ = models()
    with pytest.raises(PackingUnsupported, match="lets packed sequences attend to each other"):
        enable_packing(policy)
    with pytest.raises(ConfigError, match=r"^actor.packing=true: .* set actor.packing=false$"):
        check_packing_supported(
            CFG.model, role="actor", max_sequence_length=CFG.max_sequence_length, fields="x"
        )


def test_the_packed_token_budget_counts_real_tokens() -> None:
    lengths = [100, 90, 30, 20, 20, 10, 5, 5]
    partition = PackedTokenPartition(lengths, max_tokens=120)
    parts = partition.parts()
    assert all(sum(lengths[i] for i in part) <= 120 for part in parts)
    assert partition.count == len(parts) == 3  # 280 tokens in rows of at most 120
    assert sorted(i for part in parts for i in part) == list(range(len(lengths)))
    more = partition.parts(6)
    assert len(more) == 6 and sorted(i for p in more for i in p) == list(range(len(lengths)))
    with pytest.raises(ValueError, match="sequence 0 has 100 tokens, more than max_tokens=50"):
        PackedTokenPartition(lengths, max_tokens=50)


def sliding_model(kind: str, window: int | None) -> torch.nn.Module:
    """:func:`tests.model_support.tiny_sliding` in float64, for log-prob passes."""
    model = tiny_sliding(kind, window, seed=7).double()
    set_logits_chunk_tokens(model, CFG.model.logits_chunk_tokens)
    return model


def log_probs_and_grads(
    model: torch.nn.Module, batch, real: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    log_probs, entropy = response_log_probs(model, batch, temperature=0.7, entropy="loss")
    grads = torch.autograd.grad((log_probs * real).sum(), list(model.parameters()))
    return (log_probs[real], entropy[real], *grads)


@pytest.mark.parametrize("kind", ["mistral", "qwen2", "gemma3"])
def test_a_window_no_sequence_passes_packs_as_full_attention_bit_for_bit(kind: str) -> None:
    """A window as long as the longest sequence (L: the query at L - 1 still attends the
    key at 0, 0 <= i - j < window) never binds: the padded pass is the full-attention
    model's bit for bit, the packed pass too, and packed and padded agree as they do for a
    full-attention model (tests above: the same sums in another order). Mistral slides
    every layer, Qwen2 its second, Gemma 3 its first."""
    padded, packed = batches()
    real = padded["attention_mask"][:, -padded["responses"].shape[1] :].bool()
    longest = int(padded["attention_mask"].sum(1).max())
    full = sliding_model(kind, None)
    windowed = sliding_model(kind, longest)
    want = log_probs_and_grads(full, padded, real)
    got = log_probs_and_grads(windowed, padded, real)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    enable_packing(full)
    enable_packing(windowed)
    want_packed = log_probs_and_grads(full, packed, real)
    got_packed = log_probs_and_grads(windowed, packed, real)
    assert all(torch.equal(a, b) for a, b in zip(want_packed, got_packed, strict=True))
    # Gemma 3's RMSNorm computes in float32 whatever the model's dtype (Hugging Face casts
    # to float()), so across layouts its norm gradients agree to float32 rounding only.
    rtol, atol = (1e-5, 1e-6) if kind == "gemma3" else (1e-10, 1e-12)
    for a, b in zip(want, got_packed, strict=True):
        assert torch.allclose(a, b, rtol=rtol, atol=atol)


@pytest.mark.parametrize("kind", ["mistral", "qwen2", "gemma3"])
def test_a_window_one_token_short_binds_and_a_packed_pass_refuses_it(kind: str) -> None:
    """The bound is exact for attention: with a window of L - 1 the last query of the
    longest row (L tokens) loses its first key, so the padded pass's outputs there are no
    longer full attention's (Hugging Face's mask, kv > q - window, for either class); with
    a window of L every output is. Packed attention, which applies no window, refuses the
    row rather than attend past it."""
    padded, packed = batches()
    mask = padded["attention_mask"]
    longest = int(mask.sum(1).max())

    def logits(window: int | None) -> torch.Tensor:
        model = sliding_model(kind, window)
        with torch.no_grad():
            out = model(input_ids=padded["input_ids"], attention_mask=mask)
        return out.logits[mask.bool()]

    full = logits(None)
    assert torch.equal(logits(longest), full)
    assert not torch.equal(logits(longest - 1), full)
    short = sliding_model(kind, longest - 1)
    enable_packing(short)
    with pytest.raises(
        PackingUnsupported,
        match=rf"sliding window of {longest - 1} tokens and a packed sequence has {longest}",
    ):
        response_log_probs(short, packed, temperature=0.7, entropy="none")


@pytest.mark.parametrize("kind", ["mistral", "qwen2", "gemma3"])
def test_packing_a_sliding_window_model_is_decided_at_start_up(kind: str, tmp_path: Path) -> None:
    """Accepted exactly when the run's longest sequence fits the window; refused in one
    line naming both numbers otherwise (Qwen2 slides only its later layers, which the
    one-layer probe alone would not see)."""
    longest = CFG.max_sequence_length
    fields = "data.max_prompt_length + rollout.max_response_length"
    for window in (longest, longest - 1):
        sliding_model(kind, window).save_pretrained(tmp_path / str(window))
    at_most = ModelConfig(path=str(tmp_path / str(longest)))
    check_packing_supported(at_most, role="actor", max_sequence_length=longest, fields=fields)
    layers = 2 if kind == "mistral" else 1
    with pytest.raises(
        ConfigError,
        match=rf"^critic\.packing=true: {layers} of the model's 2 layers attend through a "
        rf"sliding window of {longest - 1} tokens \(sliding_window\), and a sequence can be "
        rf"data\.max_prompt_length \+ rollout\.max_response_length = {longest} tokens; .* "
        rf"at most {longest - 1} tokens; set critic\.packing=false$",
    ):
        check_packing_supported(
            ModelConfig(path=str(tmp_path / str(longest - 1))),
            role="critic",
            max_sequence_length=longest,
            fields=fields,
        )


def test_a_packed_pass_builds_no_attention_mask(monkeypatch) -> None:
    """Without padding and a cache, no (T, T) mask is built for a packed row, even where
    Hugging Face would build one from its restarting positions (``use_cache=False``)."""
    from verlite.models import varlen

    built = []
    real = varlen.sdpa_mask
    monkeypatch.setattr(varlen, "sdpa_mask", lambda *a, **k: built.append(1) or real(*a, **k))
    policy, _ = models()
    policy.config.use_cache = False
    enable_packing(policy)
    padded, packed = batches()
    with torch.no_grad():
        response_log_probs(policy, packed, temperature=1.0, entropy="none")
        assert not built
        response_log_probs(policy, padded, temperature=1.0, entropy="none")
        assert built  # a padded pass still gets its mask


def test_the_attention_crossover_is_a_layers_parameters_over_its_width() -> None:
    """For a Llama layer: attention (q, o: h x h; k, v: h x kv) + MLP (3 x h x i) + 2 norms."""
    h, i, heads, kv_heads = 128, 256, 4, 2
    cfg = load_config(
        "configs/grpo_tiny.yaml",
        [
            f"model.hidden_size={h}",
            f"model.intermediate_size={i}",
            f"model.num_heads={heads}",
            f"model.num_kv_heads={kv_heads}",
        ],
    )
    kv = h // heads * kv_heads
    layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    assert flop_crossover(cfg.model) == round(layer / h)


def test_the_attention_crossover_divides_by_heads_times_head_dim(tmp_path: Path) -> None:
    """A Qwen3 whose 4 heads of 16 are twice its hidden size of 32: a token's attention over
    L keys costs 4 x 16 wide per layer, so the crossover is the layer over 64, not 32."""
    h, i, heads, kv_heads, d = 32, 64, 4, 2, 16
    Qwen3Config(
        vocab_size=100,
        hidden_size=h,
        intermediate_size=i,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=d,
    ).save_pretrained(tmp_path)
    layer = 2 * h * heads * d + 2 * h * kv_heads * d + 2 * d + 3 * h * i + 2 * h
    assert flop_crossover(ModelConfig(path=str(tmp_path))) == round(layer / (heads * d))


def test_the_attention_crossover_of_a_moe_counts_the_experts_a_token_is_sent_to(
    tmp_path: Path,
) -> None:
    """A Qwen3-MoE layer's weight FLOPs per token are its attention, norms, router and the 2
    experts of 4 it is sent to: counted with all 4, the crossover was 196, not 148."""
    h, heads, kv_heads, d, experts, top_k, i = 32, 4, 2, 16, 4, 2, 16
    Qwen3MoeConfig(
        vocab_size=100,
        hidden_size=h,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=d,
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=i,
    ).save_pretrained(tmp_path)
    attention = 2 * h * heads * d + 2 * h * kv_heads * d + 2 * d  # q, o; k, v; q/k norms
    layer = attention + 2 * h + experts * h + top_k * 3 * h * i  # norms, router, experts
    assert flop_crossover(ModelConfig(path=str(tmp_path))) == round(layer / (heads * d)) == 148
