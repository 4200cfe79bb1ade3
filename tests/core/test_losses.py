"""agg_loss and the losses built on it: worked values, invariance to micro-batching and DP."""

from collections.abc import Callable

import pytest
import torch

from verlite.core.losses import (
    LOSS_AGG_MODES,
    GlobalCounts,
    agg_loss,
    compute_policy_loss,
    compute_value_loss,
    count_valid,
    entropy_from_logits,
    kl_penalty,
    log_probs_from_logits,
)
from verlite.core.metrics import Metric, Stage, reduce_metrics

LOSS = torch.tensor([[1.0, 2.0, 30.0], [4.0, 50.0, 6.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 1]])
SCALE = 6.0  # loss_scale_factor for seq-mean-token-sum-norm: a constant, not a padded width


@pytest.mark.parametrize(
    ("mode", "kwargs", "expected"),
    [
        ("token-sum", {"counts": GlobalCounts(4, 4, 2)}, 52.0),
        ("token-sum", {}, 13.0),
        ("token-mean", {}, 13 / 4),
        ("token-mean", {"counts": GlobalCounts(4, 16, 8)}, 13 / 16 * 4),
        ("seq-mean-token-sum", {}, 13 / 2),
        ("seq-mean-token-sum", {"counts": GlobalCounts(2, 8, 4)}, 13 / 4 * 2),
        ("seq-mean-token-mean", {}, (1.5 + 5.0) / 2),
        ("seq-mean-token-sum-norm", {"loss_scale_factor": 3.0}, 13 / 2 / 3),
    ],
)
def test_worked_values(mode: str, kwargs: dict, expected: float) -> None:
    assert agg_loss(LOSS, MASK, loss_agg_mode=mode, **kwargs).item() == pytest.approx(expected)


def test_fully_masked_rows_count_for_nothing() -> None:
    loss = torch.cat([LOSS, torch.full((1, 3), 1e6)])
    mask = torch.cat([MASK, torch.zeros(1, 3, dtype=MASK.dtype)])
    for mode in LOSS_AGG_MODES:
        with_row = agg_loss(loss, mask, loss_agg_mode=mode, loss_scale_factor=SCALE)
        without = agg_loss(LOSS, MASK, loss_agg_mode=mode, loss_scale_factor=SCALE)
        assert with_row.item() == pytest.approx(without.item()), mode


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_all_masked_batch_is_zero_with_gradient(mode: str) -> None:
    theta = torch.randn(3, 4, requires_grad=True)
    mask = torch.zeros(3, 4)
    loss = agg_loss(theta.exp(), mask, loss_agg_mode=mode, loss_scale_factor=SCALE)
    loss.backward()
    assert loss.item() == 0.0
    assert theta.grad is not None and torch.all(theta.grad == 0)


def test_nan_in_masked_positions_does_not_leak() -> None:
    loss = LOSS.clone()
    loss[0, 2] = float("nan")
    for mode in LOSS_AGG_MODES:
        assert torch.isfinite(agg_loss(loss, MASK, loss_agg_mode=mode, loss_scale_factor=SCALE))


def test_errors_name_what_is_allowed() -> None:
    with pytest.raises(ValueError, match="valid modes: token-mean, token-sum"):
        agg_loss(LOSS, MASK, loss_agg_mode="mean")
    for bad in (0, -1):
        with pytest.raises(ValueError, match="dp_size must be an int >= 1"):
            GlobalCounts(bad, 4, 2)
    for field in range(3):
        for bad in (-1, 1.0, True, "2", torch.tensor(2)):
            values = [2, 4, 2]
            values[field] = bad
            with pytest.raises(ValueError, match="must be an int >= "):
                GlobalCounts(*values)
    with pytest.raises(ValueError, match="needs a positive loss_scale_factor"):
        agg_loss(LOSS, MASK, loss_agg_mode="seq-mean-token-sum-norm")


