"""Advantage estimators against plain-Python loop references, plus the registry contract.

The references below loop over rows, tokens and groups on Python floats and share no code
with ``verlite.core.advantages`` (not even the masked helpers), so a vectorization or
masking mistake in the module shows up as a mismatch.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import random
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from verlite.core import advantages as adv_mod
from verlite.core.advantages import (
    ADV_ESTIMATORS,
    ESTIMATORS_NEEDING_CRITIC,
    AdvantageInputs,
    compute_advantages,
    register_advantage,
)
from verlite.core.masked import masked_var

ALL_NAMES = {"gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"}
GROUP_NAMES = ["grpo", "rloo", "reinforce_plus_plus_baseline"]
UNIFORM_KWARGS = {
    "token_level_rewards",
    "response_mask",
    "values",
    "index",
    "gamma",
    "lam",
    "norm_adv_by_std",
    "epsilon",
}
WHITEN_EPS = 1e-8  # masked_whiten's default, which the whitening estimators use
PAD = 123.0  # garbage written outside the mask: must never leak into any output

Rows = list[list[float]]


# --------------------------------------------------------------------------- batches


@dataclass
class Batch:
    rewards: torch.Tensor
    values: torch.Tensor
    mask: torch.Tensor
    index: torch.Tensor
    positions: list[list[int]]  # each row's valid (policy) token positions, in order

    def kwargs(self, **extra: Any) -> dict[str, Any]:
        return {
            "token_level_rewards": self.rewards,
            "response_mask": self.mask,
            "values": self.values,
            "index": self.index,
            **extra,
        }


def make_batch(
    seed: int,
    steps: int = 9,
    group_sizes: tuple[int, ...] = (3, 1, 4, 2, 1, 2),
    lengths: list[int] | None = None,
    pad: float = PAD,
    holes: bool = False,
) -> Batch:
    """Ragged right-padded batch; groups (sizes > 1 and = 1) interleaved, uids sparse. With
    ``holes``, masks of multi-turn rows instead: policy spans and observation spans (mask 0)
    alternating, a row starting or ending with either, some rows all observation."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    batch = sum(group_sizes)
    uids = rng.sample(range(10, 10_000), len(group_sizes))
    index = [uid for uid, size in zip(uids, group_sizes, strict=True) for _ in range(size)]
    if lengths is None:
        # One empty row, one full row, the rest random; then shuffle rows with the groups.
        lengths = [0, steps] + [rng.randint(1, steps) for _ in range(batch - 2)]
        order = list(range(batch))
        rng.shuffle(order)
        lengths = [lengths[i] for i in order]
        rng.shuffle(index)
    positions = [list(range(length)) for length in lengths]
    if holes:
        positions = [hole_positions(rng, steps) for _ in range(batch)]
        positions[rng.randrange(batch)] = []  # a row whose whole response is observation
    mask = torch.zeros(batch, steps, dtype=torch.float64)
    for row, valid in enumerate(positions):
        mask[row, valid] = 1.0
    rewards = torch.randn(batch, steps, generator=gen, dtype=torch.float64)
    values = torch.randn(batch, steps, generator=gen, dtype=torch.float64)
    rewards = torch.where(mask.bool(), rewards, torch.full_like(rewards, pad))
    values = torch.where(mask.bool(), values, torch.full_like(values, pad))
    return Batch(rewards, values, mask, torch.tensor(index, dtype=torch.int64), positions)


def hole_positions(rng: random.Random, steps: int) -> list[int]:
    """The policy's positions in a multi-turn row of up to ``steps`` tokens: spans of 1..3
    tokens alternating between policy and observation, the first of either kind."""
    end, policy, t, valid = rng.randint(0, steps), rng.random() < 0.7, 0, []
    while t < end:
        span = rng.randint(1, 3)
        if policy:
            valid += range(t, min(t + span, end))
        t += span
        policy = not policy
    return valid


# --------------------------------------------------------------------------- references


