"""Dispatch and collect as pure functions: every mode, balanced splits whose results come back
in the original order, the mini-batch property of ``DpSplit``, non-tensor entries, metrics."""

import pytest
import torch
from tensordict import TensorDict

from verlite.controller.dispatch import DpSplit, collect, dispatch
from verlite.core.metrics import Metric
from verlite.core.partition import dp_shares
from verlite.step_batch import row_costs


def ragged_batch(n: int, *, width: int = 12, seed: int = 0) -> TensorDict:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (n,), generator=gen)
    mask = (torch.arange(width) < lengths[:, None]).long()
    td = TensorDict(
        {"uid": torch.arange(n), "attention_mask": mask, "x": torch.randn(n, 3, generator=gen)},
        batch_size=[n],
    )
    td.set_non_tensor("temperature", 0.7)
    return td


def worker_output(td: TensorDict, rank: int) -> TensorDict:
    """What a worker returns for its rows: a per-row result plus which rank computed it."""
    return TensorDict(
        {"uid": td["uid"], "y": td["x"].sum(-1) * 2, "rank": torch.full((td.shape[0],), rank)},
        batch_size=td.batch_size,
    )


def test_broadcast_sends_the_same_arguments_to_every_rank() -> None:
    plan = dispatch("broadcast", 3, (1, "a"), {"k": 2.0})
    assert plan.args == [(1, "a")] * 3
    assert plan.kwargs == [{"k": 2.0}] * 3
    assert plan.restore is None


def test_all_gives_each_rank_its_element() -> None:
    plan = dispatch("all", 2, ([10, 11], ["a", "b"]), {"k": [0.5, 1.5]})
    assert plan.args == [(10, "a"), (11, "b")]
    assert plan.kwargs == [{"k": 0.5}, {"k": 1.5}]
    with pytest.raises(ValueError, match="one element per rank"):
        dispatch("all", 3, ([1, 2],), {})


