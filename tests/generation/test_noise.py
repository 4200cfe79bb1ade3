"""Keyed sampling noise: a response's tokens depend on its key, never on the rows it was
generated with; the uniforms behind them are uniform and independent."""

import random

import pytest
import torch

from tests.generation.test_sampler import model, prompts
from verlite.generation import KeyedNoise, Sampler, SamplingParams, StreamNoise, sample_keys
from verlite.generation.noise import MASK32, fmix32

EOS, PAD = 2, 0


def reference_fmix32(x: int) -> int:
    """MurmurHash3's fmix32 with plain 32-bit wrapping products."""
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & MASK32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & MASK32
    return x ^ (x >> 16)


def test_the_hash_is_murmur3_fmix32_on_ints_and_tensors() -> None:
    rng = random.Random(0)
    values = [0, 1, 0xFFFF, 0x10000, MASK32, *(rng.getrandbits(32) for _ in range(2000))]
    expected = [reference_fmix32(v) for v in values]
    assert [fmix32(v) for v in values] == expected
    assert fmix32(torch.tensor(values, dtype=torch.int64)).tolist() == expected
    assert fmix32(1) == 0x514E28B7  # MurmurHash3's published fmix32(1)


def test_every_row_of_a_run_gets_its_own_key() -> None:
    keys = [
        tuple(k)
        for seed in (0, 1, 2**32)
        for step in (1, 2, 3)
        for k in sample_keys(seed, step, 64, 4).tolist()
    ]
    assert len(set(keys)) == len(keys) == 3 * 3 * 64 * 4
    # rows i * n + j: prompt-major, as prompts are repeated
    assert torch.equal(sample_keys(5, 7, 8, 4)[4 * 3 + 2], sample_keys(5, 7, 8, 4)[14])
    assert torch.equal(sample_keys(5, 7, 8, 4)[:8], sample_keys(5, 7, 2, 4))


def test_keyed_uniforms_are_uniform_and_independent() -> None:
    noise = KeyedNoise(sample_keys(0, 1, 4096, 1), horizon=64)
    u = torch.stack([noise.uniforms(t) for t in range(64)])  # (positions, rows)
    assert u.dtype == torch.float64 and float(u.min()) >= 0.0 and float(u.max()) < 1.0
    counts = torch.histc(u, bins=64, min=0.0, max=1.0)
    expected = u.numel() / 64
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 63 + 6 * (2 * 63) ** 0.5  # 63 degrees of freedom, 6 sigma
    centered = u - 0.5
    for a, b in [
        (centered[:-1], centered[1:]),  # the next position of the same row
        (centered[:, :-1], centered[:, 1:]),  # the next row at the same position
    ]:
        corr = float((a * b).mean() / (centered**2).mean())
        assert abs(corr) < 6 / a.numel() ** 0.5


def test_a_row_samples_the_same_tokens_whatever_rows_it_is_generated_with() -> None:
    """The layout property at the sampler: the batch cut in shards, shuffled, or one row at
    a time gives every row the same response; a per-shard generator stream does not."""
    m, td = model(), prompts(batch=12)
    keys = sample_keys(3, 1, 12, 1)
    rollout = Sampler(m, eos_token_id=EOS, pad_token_id=PAD, lockstep=False)
    params = SamplingParams(8, top_p=0.95)

    def responses(rows: list[int], noise: str) -> torch.Tensor:
        shard = td[rows]
        source = (
            KeyedNoise(keys[rows], horizon=8)
            if noise == "keyed"
            else StreamNoise(3, len(rows), torch.device("cpu"))
        )
        return rollout.generate(shard, params, source)["responses"]

    whole = responses(list(range(12)), "keyed")
    order = random.Random(0).sample(range(12), 12)
    shuffled = torch.empty_like(whole)
    shuffled[order] = responses(order, "keyed")
    assert torch.equal(shuffled, whole)
    assert torch.equal(torch.cat([responses([i], "keyed") for i in range(12)]), whole)
    assert torch.equal(
        torch.cat([responses(s, "keyed") for s in ([0, 1, 2], [3, 4, 5, 6, 7, 8, 9, 10, 11])]),
        whole,
    )
    # the negative control: the stream gives a row the draws of its position in the shard
    streamed = torch.cat(
        [responses(s, "stream") for s in ([0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11])]
    )
    assert not torch.equal(streamed, responses(list(range(12)), "stream"))


def test_a_uniform_depends_on_its_position_not_on_the_block_it_was_computed_in() -> None:
    keys = sample_keys(0, 1, 16, 2)
    short, long = KeyedNoise(keys, horizon=3), KeyedNoise(keys, horizon=100)
    for t in [0, 1, 2, 3, 5, 63, 64, 65, 99, 1, 0]:  # back and forth across blocks
        assert torch.equal(short.uniforms(t), long.uniforms(t)), t


@pytest.mark.parametrize("shape", [(3,), (4, 3)])
def test_keys_of_another_shape_are_refused(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=r"sample keys must be \(rows, 2\) int64"):
        KeyedNoise(torch.zeros(shape, dtype=torch.int64), horizon=1)


def test_a_steps_keys_are_those_of_its_seed_step_prompts_and_samples() -> None:
    """Fixed keys, as the lanes hashed one at a time gave them (a changed hash would give
    another run's samples for the same seed)."""
    keys = sample_keys(2**40 + 5, 3, 2, 2, first_prompt=7)
    assert keys.dtype == torch.int64
    assert keys.tolist() == [
        [1576399946, 2420079353],
        [1263757981, 3111045351],
        [343320301, 1723638152],
        [3206346025, 3676941871],
    ]
