"""verlite's RL math against independent, straightforward references (Python loops over
floats, i.e. fp64), written from the papers' formulas and the conventions of verl
(``verl/trainer/ppo/core_algos.py``) where a paper leaves a choice open.

Each reference reads a batch row by row and token by token; none reuses verlite's helpers.
The batches are the awkward ones: ragged masks, a response that fills its area (EOS at the
last position), length-1 responses, all-masked rows, multi-turn holes, groups of one and
groups whose scores tie.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from verlite.core.advantages import AdvantageInputs, compute_advantages
from verlite.core.dapo import chosen_groups, overlong_penalty, tied_groups
from verlite.core.losses import (
    GlobalCounts,
    compute_policy_loss,
    compute_value_loss,
    count_valid,
    entropy_from_logits,
    kl_penalty,
)
from verlite.core.rollout_correction import truncated_is_weights
from verlite.core.step_stats import step_statistics
from verlite.core.token_rewards import KLController, apply_kl_penalty, place_scores

Rows = list[list[float]]
T = 7
# lengths of the rows: full (EOS at the last position), length 1, empty, ragged
LENGTHS = [T, 1, 0, 3, T, 5, 2, 1, 6, 4, T, 0]
# group sizes: singletons, a pair, larger groups; the tied group is made below
GROUPS = [1, 2, 3, 1, 4, 1]


def _batch(seed: int, holes: bool = False, noise: float = 0.1) -> dict[str, torch.Tensor]:
    rng = random.Random(seed)
    mask = torch.zeros(len(LENGTHS), T)
    for row, length in enumerate(LENGTHS):
        if holes and length > 2:  # a multi-turn row: policy span, observation, policy span
            cells = [1.0] * length + [0.0] * (T - length)
            cells[rng.randrange(1, length - 1)] = 0.0
            mask[row] = torch.tensor(cells)
        else:
            mask[row, :length] = 1.0
    scores = torch.tensor([float(rng.choice([0, 1, 0.5, -1])) for _ in LENGTHS])
    index = torch.tensor([g for g, size in enumerate(GROUPS) for _ in range(size)]) * 7 + 3
    # the group of four ties
    scores[index == index.unique()[4]] = 1.0
    rewards = place_scores(scores, mask).double()
    jitter = torch.randn(
        mask.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64
    )
    rewards = torch.where(mask.bool(), rewards + noise * jitter, torch.full_like(rewards, math.nan))
    values = torch.where(mask.bool(), torch.randn_like(rewards), torch.full_like(rewards, math.inf))
    return {"rewards": rewards, "mask": mask, "index": index, "values": values}


def _valid(mask: torch.Tensor, row: int) -> list[int]:
    return [t for t in range(mask.shape[1]) if mask[row, t] != 0]


def _whiten(adv: Rows, mask: torch.Tensor) -> Rows:
    cells = [adv[b][t] for b in range(len(adv)) for t in _valid(mask, b)]
    n = len(cells)
    mean = sum(cells) / max(n, 1)
    var = sum((x - mean) ** 2 for x in cells) / max(n - 1, 1)
    out = [[0.0] * T for _ in adv]
    for b in range(len(adv)):
        for t in _valid(mask, b):
            out[b][t] = (adv[b][t] - mean) / math.sqrt(var + 1e-8)
    return out


def _seq_scores(batch: dict[str, torch.Tensor]) -> list[float]:
    r, m = batch["rewards"], batch["mask"]
    return [sum(float(r[b, t]) for t in _valid(m, b)) for b in range(len(m))]


def _groups(index: torch.Tensor) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = {}
    for row, uid in enumerate(index.tolist()):
        groups.setdefault(uid, []).append(row)
    return groups


def _broadcast(per_seq: list[float], mask: torch.Tensor) -> Rows:
    return [[per_seq[b] if mask[b, t] else 0.0 for t in range(T)] for b in range(len(mask))]


def ref_gae(batch: dict[str, torch.Tensor], gamma: float, lam: float) -> tuple[Rows, Rows]:
    """Schulman et al. 2015; verl's loop, observation tokens skipped (verl PR #1955)."""
    r, v, m = batch["rewards"], batch["values"], batch["mask"]
    adv = [[0.0] * T for _ in range(len(m))]
    ret = [[0.0] * T for _ in range(len(m))]
    for b in range(len(m)):
        next_value, last = 0.0, 0.0
        for t in reversed(_valid(m, b)):
            delta = float(r[b, t]) + gamma * next_value - float(v[b, t])
            last = delta + gamma * lam * last
            adv[b][t], ret[b][t] = last, last + float(v[b, t])
            next_value = float(v[b, t])
    return _whiten(adv, m), ret