def ref_whiten(x: Rows, positions: list[list[int]]) -> Rows:
    flat = [x[i][t] for i, valid in enumerate(positions) for t in valid]
    n = len(flat)
    mean = sum(flat) / n if n else 0.0
    var = sum((v - mean) ** 2 for v in flat) / max(n - 1, 1)
    scale = 1.0 / math.sqrt(var + WHITEN_EPS)
    return [
        [(x[i][t] - mean) * scale if t in valid else 0.0 for t in range(len(x[i]))]
        for i, valid in enumerate(positions)
    ]


def ref_gae(b: Batch, gamma: float, lam: float) -> tuple[Rows, Rows]:
    r, v = b.rewards.tolist(), b.values.tolist()
    steps = b.mask.shape[1]
    raw: Rows = []
    returns: Rows = []
    for i, valid in enumerate(b.positions):
        a_row, ret_row = [0.0] * steps, [0.0] * steps
        last = 0.0
        # Over the policy's tokens only: the next one's value, across any observation between.
        for k in reversed(range(len(valid))):
            t = valid[k]
            next_v = v[i][valid[k + 1]] if k + 1 < len(valid) else 0.0
            delta = r[i][t] + gamma * next_v - v[i][t]
            last = delta + gamma * lam * last
            a_row[t] = last
            ret_row[t] = last + v[i][t]
        raw.append(a_row)
        returns.append(ret_row)
    return ref_whiten(raw, b.positions), returns


def ref_scores_and_groups(b: Batch) -> tuple[list[float], dict[int, list[int]]]:
    r = b.rewards.tolist()
    scores = [sum(r[i][t] for t in valid) for i, valid in enumerate(b.positions)]
    groups: dict[int, list[int]] = {}
    for i, uid in enumerate(b.index.tolist()):
        groups.setdefault(uid, []).append(i)
    return scores, groups


def ref_broadcast(per_seq: list[float], b: Batch) -> Rows:
    steps = b.mask.shape[1]
    return [
        [a if t in valid else 0.0 for t in range(steps)]
        for a, valid in zip(per_seq, b.positions, strict=True)
    ]


def ref_grpo(b: Batch, norm_by_std: bool, eps: float) -> Rows:
    scores, groups = ref_scores_and_groups(b)
    out = [0.0] * len(scores)
    for rows in groups.values():
        n = len(rows)
        if n == 1:
            mean, std = 0.0, 1.0
        else:
            mean = sum(scores[i] for i in rows) / n
            std = math.sqrt(sum((scores[i] - mean) ** 2 for i in rows) / (n - 1))
        for i in rows:
            out[i] = (scores[i] - mean) / (std + eps) if norm_by_std else scores[i] - mean
    return ref_broadcast(out, b)


def ref_rloo(b: Batch) -> Rows:
    scores, groups = ref_scores_and_groups(b)
    out = [0.0] * len(scores)
    for rows in groups.values():
        for i in rows:
            others = [scores[j] for j in rows if j != i]
            out[i] = scores[i] - sum(others) / len(others) if others else scores[i]
    return ref_broadcast(out, b)


def ref_reinforce_pp(b: Batch, gamma: float) -> tuple[Rows, Rows]:
    r = b.rewards.tolist()
    steps = b.mask.shape[1]
    returns: Rows = []
    for i, valid in enumerate(b.positions):
        row = [0.0] * steps
        running = 0.0
        for t in reversed(valid):  # discounted per policy token, not per position
            running = r[i][t] + gamma * running
            row[t] = running
        returns.append(row)
    return ref_whiten(returns, b.positions), returns


def ref_reinforce_pp_baseline(b: Batch) -> Rows:
    scores, groups = ref_scores_and_groups(b)
    out = [0.0] * len(scores)
    for rows in groups.values():
        mean = sum(scores[i] for i in rows) / len(rows) if len(rows) > 1 else 0.0
        for i in rows:
            out[i] = scores[i] - mean
    return ref_whiten(ref_broadcast(out, b), b.positions)


