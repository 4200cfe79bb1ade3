"""The sampler draws from the right distribution: plain temperature, top-k and top-p, with
the removed tokens never drawn (the draw inverts the CDF with one uniform per row), from
keyed uniforms (``rollout.randomness=per_sample``) as from a generator stream."""

import pytest
import torch

from verlite.generation import (
    KeyedNoise,
    SamplingParams,
    StreamNoise,
    sample_keys,
    sample_next_token,
)

PROBS = torch.tensor([0.05, 0.4, 0.0, 0.25, 0.2, 0.1])
ROWS = 40_000


def uniforms(noise: str, seed: int) -> torch.Tensor:
    if noise == "keyed":  # one step's rows: ROWS prompts, one sample each
        return KeyedNoise(sample_keys(seed, 1, ROWS, 1), horizon=1).uniforms(0)
    return StreamNoise(seed, ROWS, torch.device("cpu")).uniforms(0)


def draw(
    params: SamplingParams, seed: int = 0, noise: str = "keyed"
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = PROBS.log().expand(ROWS, -1)  # log(0) = -inf: a token no setting may draw
    return sample_next_token(logits, params, uniforms(noise, seed))


def frequencies(params: SamplingParams, seed: int = 0, noise: str = "keyed") -> torch.Tensor:
    drawn, _ = draw(params, seed, noise)
    return torch.bincount(drawn, minlength=len(PROBS)).double() / ROWS


def renormalized(keep: list[int]) -> torch.Tensor:
    kept = torch.zeros_like(PROBS, dtype=torch.float64)
    kept[keep] = PROBS[keep].double()
    return kept / kept.sum()


@pytest.mark.parametrize("noise", ["keyed", "stream"])
@pytest.mark.parametrize(
    ("top_k", "top_p", "keep"),
    [
        (0, 1.0, [0, 1, 3, 4, 5]),
        (2, 1.0, [1, 3]),
        (0, 0.6, [1, 3]),  # mass before token 3 is 0.4 < 0.6, before token 4 it is 0.65
        # top-4 = {1, 3, 4, 5}, renormalized 0.421/0.263/0.211/0.105: mass before 5 is 0.895
        (4, 0.85, [1, 3, 4]),
    ],
)
def test_draws_follow_the_kept_distribution(
    top_k: int, top_p: float, keep: list[int], noise: str
) -> None:
    drawn, log_probs = draw(SamplingParams(1, top_k=top_k, top_p=top_p), noise=noise)
    freq = torch.bincount(drawn, minlength=len(PROBS)).double() / ROWS
    expected = renormalized(keep)
    # each draw reports the log-probability of its token in the distribution it came from
    torch.testing.assert_close(log_probs.double(), expected[drawn].log(), rtol=0, atol=1e-6)
    # 5 standard deviations of a binomial frequency: a wrong distribution is far outside.
    sigma = (expected * (1 - expected) / ROWS).sqrt()
    assert ((freq - expected).abs() <= 5 * sigma + 1e-12).all(), (freq, expected)
    assert set(torch.nonzero(freq).flatten().tolist()) == set(keep)


def test_temperature_sharpens_and_seeds_reproduce() -> None:
    hot, cold = (
        frequencies(SamplingParams(1, temperature=2.0)),
        frequencies(SamplingParams(1, temperature=0.25)),
    )
    assert cold[1] > 0.8 > hot[1]
    assert torch.equal(
        frequencies(SamplingParams(1), seed=3), frequencies(SamplingParams(1), seed=3)
    )
