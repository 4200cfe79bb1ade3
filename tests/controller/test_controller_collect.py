"""Dispatch and collect without needless copies: one rank gets the batch itself, results
already in order are returned as they are, and shuffled results are put back in order with
one copy — the same TensorDict the concatenation and gather would give."""

import pytest
import torch
from tensordict import TensorDict

from verlite.controller.dispatch import DpSplit, collect, dispatch


def ragged(n: int, *, seed: int = 0) -> TensorDict:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 13, (n,), generator=gen)
    td = TensorDict(
        {
            "attention_mask": (torch.arange(12) < lengths[:, None]).long(),
            "uid": torch.arange(n),
            "x": torch.randn(n, 3, 2, generator=gen),
        },
        batch_size=[n],
    )
    td.set_non_tensor("temperature", 0.5)
    return td


def test_one_rank_gets_the_batch_itself_and_its_result_back_as_is() -> None:
    batch = ragged(8)
    plan = dispatch("dp_split", 1, (batch,), {})
    assert plan.args[0][0] is batch
    result = batch.clone()
    assert collect("concat", [result], plan.restore) is result
    # Cut into mini-batches, the one share is a view of the batch: no row is copied.
    (share,) = dispatch(DpSplit(mini_batches=2), 1, (batch,), {}).args[0]
    assert tuple(share.batch_size) == (2, 4)
    assert all(share[key].data_ptr() == batch[key].data_ptr() for key in ("uid", "x"))


@pytest.mark.parametrize("world", [2, 4])
def test_shuffled_results_come_back_in_order(world: int) -> None:
    batch = ragged(16)
    plan = dispatch("dp_split", world, (batch,), {})
    shares = [args[0] for args in plan.args]
    order = torch.tensor(plan.restore)
    expected = torch.cat(shares)[order]
    out = collect("concat", shares, plan.restore)
    assert out["uid"].tolist() == list(range(16))
    assert (out == expected).all() and out.get_non_tensor("temperature") == 0.5
    torch.testing.assert_close(out["x"], batch["x"], rtol=0, atol=0)
    tensors = collect("concat", [s["x"] for s in shares], plan.restore)
    torch.testing.assert_close(tensors, batch["x"], rtol=0, atol=0)


def test_different_non_tensor_entries_are_stacked_per_row() -> None:
    batch = ragged(8)
    plan = dispatch("dp_split", 2, (batch,), {})
    shares = [args[0].clone() for args in plan.args]
    shares[1].set_non_tensor("temperature", 0.9)
    out = collect("concat", shares, plan.restore)
    rank_of_row = {int(u): r for r, s in enumerate(shares) for u in s["uid"]}
    assert out.get_non_tensor("temperature") == [0.9 if rank_of_row[i] else 0.5 for i in range(8)]


def test_row_counts_are_checked_on_every_path() -> None:
    batch = ragged(8)
    for world in (1, 2):
        plan = dispatch("dp_split", world, (batch,), {})
        short = [args[0][:-1] for args in plan.args]
        with pytest.raises(ValueError, match="one result row per input row"):
            collect("concat", short, plan.restore)