def close(actual: torch.Tensor, expected: Rows | torch.Tensor) -> None:
    expected_t = torch.as_tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(actual, expected_t, rtol=1e-10, atol=1e-10)


SEEDS = [0, 1, 2]


# --------------------------------------------------------------------------- estimators


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(
    ("gamma", "lam"), [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (1.0, 0.5), (0.0, 1.0)]
)
@pytest.mark.parametrize("holes", [False, True])
def test_gae_matches_loop_reference(seed: int, gamma: float, lam: float, holes: bool) -> None:
    b = make_batch(seed, holes=holes)
    advantages, returns = compute_advantages(
        "gae", AdvantageInputs(**b.kwargs(gamma=gamma, lam=lam))
    )
    ref_adv, ref_ret = ref_gae(b, gamma, lam)
    close(advantages, ref_adv)
    close(returns, ref_ret)


@pytest.mark.parametrize("holes", [False, True])
def test_gae_returns_telescope_to_reward_to_go_when_gamma_lam_one(holes: bool) -> None:
    # With gamma = lam = 1 the deltas telescope: returns_t = sum_{s >= t} r_s exactly, over
    # the policy's tokens (an observation's value never enters).
    b = make_batch(5, holes=holes)
    _, returns = compute_advantages("gae", AdvantageInputs(**b.kwargs(gamma=1.0, lam=1.0)))
    r, steps = b.rewards.tolist(), b.mask.shape[1]
    expected = [
        [sum(r[i][s] for s in valid if s >= t) if t in valid else 0.0 for t in range(steps)]
        for i, valid in enumerate(b.positions)
    ]
    close(returns, expected)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("norm_by_std", [True, False])
@pytest.mark.parametrize("eps", [1e-6, 0.5])
@pytest.mark.parametrize("holes", [False, True])
def test_grpo_matches_loop_reference(seed: int, norm_by_std: bool, eps: float, holes: bool) -> None:
    b = make_batch(seed, holes=holes)
    advantages, returns = compute_advantages(
        "grpo", AdvantageInputs(**b.kwargs(norm_adv_by_std=norm_by_std, epsilon=eps))
    )
    close(advantages, ref_grpo(b, norm_by_std, eps))
    close(returns, advantages)


def test_dr_grpo_differs_from_grpo_exactly_by_std_division() -> None:
    b = make_batch(7)
    eps = 1e-6
    grpo, _ = compute_advantages(
        "grpo", AdvantageInputs(**b.kwargs(norm_adv_by_std=True, epsilon=eps))
    )
    dr_grpo, _ = compute_advantages(
        "grpo", AdvantageInputs(**b.kwargs(norm_adv_by_std=False, epsilon=eps))
    )
    scores, groups = ref_scores_and_groups(b)
    std = torch.ones(len(scores), 1, dtype=torch.float64)
    for rows in groups.values():
        if len(rows) > 1:
            std[rows] = torch.tensor([scores[i] for i in rows], dtype=torch.float64).std()
    close(dr_grpo, grpo * (std + eps))
    assert not torch.allclose(dr_grpo, grpo)  # the batch has groups whose std is not 1


def test_grpo_constant_group_gives_zero_not_nan() -> None:
    # All samples of a prompt score the same: std = 0, the epsilon keeps the division finite.
    rewards = torch.tensor([[1.0, 0.0], [0.5, 0.5], [2.0, 0.0]], dtype=torch.float64)
    mask = torch.ones_like(rewards)
    index = torch.tensor([4, 4, 9])
    advantages, _ = compute_advantages(
        "grpo", AdvantageInputs(token_level_rewards=rewards, response_mask=mask, index=index)
    )
    assert torch.isfinite(advantages).all()
    close(advantages[:2], torch.zeros(2, 2, dtype=torch.float64))
    close(advantages[2], torch.full((2,), 2.0 / (1.0 + 1e-6), dtype=torch.float64))