@pytest.mark.parametrize("world", [1, 2, 4])
def test_dp_split_balances_tokens_and_restores_order(world: int) -> None:
    batch = ragged_batch(16)
    plan = dispatch("dp_split", world, (batch, "extra"), {"flag": True})
    chunks = [args[0] for args in plan.args]
    assert all(args[1:] == ("extra",) for args in plan.args)
    assert plan.kwargs == [{"flag": True}] * world
    assert {c.shape[0] for c in chunks} == {16 // world}
    tokens = [int(c["attention_mask"].sum()) for c in chunks]
    assert max(tokens) - min(tokens) <= max(row_costs(batch))
    if world > 1:
        # Balancing must have moved rows around, or the order check below proves nothing.
        assert torch.cat([c["uid"] for c in chunks]).tolist() != list(range(16))
    out = collect("concat", [worker_output(c, r) for r, c in enumerate(chunks)], plan.restore)
    assert out["uid"].tolist() == list(range(16))
    torch.testing.assert_close(out["y"], batch["x"].sum(-1) * 2)


def test_dp_split_with_uneven_rows_keeps_every_row_once() -> None:
    batch = ragged_batch(10)
    plan = dispatch("dp_split", 4, (batch,), {})
    chunks = [args[0] for args in plan.args]
    assert sorted(torch.cat([c["uid"] for c in chunks]).tolist()) == list(range(10))
    out = collect("concat", [worker_output(c, r) for r, c in enumerate(chunks)], plan.restore)
    assert out["uid"].tolist() == list(range(10))


def test_dp_split_without_attention_mask_counts_rows() -> None:
    td = TensorDict({"uid": torch.arange(8)}, batch_size=[8])
    assert row_costs(td) == [1] * 8
    chunks = [args[0] for args in dispatch("dp_split", 2, (td,), {}).args]
    assert [c.shape[0] for c in chunks] == [4, 4]


def test_non_tensor_entries_survive_the_split_and_the_concat() -> None:
    cut = dispatch(DpSplit(mini_batches=2), 2, (ragged_batch(8),), {})
    assert [args[0][1].get_non_tensor("temperature") for args in cut.args] == [0.7, 0.7]
    plan = dispatch("dp_split", 2, (ragged_batch(8),), {})
    chunks = [args[0] for args in plan.args]
    assert [c.get_non_tensor("temperature") for c in chunks] == [0.7, 0.7]
    out = collect("concat", chunks, plan.restore)
    assert out.get_non_tensor("temperature") == 0.7
    assert out["uid"].tolist() == list(range(8))


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("mini_batches", [1, 2, 4])
def test_each_ranks_kth_part_is_its_piece_of_global_mini_batch_k(
    world: int, mini_batches: int
) -> None:
    n = 16
    chunk = n // mini_batches
    plan = dispatch(DpSplit(mini_batches=mini_batches), world, (ragged_batch(n),), {})
    assert {tuple(args[0].batch_size) for args in plan.args} == {(mini_batches, chunk // world)}
    shares = [args[0]["uid"].tolist() for args in plan.args]
    for k in range(mini_batches):
        # What a worker does: take row k of its (mini_batches, rows) share.
        union = sorted(uid for share in shares for uid in share[k])
        assert union == list(range(k * chunk, (k + 1) * chunk))


def test_mini_batches_balance_each_chunk() -> None:
    lengths = [1, 1, 9, 9, 1, 9, 1, 9]
    shares = dp_shares(lengths, world=2, mini_batches=2)
    for k in range(2):
        pieces = [[i for i in share if k * 4 <= i < (k + 1) * 4] for share in shares]
        assert [sum(lengths[i] for i in p) for p in pieces] == [10, 10]


def test_mini_batches_must_divide_evenly() -> None:
    with pytest.raises(ValueError, match="equal mini-batches"):
        dp_shares([1] * 10, world=2, mini_batches=3)
    with pytest.raises(ValueError, match="must divide over the 4 ranks"):
        dp_shares([1] * 12, world=4, mini_batches=2)


def test_collect_rank0_list_and_metrics() -> None:
    assert collect("rank0", ["a", "b"]) == "a"
    assert collect("list", ["a", "b"]) == ["a", "b"]
    parts = [
        {"loss": Metric.loss(0.2), "clip": Metric.weighted_mean(0.5, 2.0), "n": Metric.sum(3.0)},
        {"loss": Metric.loss(0.4), "clip": Metric.weighted_mean(0.0, 6.0), "n": Metric.sum(1.0)},
    ]
    reduced = collect("metrics", parts)
    assert reduced == pytest.approx({"loss": 0.3, "clip": 0.125, "n": 4.0})
    assert all(isinstance(v, float) for v in reduced.values())


def test_concat_without_split_and_unknown_modes() -> None:
    parts = [TensorDict({"a": torch.tensor([r, r])}, batch_size=[2]) for r in range(2)]
    assert collect("concat", parts)["a"].tolist() == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="one result row per input row"):
        collect("concat", parts, restore=[0, 1, 2])
    with pytest.raises(ValueError, match="unknown collect"):
        collect("sum", [1])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown dispatch"):
        dispatch("scatter", 2, (), {})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="TensorDict"):
        dispatch("dp_split", 2, ([1, 2],), {})


def test_packed_shares_balance_the_quadratic_cost_of_long_rows() -> None:
    """With ``crossover`` a row of L tokens costs L + L^2 / crossover: the shares balance
    that cost, so the rank with the longest row takes fewer tokens."""
    lengths = torch.tensor([1024, 600, 600, 600] + [64] * 28)
    width = int(lengths.max())
    batch = TensorDict(
        {"attention_mask": (torch.arange(width) < lengths[:, None]).long()}, batch_size=[32]
    )
    assert row_costs(batch, 512) == [n + n * n // 512 for n in lengths.tolist()]

    def spread(crossover: int | None) -> tuple[int, int]:
        plan = dispatch(DpSplit(crossover=crossover), 2, (batch,), {})
        shares = [args[0]["attention_mask"].sum(-1) for args in plan.args]
        tokens = [int(s.sum()) for s in shares]
        packed = [int((s + s * s // 512).sum()) for s in shares]
        return max(tokens) - min(tokens), max(packed) - min(packed)

    by_tokens, by_cost = spread(None), spread(512)
    assert by_tokens[0] < by_cost[0]  # tokens balance better when tokens are the cost
    assert by_cost[1] < by_tokens[1] / 2  # the packed cost balances far better with it