def test_counts_of_a_mask_are_its_valid_tokens_and_sequences() -> None:
    mask = torch.cat([MASK, torch.zeros(1, 3, dtype=MASK.dtype)])
    assert GlobalCounts.of(mask) == GlobalCounts(1, 4, 2)
    assert count_valid(mask.float()).tolist() == [4, 2]


# ------------------------------------------------------------------ invariance harness
#
# A "layout" is, per DP rank, a list of micro-batches (row index lists). The harness does
# exactly what the engine does: count once over the global mini-batch, compute every
# micro-batch loss with the global counts and dp_size, sum gradients over micro-batches,
# average them over ranks (what DDP does), and reduce the loss metric (docs/design.md, "The normalization contract").

B, T, V = 8, 7, 5
LENGTHS = [7, 3, 0, 5, 1, 6, 2, 4]  # ragged, with one fully masked row

LAYOUTS = {
    "1 micro": [[list(range(B))]],
    "2 micro": [[[0, 1, 2, 3], [4, 5, 6, 7]]],
    "4 micro, uneven": [[[0], [1, 2, 3, 4], [5], [6, 7]]],
    "dp2": [[[0, 1, 2, 3]], [[4, 5, 6, 7]]],
    "dp2 x micro": [[[0], [1, 2, 3]], [[4, 5], [6], [7]]],
    "dp4 x micro": [[[0], [1]], [[2, 3]], [[4], [5]], [[6, 7]]],
    "dp4 uneven rows": [[[0, 1, 2]], [[3]], [[4, 5], [6]], [[7]]],
}

LossOfRows = Callable[..., tuple[torch.Tensor, Metric]]