@pytest.mark.parametrize("name", GROUP_NAMES)
@pytest.mark.parametrize("norm_by_std", [True, False])
def test_float32_tied_groups_have_exactly_zero_advantage(name: str, norm_by_std: bool) -> None:
    # Scores whose float32 group mean (sum / n, rounded) is an ulp off the tied score, as a
    # reward model gives n identical responses: GRPO divided that ulp by a std of the same
    # size, giving every row of the group an advantage of about +-0.87 (102.4, n = 7).
    for score, n in [(102.40487670898438, 7), (1.1, 3), (0.1, 6), (7.3, 5)]:
        rewards = torch.zeros(3 * n, 2)
        rewards[:, 1] = torch.tensor([score, score + 1.0, score - 0.5]).repeat_interleave(n)
        mask = torch.ones_like(rewards)
        index = torch.arange(3).repeat_interleave(n)
        advantages, _ = compute_advantages(
            name,
            AdvantageInputs(
                token_level_rewards=rewards,
                response_mask=mask,
                index=index,
                norm_adv_by_std=norm_by_std,
            ),
        )
        assert torch.equal(advantages, torch.zeros_like(advantages)), (score, n)


@pytest.mark.parametrize("name", ["gae", "reinforce_plus_plus"])
def test_float32_tied_batch_whitens_to_exactly_zero(name: str) -> None:
    # Every response scores the same, at every token (gamma = lam = 1, values 0): the batch
    # mean (sum / n, rounded) missed the tied value by an ulp, and whitening divided that by
    # sqrt(1e-8): every token got the same advantage of up to 5e-3 (3.7, n = 3), a push up
    # of every sampled token the scores never asked for.
    for score, n in [(3.7, 3), (3.7, 13), (0.7, 7), (0.1, 100), (1.3, 1000)]:
        rewards = torch.zeros(n, 4)
        mask = torch.ones(n, 4)
        mask[0, 1] = 0  # an observation hole, with garbage under it
        rewards[0, 1] = PAD
        rewards[:, 3] = score
        advantages, _ = compute_advantages(
            name,
            AdvantageInputs(
                token_level_rewards=rewards,
                response_mask=mask,
                values=torch.zeros(n, 4),
                gamma=1.0,
                lam=1.0,
            ),
        )
        assert torch.equal(advantages, torch.zeros_like(advantages)), (score, n)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("holes", [False, True])
def test_rloo_matches_loop_reference(seed: int, holes: bool) -> None:
    b = make_batch(seed, holes=holes)
    advantages, returns = compute_advantages("rloo", AdvantageInputs(**b.kwargs()))
    close(advantages, ref_rloo(b))
    close(returns, advantages)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma", [1.0, 0.99, 0.5, 0.0])
@pytest.mark.parametrize("holes", [False, True])
def test_reinforce_plus_plus_matches_loop_reference(seed: int, gamma: float, holes: bool) -> None:
    b = make_batch(seed, holes=holes)
    advantages, returns = compute_advantages(
        "reinforce_plus_plus", AdvantageInputs(**b.kwargs(gamma=gamma))
    )
    ref_adv, ref_ret = ref_reinforce_pp(b, gamma)
    close(advantages, ref_adv)
    close(returns, ref_ret)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("holes", [False, True])
def test_reinforce_plus_plus_baseline_matches_loop_reference(seed: int, holes: bool) -> None:
    b = make_batch(seed, holes=holes)
    advantages, returns = compute_advantages(
        "reinforce_plus_plus_baseline", AdvantageInputs(**b.kwargs())
    )
    close(advantages, ref_reinforce_pp_baseline(b))
    close(returns, advantages)