def ref_grpo(batch: dict[str, torch.Tensor], norm: bool, eps: float = 1e-6) -> Rows:
    """DeepSeekMath eq. 3 / Dr. GRPO; a group of one: mean 0, std 1 (verl)."""
    scores, out = _seq_scores(batch), [0.0] * len(batch["mask"])
    for rows in _groups(batch["index"]).values():
        n = len(rows)
        mean = sum(scores[i] for i in rows) / n if n > 1 else 0.0
        std = math.sqrt(sum((scores[i] - mean) ** 2 for i in rows) / (n - 1)) if n > 1 else 1.0
        for i in rows:
            out[i] = (scores[i] - mean) / (std + eps) if norm else scores[i] - mean
    return _broadcast(out, batch["mask"])


def ref_rloo(batch: dict[str, torch.Tensor]) -> Rows:
    """Ahmadian et al. 2024: the mean of the *other* samples is the baseline."""
    scores, out = _seq_scores(batch), [0.0] * len(batch["mask"])
    for rows in _groups(batch["index"]).values():
        for i in rows:
            others = [scores[j] for j in rows if j != i]
            out[i] = scores[i] - (sum(others) / len(others) if others else 0.0)
    return _broadcast(out, batch["mask"])


def ref_reinforce_pp(batch: dict[str, torch.Tensor], gamma: float) -> tuple[Rows, Rows]:
    """Hu et al. 2025: discounted return to go, whitened over the batch."""
    r, m = batch["rewards"], batch["mask"]
    ret = [[0.0] * T for _ in range(len(m))]
    for b in range(len(m)):
        running = 0.0
        for t in reversed(_valid(m, b)):
            running = float(r[b, t]) + gamma * running
            ret[b][t] = running
    return _whiten(ret, m), ret


def ref_reinforce_pp_baseline(batch: dict[str, torch.Tensor]) -> Rows:
    scores, out = _seq_scores(batch), [0.0] * len(batch["mask"])
    for rows in _groups(batch["index"]).values():
        mean = sum(scores[i] for i in rows) / len(rows) if len(rows) > 1 else 0.0
        for i in rows:
            out[i] = scores[i] - mean
    return _whiten(_broadcast(out, batch["mask"]), batch["mask"])


def _close(got: torch.Tensor, want: Rows | list[float], tol: float = 1e-9) -> None:
    want_t = torch.tensor(want, dtype=torch.float64)
    assert got.shape == want_t.shape
    assert torch.allclose(got.double(), want_t, rtol=tol, atol=tol), (got, want_t)