def ragged_mask(dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return (torch.arange(T).unsqueeze(0) < torch.tensor(LENGTHS).unsqueeze(1)).to(dtype)


def run_layout(
    loss_of_rows: LossOfRows, params: torch.Tensor, mask: torch.Tensor, layout: list
) -> tuple[torch.Tensor, float]:
    dp = len(layout)
    tokens, sequences = int(mask.sum()), int((mask.sum(-1) > 0).sum())
    global_counts = GlobalCounts(dp, tokens, sequences)
    rank_grads, rank_metrics = [], []
    for micro_batches in layout:
        params.grad = None
        micro_metrics = []
        for rows in micro_batches:
            loss, metric = loss_of_rows(rows, counts=global_counts)
            loss.backward()
            micro_metrics.append({"loss": metric})
        rank_grads.append(params.grad.clone())
        rank_metrics.append(reduce_metrics(micro_metrics, Stage.MICRO_BATCHES))
    params.grad = None
    grad = torch.stack(rank_grads).mean(0)  # DDP averages gradients over ranks
    reported = reduce_metrics(rank_metrics, Stage.RANKS)["loss"].value
    return grad, float(reported)


def reference(loss_of_rows: LossOfRows, params: torch.Tensor) -> tuple[torch.Tensor, float]:
    params.grad = None
    loss, _ = loss_of_rows(list(range(B)))  # dp_size=1, local counts = global counts
    loss.backward()
    grad = params.grad.clone()
    params.grad = None
    return grad, loss.item()


def token_loss_problem(mode: str):
    gen = torch.Generator().manual_seed(0)
    params = torch.randn(B, T, dtype=torch.float64, generator=gen, requires_grad=True)
    shared = torch.randn(T, dtype=torch.float64, generator=gen)
    mask = ragged_mask()

    def loss_of_rows(rows, **kw):
        loss_mat = (params[rows] * shared).sin() + params[rows] ** 2
        loss = agg_loss(loss_mat, mask[rows], loss_agg_mode=mode, loss_scale_factor=SCALE, **kw)
        return loss, Metric.loss(loss)

    return loss_of_rows, params, mask


def policy_problem(mode: str, loss_mode: str = "vanilla", weighted: bool = False):
    """Policy loss + entropy bonus + KL loss, each globally normalized, through logits;
    ``weighted``: with per-token importance weights on the policy loss."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(B, T, V, dtype=torch.float64, generator=gen, requires_grad=True)
    labels = torch.randint(0, V, (B, T), generator=gen)
    old = log_probs_from_logits(
        logits.detach() + 0.3 * torch.randn(B, T, V, dtype=torch.float64, generator=gen), labels
    )
    ref = log_probs_from_logits(
        logits.detach() + 0.5 * torch.randn(B, T, V, dtype=torch.float64, generator=gen), labels
    )
    adv = torch.randn(B, T, dtype=torch.float64, generator=gen)
    mask = ragged_mask()
    weights = (0.5 + 1.5 * torch.rand(B, T, dtype=torch.float64, generator=gen)) * mask

    def loss_of_rows(rows, **kw):
        log_prob = log_probs_from_logits(logits[rows], labels[rows])
        m = mask[rows]
        agg = {"loss_agg_mode": mode, "loss_scale_factor": SCALE, **kw}
        pg, _ = compute_policy_loss(
            old_log_prob=old[rows],
            log_prob=log_prob,
            advantages=adv[rows],
            response_mask=m,
            loss_mode=loss_mode,
            importance_weights=weights[rows] if weighted else None,
            **agg,
        )
        entropy = agg_loss(entropy_from_logits(logits[rows]), m, **agg)
        kl = agg_loss(kl_penalty(log_prob, ref[rows], kind="k3+"), m, **agg)
        loss = pg - 0.01 * entropy + 0.1 * kl
        return loss, Metric.loss(loss)

    return loss_of_rows, logits, mask


def value_problem(mode: str):
    gen = torch.Generator().manual_seed(2)
    vpreds = torch.randn(B, T, dtype=torch.float64, generator=gen, requires_grad=True)
    values = vpreds.detach() + 0.4 * torch.randn(B, T, dtype=torch.float64, generator=gen)
    returns = torch.randn(B, T, dtype=torch.float64, generator=gen)
    mask = ragged_mask()

    def loss_of_rows(rows, **kw):
        loss, _ = compute_value_loss(
            vpreds=vpreds[rows] * 1.5,
            values=values[rows],
            returns=returns[rows],
            response_mask=mask[rows],
            cliprange_value=0.2,
            loss_agg_mode=mode,
            loss_scale_factor=SCALE,
            **kw,
        )
        return loss, Metric.loss(loss)

    return loss_of_rows, vpreds, mask


PROBLEMS = {
    "agg_loss": token_loss_problem,
    "policy+entropy+kl (vanilla)": policy_problem,
    "policy+entropy+kl (gspo)": lambda mode: policy_problem(mode, "gspo"),
    "policy+entropy+kl (reinforce)": lambda mode: policy_problem(mode, "reinforce"),
    "policy+entropy+kl (vanilla, importance weights)": lambda mode: policy_problem(
        mode, weighted=True
    ),
    "value": value_problem,
}


@pytest.mark.parametrize("problem", PROBLEMS)
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gradient_and_loss_invariant_to_layout(problem: str, mode: str, layout: str) -> None:
    loss_of_rows, params, mask = PROBLEMS[problem](mode)
    ref_grad, ref_loss = reference(loss_of_rows, params)
    grad, reported = run_layout(loss_of_rows, params, mask, LAYOUTS[layout])
    assert ref_grad.abs().max() > 0
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)
    assert reported == pytest.approx(ref_loss, rel=1e-10, abs=1e-12)


def naive_layout_grad(loss_of_rows, params, layout) -> torch.Tensor:
    """What many frameworks do: normalize each micro-batch locally and divide by grad-accum."""
    rank_grads = []
    for micro_batches in layout:
        params.grad = None
        for rows in micro_batches:
            loss, _ = loss_of_rows(rows)  # local counts, dp_size=1
            (loss / len(micro_batches)).backward()
        rank_grads.append(params.grad.clone())
    params.grad = None
    return torch.stack(rank_grads).mean(0)


@pytest.mark.parametrize("problem", PROBLEMS)
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_negative_control_naive_normalization_differs(problem: str, mode: str) -> None:
    loss_of_rows, params, _ = PROBLEMS[problem](mode)
    ref_grad, _ = reference(loss_of_rows, params)
    naive = naive_layout_grad(loss_of_rows, params, LAYOUTS["dp2 x micro"])
    assert not torch.allclose(naive, ref_grad, rtol=1e-6, atol=0), "the harness could not fail"


# ------------------------------------------------------------------------- policy loss


def test_vanilla_policy_loss_clipping_and_dual_clip() -> None:
    old = torch.zeros(1, 4, dtype=torch.float64)
    log_prob = torch.log(torch.tensor([[1.0, 1.5, 0.5, 10.0]], dtype=torch.float64))
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 4)
    loss, metrics = compute_policy_loss(
        old_log_prob=old,
        log_prob=log_prob,
        advantages=adv,
        response_mask=mask,
        loss_agg_mode="token-sum",
        clip_ratio_c=3.0,
    )
    # per token: -1*1, -1*min(1.5,1.2) = -1.2, max(0.5, 0.8)=0.8, min(max(10, 1.2), 3) = 3
    assert loss.item() == pytest.approx(-1.0 - 1.2 + 0.8 + 3.0)
    assert float(metrics["pg_clipfrac"].value) == pytest.approx(2 / 4)
    assert float(metrics["pg_clipfrac_lower"].value) == pytest.approx(1 / 4)
    assert float(metrics["ppo_kl"].value) == pytest.approx(-log_prob.mean().item())
    assert float(metrics["pg_clipfrac"].weight) == 4


def test_asymmetric_clip_ratio() -> None:
    old = torch.zeros(1, 2, dtype=torch.float64)
    log_prob = torch.log(torch.tensor([[1.5, 0.5]], dtype=torch.float64))
    adv = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    loss, _ = compute_policy_loss(
        old_log_prob=old,
        log_prob=log_prob,
        advantages=adv,
        response_mask=torch.ones(1, 2),
        clip_ratio_low=0.1,
        clip_ratio_high=0.28,
        loss_agg_mode="token-sum",
    )
    assert loss.item() == pytest.approx(-1.28 + 0.9)


def test_huge_log_ratio_stays_finite() -> None:
    log_prob = torch.tensor([[500.0, -500.0]], dtype=torch.float64, requires_grad=True)
    loss, _ = compute_policy_loss(
        old_log_prob=torch.zeros(1, 2, dtype=torch.float64),
        log_prob=log_prob,
        advantages=torch.tensor([[1.0, -1.0]], dtype=torch.float64),
        response_mask=torch.ones(1, 2),
        loss_agg_mode="token-mean",
    )
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(log_prob.grad).all()


def test_gspo_uses_one_ratio_per_sequence() -> None:
    old = torch.zeros(2, 3, dtype=torch.float64)
    log_prob = torch.tensor([[0.1, -0.1, 0.3], [0.2, 0.2, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv = torch.ones(2, 3, dtype=torch.float64)
    loss, _ = compute_policy_loss(
        old_log_prob=old,
        log_prob=log_prob,
        advantages=adv,
        response_mask=mask,
        loss_mode="gspo",
        clip_ratio_low=1.0,
        clip_ratio_high=1.0,
        loss_agg_mode="token-sum",
    )
    seq_ratio = torch.exp(torch.tensor([0.1, 0.2], dtype=torch.float64))  # masked token ignored
    assert loss.item() == pytest.approx(-(3 * seq_ratio[0] + 2 * seq_ratio[1]).item())


def test_reinforce_is_minus_advantage_times_log_prob() -> None:
    log_prob = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    loss, metrics = compute_policy_loss(
        old_log_prob=log_prob,
        log_prob=log_prob,
        advantages=torch.tensor([[2.0, 3.0]], dtype=torch.float64),
        response_mask=torch.ones(1, 2),
        loss_mode="reinforce",
        loss_agg_mode="token-sum",
    )
    assert loss.item() == pytest.approx(8.0)
    assert float(metrics["pg_clipfrac"].value) == 0.0


def test_policy_loss_errors() -> None:
    args = {
        "old_log_prob": torch.zeros(1, 2),
        "log_prob": torch.zeros(1, 2),
        "advantages": torch.zeros(1, 2),
        "response_mask": torch.ones(1, 2),
        "loss_agg_mode": "token-mean",
    }
    with pytest.raises(ValueError, match="valid modes: gspo, reinforce, vanilla"):
        compute_policy_loss(loss_mode="ppo", **args)
    with pytest.raises(ValueError, match=r"clip_ratio_c must be > 1\.0"):
        compute_policy_loss(clip_ratio_c=1.0, **args)


# -------------------------------------------------------------------------- value loss


def test_value_loss_worked_value_and_clipfrac() -> None:
    vpreds = torch.tensor([[1.0, 0.0, 5.0]], dtype=torch.float64)
    values = torch.tensor([[0.0, 0.0, 0.0]], dtype=torch.float64)
    returns = torch.tensor([[0.0, 1.0, 5.0]], dtype=torch.float64)
    loss, clipfrac = compute_value_loss(
        vpreds=vpreds,
        values=values,
        returns=returns,
        response_mask=torch.ones(1, 3),
        cliprange_value=0.5,
        loss_agg_mode="token-sum",
    )
    # token 0: max(1, 0.25) = 1; token 1: max(1, 1) = 1; token 2: max(0, 4.5^2) = 20.25
    assert loss.item() == pytest.approx(0.5 * (1 + 1 + 20.25))
    assert float(clipfrac.value) == pytest.approx(1 / 3)


# ---------------------------------------------------------------------- KL and entropy


def test_kl_kinds() -> None:
    lp = torch.tensor([-1.0, -2.0], dtype=torch.float64)
    ref = torch.tensor([-1.5, -1.0], dtype=torch.float64)
    x = lp - ref
    torch.testing.assert_close(kl_penalty(lp, ref, kind="k1"), x)
    torch.testing.assert_close(kl_penalty(lp, ref, kind="kl"), x)
    torch.testing.assert_close(kl_penalty(lp, ref, kind="abs"), x.abs())
    torch.testing.assert_close(kl_penalty(lp, ref, kind="mse"), 0.5 * x**2)
    torch.testing.assert_close(kl_penalty(lp, ref, kind="low_var_kl"), torch.exp(-x) + x - 1)
    assert (kl_penalty(lp, ref, kind="k3") >= 0).all()
    with pytest.raises(ValueError, match="valid kinds: k1, kl, abs"):
        kl_penalty(lp, ref, kind="k4")


def test_kl_plus_suffix_keeps_value_and_takes_k2_gradient() -> None:
    lp = torch.tensor([-1.0, -2.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-1.5, -1.0], dtype=torch.float64)
    value = kl_penalty(lp, ref, kind="k3+")
    torch.testing.assert_close(value.detach(), kl_penalty(lp, ref, kind="k3").detach())
    value.sum().backward()
    torch.testing.assert_close(lp.grad, (lp - ref).detach())  # d/dx of 0.5 x^2


def test_entropy_and_log_probs_match_torch_distributions() -> None:
    logits = torch.randn(3, 4, 6, dtype=torch.float64)
    labels = torch.randint(0, 6, (3, 4))
    dist = torch.distributions.Categorical(logits=logits)
    torch.testing.assert_close(entropy_from_logits(logits), dist.entropy())
    torch.testing.assert_close(log_probs_from_logits(logits, labels), dist.log_prob(labels))