@pytest.mark.parametrize(
    ("name", "extra"),
    [
        ("gae", {"gamma": 0.99, "lam": 0.95}),
        ("gae", {"gamma": 1.0, "lam": 1.0}),
        ("reinforce_plus_plus", {"gamma": 0.99}),
        ("reinforce_plus_plus", {"gamma": 1.0}),
        ("grpo", {}),
        ("rloo", {}),
    ],
)
@pytest.mark.parametrize("holes", [False, True])
def test_long_responses_match_reference(name: str, extra: dict[str, float], holes: bool) -> None:
    # The discounted sums are vectorized over T; check they stay exact at realistic lengths.
    lengths = [512, 300, 1, 0, 477]
    b = make_batch(11, steps=512, group_sizes=(3, 2), lengths=lengths, holes=holes)
    advantages, returns = compute_advantages(name, AdvantageInputs(**b.kwargs(**extra)))
    if name == "gae":
        ref_adv, ref_ret = ref_gae(b, extra["gamma"], extra["lam"])
    elif name == "reinforce_plus_plus":
        ref_adv, ref_ret = ref_reinforce_pp(b, extra["gamma"])
    elif name == "grpo":
        ref_adv = ref_ret = ref_grpo(b, True, 1e-6)
    else:
        ref_adv = ref_ret = ref_rloo(b)
    close(advantages, ref_adv)
    close(returns, ref_ret)


# --------------------------------------------------------------------------- masking


@pytest.mark.parametrize("name", sorted(ALL_NAMES))
def test_zero_outside_mask_and_empty_row(name: str) -> None:
    b = make_batch(3)
    advantages, returns = compute_advantages(name, AdvantageInputs(**b.kwargs(gamma=0.9, lam=0.8)))
    outside = ~b.mask.bool()
    assert outside.any() and (b.mask.sum(-1) == 0).any()
    for out in (advantages, returns):
        assert torch.isfinite(out).all()
        assert (out[outside] == 0).all()


@pytest.mark.parametrize("name", sorted(ALL_NAMES))
def test_all_masked_batch_gives_zeros_not_nan(name: str) -> None:
    b = make_batch(4, group_sizes=(2, 1, 3), lengths=[0] * 6)
    advantages, returns = compute_advantages(name, AdvantageInputs(**b.kwargs()))
    assert torch.equal(advantages, torch.zeros_like(advantages))
    assert torch.equal(returns, torch.zeros_like(returns))


@pytest.mark.parametrize("name", sorted(ALL_NAMES))
def test_a_batch_of_no_rows_gives_no_advantages(name: str) -> None:
    # The whitening estimators centre on the smallest masked value, whose amin has no
    # identity: a batch of no rows raised there, where the group estimators return it empty.
    b = make_batch(5, group_sizes=())
    advantages, returns = compute_advantages(name, AdvantageInputs(**b.kwargs()))
    assert advantages.shape == returns.shape == (0, 9)
    assert float(masked_var(b.values, b.mask)) == 0.0


@pytest.mark.parametrize("name", sorted(ALL_NAMES))
@pytest.mark.parametrize("pad", [math.nan, math.inf])
def test_non_finite_padding_is_ignored(name: str, pad: float) -> None:
    clean = make_batch(6)
    dirty = make_batch(6, pad=pad)
    expected = compute_advantages(name, AdvantageInputs(**clean.kwargs(gamma=0.9, lam=0.9)))
    actual = compute_advantages(name, AdvantageInputs(**dirty.kwargs(gamma=0.9, lam=0.9)))
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=0, atol=0)


@pytest.mark.parametrize("name", sorted(ALL_NAMES))
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64, torch.float32])
def test_mask_dtype_does_not_matter(name: str, mask_dtype: torch.dtype) -> None:
    b = make_batch(8)
    expected = compute_advantages(name, AdvantageInputs(**b.kwargs(gamma=0.95, lam=0.9)))
    kwargs = b.kwargs(gamma=0.95, lam=0.9)
    kwargs["response_mask"] = b.mask.to(mask_dtype)
    actual = compute_advantages(name, AdvantageInputs(**kwargs))
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=0, atol=0)


@pytest.mark.parametrize("name", sorted(ALL_NAMES))
def test_float32_inputs_stay_float32(name: str) -> None:
    b = make_batch(9)
    expected = compute_advantages(name, AdvantageInputs(**b.kwargs(gamma=0.99, lam=0.95)))
    kwargs = b.kwargs(gamma=0.99, lam=0.95)
    kwargs["token_level_rewards"] = b.rewards.float()
    kwargs["values"] = b.values.float()
    kwargs["response_mask"] = b.mask.float()
    actual = compute_advantages(name, AdvantageInputs(**kwargs))
    for a, e in zip(actual, expected, strict=True):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a.double(), e, rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------- registry