def _inputs(batch: dict[str, torch.Tensor], **kw: float | bool) -> AdvantageInputs:
    return AdvantageInputs(
        token_level_rewards=batch["rewards"],
        response_mask=batch["mask"],
        values=batch["values"],
        index=batch["index"],
        **kw,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("holes", [False, True])
def test_every_estimator_matches_its_reference(seed: int, holes: bool) -> None:
    batch = _batch(seed, holes)
    for gamma, lam in ((1.0, 1.0), (0.9, 0.95), (0.0, 0.5), (0.7, 0.0)):
        adv, ret = compute_advantages("gae", _inputs(batch, gamma=gamma, lam=lam))
        want_adv, want_ret = ref_gae(batch, gamma, lam)
        _close(adv, want_adv)
        _close(ret, want_ret)
        adv, ret = compute_advantages("reinforce_plus_plus", _inputs(batch, gamma=gamma))
        want_adv, want_ret = ref_reinforce_pp(batch, gamma)
        _close(adv, want_adv)
        _close(ret, want_ret)
    for norm in (True, False):
        adv, ret = compute_advantages("grpo", _inputs(batch, norm_adv_by_std=norm))
        _close(adv, ref_grpo(batch, norm))
        _close(ret, ref_grpo(batch, norm))
    _close(compute_advantages("rloo", _inputs(batch))[0], ref_rloo(batch))
    adv = compute_advantages("reinforce_plus_plus_baseline", _inputs(batch))[0]
    _close(adv, ref_reinforce_pp_baseline(batch))


@pytest.mark.parametrize("name", ["gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_batch_whitening_uses_the_whole_batch_not_a_ranks_share(name: str) -> None:
    """The driver whitens the step batch before it is cut over data-parallel ranks: a rank's
    rows carry the advantages of the whole batch's statistics, not of their own."""
    batch = _batch(3)
    whole = compute_advantages(name, _inputs(batch, gamma=0.9, lam=0.9))[0]
    ref = {
        "gae": lambda: ref_gae(batch, 0.9, 0.9)[0],
        "reinforce_plus_plus": lambda: ref_reinforce_pp(batch, 0.9)[0],
        "reinforce_plus_plus_baseline": lambda: ref_reinforce_pp_baseline(batch),
    }[name]()
    _close(whole, ref)
    half = {k: v[:6] for k, v in batch.items()}  # what one of two ranks would see
    local = compute_advantages(name, _inputs(half, gamma=0.9, lam=0.9))[0]
    assert not torch.allclose(local, whole[:6])


def test_tied_group_and_singletons() -> None:
    batch = _batch(5, noise=0.0)
    tied_rows = batch["index"] == batch["index"].unique()[4]
    singles = [0, 6, 11]  # rows of the groups of one (the last is empty)
    scores = torch.tensor(_seq_scores(batch), dtype=torch.float64)
    for norm in (True, False):
        adv = compute_advantages("grpo", _inputs(batch, norm_adv_by_std=norm))[0]
        assert (adv[tied_rows] == 0).all()
        for row in singles:
            valid = batch["mask"][row].bool()
            want = scores[row] / (1 + 1e-6) if norm else scores[row]
            assert torch.allclose(adv[row][valid], want.expand(int(valid.sum())))
    assert (compute_advantages("rloo", _inputs(batch))[0][tied_rows] == 0).all()


# ----------------------------------------------------------------------------- losses


def ref_ppo_token(lp: float, old: float, a: float, low: float, high: float, c: float) -> float:
    """PPO-clip (Schulman 2017) with dual-clip (Ye et al. 2020) for A < 0, as verl."""
    ratio = math.exp(max(min(lp - old, 20.0), -20.0))
    clipped = min(max(ratio, 1 - low), 1 + high)
    loss = max(-a * ratio, -a * clipped)
    return min(loss, -a * c) if a < 0 else loss


def ref_agg(loss: Rows, mask: torch.Tensor, mode: str, factor: float | None = None) -> float:
    rows = [[loss[b][t] for t in _valid(mask, b)] for b in range(len(mask))]
    rows = [r for r in rows if r]
    tokens = sum(len(r) for r in rows)
    if mode == "token-mean":
        return sum(map(sum, rows)) / max(tokens, 1)
    if mode == "token-sum":
        return sum(map(sum, rows))
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in rows) / max(len(rows), 1)
    total = sum(map(sum, rows)) / max(len(rows), 1)
    return total if mode == "seq-mean-token-sum" else total / (factor or 1.0)


MODES = [
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
]


def _policy_batch(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = _batch(seed)["mask"]
    old = -torch.rand(mask.shape, generator=g, dtype=torch.float64) * 3
    lp = old + torch.randn(mask.shape, generator=g, dtype=torch.float64) * 0.4
    lp[0, 0] = old[0, 0] + 30.0  # a ratio past the log-ratio clamp
    adv = torch.randn(mask.shape, generator=g, dtype=torch.float64) * 2
    adv[1, 0] = 0.0
    return {"mask": mask, "old": old, "lp": lp, "adv": adv}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("clips", [(0.2, 0.2, 3.0), (0.2, 0.28, 10.0), (0.1, 0.5, 1.5)])
def test_ppo_clip_dual_clip_and_aggregation_match_the_reference(
    mode: str, clips: tuple[float, float, float]
) -> None:
    x = _policy_batch(1)
    low, high, c = clips
    factor = 7.0 if mode == "seq-mean-token-sum-norm" else None
    loss, metrics = compute_policy_loss(
        old_log_prob=x["old"],
        log_prob=x["lp"],
        advantages=x["adv"],
        response_mask=x["mask"],
        clip_ratio_low=low,
        clip_ratio_high=high,
        clip_ratio_c=c,
        loss_agg_mode=mode,
        loss_scale_factor=factor,
    )
    mat = [
        [
            ref_ppo_token(
                float(x["lp"][b, t]), float(x["old"][b, t]), float(x["adv"][b, t]), low, high, c
            )
            for t in range(T)
        ]
        for b in range(len(x["mask"]))
    ]
    assert math.isclose(float(loss), ref_agg(mat, x["mask"], mode, factor), rel_tol=1e-12)
    # the same loss split over two ranks and micro-batches of three rows, global counts
    counts = count_valid(x["mask"]).tolist()
    gc = GlobalCounts(dp_size=2, batch_num_tokens=counts[0], global_batch_size=counts[1])
    per_rank = []
    for rank_rows in (range(0, 6), range(6, 12)):
        total = 0.0
        for start in range(rank_rows.start, rank_rows.stop, 3):
            sl = slice(start, start + 3)
            part, _ = compute_policy_loss(
                old_log_prob=x["old"][sl],
                log_prob=x["lp"][sl],
                advantages=x["adv"][sl],
                response_mask=x["mask"][sl],
                clip_ratio_low=low,
                clip_ratio_high=high,
                clip_ratio_c=c,
                loss_agg_mode=mode,
                counts=gc,
                loss_scale_factor=factor,
            )
            total += float(part)
        per_rank.append(total)
    assert math.isclose(sum(per_rank) / 2, float(loss), rel_tol=1e-12)
    assert set(metrics) == {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"}


def test_value_loss_matches_the_reference() -> None:
    x = _policy_batch(2)
    g = torch.Generator().manual_seed(2)
    vpreds = torch.randn(x["mask"].shape, generator=g, dtype=torch.float64)
    values = vpreds + torch.randn(x["mask"].shape, generator=g, dtype=torch.float64) * 0.5
    returns = torch.randn(x["mask"].shape, generator=g, dtype=torch.float64)
    for mode in MODES:
        factor = 5.0 if mode == "seq-mean-token-sum-norm" else None
        loss, _ = compute_value_loss(
            vpreds=vpreds,
            values=values,
            returns=returns,
            response_mask=x["mask"],
            cliprange_value=0.2,
            loss_agg_mode=mode,
            loss_scale_factor=factor,
        )
        mat = []
        for b in range(len(x["mask"])):
            row = []
            for t in range(T):
                v, old, ret = float(vpreds[b, t]), float(values[b, t]), float(returns[b, t])
                clipped = min(max(v, old - 0.2), old + 0.2)
                row.append(max((v - ret) ** 2, (clipped - ret) ** 2))
            mat.append(row)
        assert math.isclose(float(loss), 0.5 * ref_agg(mat, x["mask"], mode, factor), rel_tol=1e-12)


def ref_kl(lp: float, ref: float, kind: str) -> float:
    """Schulman's k1/k2/k3 (http://joschu.net/blog/kl-approx.html), clamps as verl."""
    x = lp - ref
    if kind in ("k1", "kl"):
        return x
    if kind == "abs":
        return abs(x)
    if kind in ("k2", "mse"):
        return 0.5 * x * x
    neg = min(max(-x, -20.0), 20.0)
    return min(max(math.exp(neg) - neg - 1.0, -10.0), 10.0)


@pytest.mark.parametrize("kind", ["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"])
def test_kl_estimators_match_the_reference_and_plus_takes_k2s_gradient(kind: str) -> None:
    lp = torch.tensor([-1.0, -0.2, -5.0, -30.0, -0.01, -2.0], dtype=torch.float64)
    ref = torch.tensor([-1.0, -1.3, -0.1, -0.5, -25.0, -2.5], dtype=torch.float64)
    _close(
        kl_penalty(lp, ref, kind=kind),
        [ref_kl(a, b, kind) for a, b in zip(lp.tolist(), ref.tolist(), strict=True)],
    )
    lp_plus = lp.clone().requires_grad_(True)
    value = kl_penalty(lp_plus, ref, kind=kind + "+")
    _close(
        value.detach(), [ref_kl(a, b, kind) for a, b in zip(lp.tolist(), ref.tolist(), strict=True)]
    )
    value.sum().backward()
    assert lp_plus.grad is not None
    _close(lp_plus.grad, (lp - ref).tolist())


def test_entropy_matches_the_reference() -> None:
    logits = torch.randn(4, 9, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3
    want = []
    for row in logits.tolist():
        z = sum(math.exp(v) for v in row)
        want.append(-sum(math.exp(v) / z * (v - math.log(z)) for v in row))
    _close(entropy_from_logits(logits), want, 1e-12)


# ------------------------------------------------------------ KL in reward, controllers


def test_kl_in_reward_and_the_adaptive_controller_follow_ziegler_and_verl() -> None:
    batch = _batch(4)
    mask = batch["mask"]
    scores = place_scores(torch.arange(len(mask), dtype=torch.float64), mask)
    kl = torch.randn(mask.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    rewards, mean_kl = apply_kl_penalty(scores, kl, mask, coef=0.05)
    per_seq = []
    for b in range(len(mask)):
        valid = _valid(mask, b)
        per_seq.append(sum(float(kl[b, t]) for t in valid) / max(len(valid), 1))
        for t in range(T):
            want = float(scores[b, t]) - (0.05 * float(kl[b, t]) if mask[b, t] else 0.0)
            assert math.isclose(float(rewards[b, t]), want, abs_tol=1e-12)
    assert math.isclose(mean_kl, sum(per_seq) / len(per_seq), abs_tol=1e-12)

    ctrl, want_coef = KLController(0.2, adaptive=True, target_kl=0.05, horizon=500), 0.2
    for current in (0.0, 0.01, 0.05, 0.07, 1.0, 0.2):
        ctrl.update(current, n_samples=64)
        want_coef *= 1 + min(max(current / 0.05 - 1, -0.2), 0.2) * 64 / 500
        assert math.isclose(ctrl.value, want_coef, rel_tol=1e-12)
    fixed = KLController(0.2)
    fixed.update(1.0, n_samples=64)
    assert fixed.value == 0.2


# --------------------------------------------------------- rollout correction, DAPO, stats


def test_truncated_is_weights_match_the_reference() -> None:
    x = _policy_batch(5)
    weights, metrics = truncated_is_weights(x["lp"], x["old"], x["mask"], cap=1.5)
    want, clipped, n = [], 0, 0
    for b in range(len(x["mask"])):
        row = []
        for t in range(T):
            raw = math.exp(max(min(float(x["lp"][b, t] - x["old"][b, t]), 20.0), -20.0))
            row.append(min(raw, 1.5) if x["mask"][b, t] else 0.0)
            if x["mask"][b, t]:
                n += 1
                clipped += raw > 1.5
        want.append(row)
    _close(weights, want, 1e-12)
    assert math.isclose(metrics["actor/rollout_is_weight/mean"], sum(map(sum, want)) / n)
    assert math.isclose(metrics["actor/rollout_is_clipfrac"], clipped / n)


def test_dapo_overlong_penalty_and_dynamic_sampling_match_the_paper() -> None:
    limit, buffer = 20, 6
    lengths = torch.arange(0, limit + 1)
    for dtype, tol in ((torch.float32, 1e-6), (torch.float64, 1e-15)):  # in the scores' dtype
        got = overlong_penalty(lengths, limit=limit, buffer=buffer, factor=1.0, dtype=dtype)
        assert got.dtype == dtype
        for length, value in zip(lengths.tolist(), got.tolist(), strict=True):  # DAPO eq. 13
            want = 0.0 if length <= limit - buffer else ((limit - buffer) - length) / buffer
            assert math.isclose(value, want, abs_tol=tol)
    scores = torch.tensor([1.0, 1.0, 0.0, 0.5, 0.5, 0.5, 0.0, 0.0, 1.0])
    assert tied_groups(scores, 3).tolist() == [False, True, False]
    assert chosen_groups(torch.tensor([True, False, True, False]), 3) == ([0, 1, 3], 1)


def test_explained_variance_matches_the_reference() -> None:
    batch = _batch(6)
    mask = batch["mask"]
    g = torch.Generator().manual_seed(6)
    returns = torch.randn(mask.shape, generator=g, dtype=torch.float64)
    values = returns + 0.3 * torch.randn(mask.shape, generator=g, dtype=torch.float64)
    stats = step_statistics(
        scores=torch.zeros(len(mask)),
        token_rewards=torch.zeros(mask.shape),
        advantages=torch.zeros(mask.shape),
        returns=returns,
        response_mask=mask,
        at_limit=torch.zeros(len(mask), dtype=torch.bool),
        values=values,
    )

    def var(xs: list[float]) -> float:
        m = sum(xs) / len(xs)
        return sum((x - m) ** 2 for x in xs) / (len(xs) - 1)

    cells = [(b, t) for b in range(len(mask)) for t in _valid(mask, b)]
    res = var([float(returns[c] - values[c]) for c in cells])
    assert math.isclose(
        stats["critic/vf_explained_var"], 1 - res / (var([float(returns[c]) for c in cells]) + 1e-8)
    )