def test_registry_holds_the_five_estimators() -> None:
    assert set(ADV_ESTIMATORS) == ALL_NAMES
    assert frozenset({"gae"}) == ESTIMATORS_NEEDING_CRITIC


@pytest.mark.parametrize("name", sorted(ALL_NAMES))
def test_every_estimator_takes_one_advantage_inputs(name: str) -> None:
    (param,) = inspect.signature(ADV_ESTIMATORS[name]).parameters.values()
    assert param.annotation in (AdvantageInputs, "AdvantageInputs")
    assert {f.name for f in dataclasses.fields(AdvantageInputs)} == UNIFORM_KWARGS


def test_unknown_name_lists_valid_names_sorted() -> None:
    b = make_batch(0)
    with pytest.raises(ValueError, match="ppo_magic") as info:
        compute_advantages("ppo_magic", AdvantageInputs(**b.kwargs()))
    assert ", ".join(sorted(ALL_NAMES)) in str(info.value)


def test_gae_without_values_names_the_argument() -> None:
    b = make_batch(0)
    kwargs = b.kwargs()
    kwargs["values"] = None
    with pytest.raises(ValueError, match="`values`"):
        compute_advantages("gae", AdvantageInputs(**kwargs))


@pytest.mark.parametrize("name", GROUP_NAMES)
def test_group_estimators_without_index_name_the_argument(name: str) -> None:
    b = make_batch(0)
    kwargs = b.kwargs()
    kwargs["index"] = None
    with pytest.raises(ValueError, match="`index`"):
        compute_advantages(name, AdvantageInputs(**kwargs))


@pytest.mark.parametrize("name", ["reinforce_plus_plus", "grpo"])
def test_estimators_not_needing_values_run_without_them(name: str) -> None:
    b = make_batch(2)
    kwargs = b.kwargs(gamma=0.9)
    expected = compute_advantages(name, AdvantageInputs(**kwargs))
    kwargs["values"] = None
    actual = compute_advantages(name, AdvantageInputs(**kwargs))
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=0, atol=0)


def test_wrong_shapes_are_rejected() -> None:
    b = make_batch(0)
    kwargs = b.kwargs()
    kwargs["index"] = b.index[:-1]
    with pytest.raises(ValueError, match="index"):
        compute_advantages("grpo", AdvantageInputs(**kwargs))
    kwargs = b.kwargs()
    kwargs["values"] = b.values[:, :-1]
    with pytest.raises(ValueError, match="values"):
        compute_advantages("gae", AdvantageInputs(**kwargs))
    kwargs = b.kwargs()
    kwargs["response_mask"] = b.mask[:, :-1]
    with pytest.raises(ValueError, match="response_mask"):
        compute_advantages("rloo", AdvantageInputs(**kwargs))


def test_compute_advantages_hands_the_estimator_its_inputs() -> None:
    seen: list[AdvantageInputs] = []
    marker = (torch.zeros(1), torch.ones(1))

    @register_advantage("_spy")
    def spy(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append(inputs)
        return marker

    try:
        b = make_batch(0)
        inputs = AdvantageInputs(**b.kwargs(gamma=0.5, lam=0.25, epsilon=0.1))
        assert compute_advantages("_spy", inputs) is marker
        assert seen == [inputs]
        assert inputs.norm_adv_by_std is True
    finally:
        ADV_ESTIMATORS.pop("_spy", None)
        adv_mod.ESTIMATOR_SETTINGS.pop("_spy", None)
    assert "_spy" not in adv_mod.ADV_ESTIMATORS


def test_registering_a_taken_name_fails() -> None:
    with pytest.raises(ValueError, match="already registered"):
        register_advantage("gae")(ADV_ESTIMATORS["gae"])
    assert set(ADV_ESTIMATORS) == ALL_NAMES
