"""DDP and FSDP2 over spawned gloo ranks reproduce single-process full-batch training.

Each rank takes a contiguous shard of one fixed batch with ragged valid lengths, so ranks
hold different token counts. Its loss is (sum of its token NLLs) / (global token count) *
world size: DDP and FSDP2 average gradients over ranks, so the world-size factor cancels
that mean and the reduced gradient is the full-batch token-mean gradient (docs/design.md,
"The normalization contract").
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from verlite import distributed as vdist

_CONFIG = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
_BATCH, _SEQ = 8, 12
# Valid tokens per row: ragged so every shard and micro-batch holds a different count.
_LENGTHS = (12, 3, 7, 12, 5, 9, 2, 11)
_LR = 0.1
_ATOL = 1e-9


def _model() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**_CONFIG)).to(torch.float64)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, _CONFIG["vocab_size"], (_BATCH, _SEQ), generator=gen)
    mask = (torch.arange(_SEQ)[None, :] < torch.tensor(_LENGTHS)[:, None]).to(torch.float64)
    return ids, mask


def _nll_sum(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits[:, :-1]
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return -(logp * mask[:, 1:]).sum()


def _global_tokens() -> torch.Tensor:
    return _batch()[1][:, 1:].sum()


def _reference(max_norm: float | None) -> dict[str, Any]:
    model = _model()
    ids, mask = _batch()
    (_nll_sum(model, ids, mask) / _global_tokens()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm or float("inf"))
    clipped = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    torch.optim.SGD(model.parameters(), lr=_LR).step()
    state = {n: t.detach().clone() for n, t in model.state_dict().items()}
    return {"grads": grads, "norm": norm, "clipped": clipped, "state": state}


def _grad_fingerprint(model: nn.Module) -> float | None:
    """Sum of this rank's gradient entries; None when no parameter holds a gradient."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return None
    return sum(float((g.to_local() if isinstance(g, DTensor) else g).sum()) for g in grads)


def _train_rank(rank: int, world: int, strategy: str, max_norm: float) -> list[dict[str, Any]]:
    results = []
    for accum in (1, 2):
        model = _model()
        wrapped = vdist.apply_ddp(model) if strategy == "ddp" else vdist.apply_fsdp(model)
        ids, mask = _batch()
        n_global = _global_tokens()
        rows = _BATCH // world
        ids, mask = ids[rank * rows : (rank + 1) * rows], mask[rank * rows : (rank + 1) * rows]
        micro = torch.arange(rows).tensor_split(accum)
        unsynced = None
        for i, idx in enumerate(micro):
            with vdist.grad_sync(wrapped, enabled=i == len(micro) - 1):
                (_nll_sum(wrapped, ids[idx], mask[idx]) / n_global * world).backward()
            if i == 0 and accum > 1:
                unsynced = vdist.all_gather_object(_grad_fingerprint(wrapped))
        grads = vdist.full_grads(wrapped)
        measured = vdist.clip_grad_norm(wrapped, None)
        norm = vdist.clip_grad_norm(wrapped, max_norm)
        clipped = vdist.full_grads(wrapped)
        torch.optim.SGD(wrapped.parameters(), lr=_LR).step()
        results.append(
            {
                "accum": accum,
                "wrapper": type(wrapped).__name__,
                "fsdp_units": sum(isinstance(m, FSDPModule) for m in wrapped.modules()),
                "unsynced": unsynced,
                "grads": grads,
                "measured": measured,
                "norm": norm,
                "clipped": clipped,
                "state": vdist.full_state_dict(wrapped),
                # what a weight sync publishes: gathered one tensor at a time, in state order
                "tensors": [
                    (n, vdist.full_tensor(t).clone()) for n, t in vdist.model_state(wrapped).items()
                ],
                "rank0_only_keys": len(vdist.full_state_dict(wrapped, rank0_only=True)),
            }
        )
    return results


@pytest.fixture(scope="module")
def unclipped() -> dict[str, Any]:
    return _reference(None)


@pytest.fixture(scope="module")
def reference(unclipped: dict[str, Any]) -> dict[str, Any]:
    # Clip to half the norm so the clipping path really scales the gradients.
    ref = _reference(0.5 * float(unclipped["norm"]))
    ref["max_norm"] = 0.5 * float(unclipped["norm"])
    return ref


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=_ATOL, msg=name)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_matches_single_process_full_batch(
    strategy: str, world: int, reference: dict[str, Any], unclipped: dict[str, Any]
) -> None:
    out = vdist.run_on_ranks(
        _train_rank, world_size=world, args=(strategy, reference["max_norm"]), timeout_s=300
    )
    assert len(out) == world
    for rank, per_rank in enumerate(out):
        for res in per_rank:
            assert res["rank0_only_keys"] == (len(reference["state"]) if rank == 0 else 0)
            if strategy == "fsdp":
                assert res["wrapper"].startswith("FSDP")
                assert res["fsdp_units"] == _CONFIG["num_hidden_layers"] + 1
            else:
                assert res["wrapper"] == "DistributedDataParallel"
            if res["accum"] > 1:
                # Sync really was off after the first micro-batch: DDP ranks still hold their
                # own local grads; FSDP2 keeps them unsharded, its sharded grads still unset.
                fingerprints = res["unsynced"]
                if strategy == "fsdp":
                    assert fingerprints == [None] * world
                else:
                    assert None not in fingerprints
                    assert len(set(fingerprints)) == world
            _assert_same(res["grads"], unclipped["grads"])
            for key in ("measured", "norm"):
                assert type(res[key]) is torch.Tensor  # plain, not a DTensor
                torch.testing.assert_close(res[key], unclipped["norm"], rtol=0, atol=_ATOL)
            _assert_same(res["clipped"], reference["clipped"])
            _assert_same(res["state"], reference["state"])
            assert [name for name, _ in res["tensors"]] == list(reference["state"])
            _assert_same(dict(res["tensors"]), reference["state"])


class _ValueModel(nn.Module):
    """A critic-style wrapper: a Hugging Face trunk plus a scalar head."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaModel

        self.trunk = LlamaModel(LlamaConfig(**_CONFIG))
        self.head = nn.Linear(_CONFIG["hidden_size"], 1)


class _Gpt2Like(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.Module()
        self.transformer.h = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))
        self.head = nn.Linear(2, 2)


def test_find_decoder_layers() -> None:
    llama = _model()
    assert vdist.find_decoder_layers(llama) == list(llama.model.layers)
    critic = _ValueModel()
    assert vdist.find_decoder_layers(critic) == list(critic.trunk.layers)
    gpt2 = _Gpt2Like()
    assert vdist.find_decoder_layers(gpt2) == list(gpt2.transformer.h)
    assert vdist.find_decoder_layers(nn.Linear(2, 2)) == []


def test_first_names_pairs_the_entries_of_one_storage_object_empty_ones_too() -> None:
    """A tensor under a second name is the first name's, whether or not it holds elements
    (an FSDP2 rank's empty shard of a tied head: tests/workers/test_fsdp_empty_shards.py);
    two empty tensors are not one, though their storages' addresses are all 0, nor are two
    views of one storage that hold other elements. Mutations: an empty entry left its own
    name (the guard ``first_names`` had) -> ``head`` is its own; the storage's address as
    the key, unguarded -> ``bias`` is ``embed``."""
    empty, other, whole = torch.empty(0, 4), torch.empty(0, 4), torch.zeros(2, 4)
    assert empty.untyped_storage().data_ptr() == other.untyped_storage().data_ptr() == 0
    state = {
        "embed": empty,
        "head": empty.detach(),
        "bias": other,
        "norm": whole,
        "norm_again": whole.detach(),
        "row": whole[1:],
    }
    assert vdist.first_names(state) == {
        "embed": "embed",
        "head": "embed",
        "bias": "bias",
        "norm": "norm",
        "norm_again": "norm",
        "row": "row",
    }
    assert list(vdist.distinct_entries(state)) == ["embed", "bias", "norm", "row"]


def test_world_one_is_plain_training(reference: dict[str, Any]) -> None:
    model = _model()
    assert vdist.apply_ddp(model) is model
    assert vdist.apply_fsdp(model) is model
    ids, mask = _batch()
    for i, idx in enumerate(torch.arange(_BATCH).tensor_split(3)):
        with vdist.grad_sync(model, enabled=i == 2):
            (_nll_sum(model, ids[idx], mask[idx]) / _global_tokens()).backward()
    norm = vdist.clip_grad_norm(model, reference["max_norm"])
    _assert_same(vdist.full_grads(model), reference["clipped"])
    torch.optim.SGD(model.parameters(), lr=_LR).step()
    torch.testing.assert_close(norm, reference["norm"], rtol=0, atol=_ATOL)
    _assert_same(vdist.full_state_dict(model), reference["state"])


def test_non_finite_norm_is_returned_without_clipping() -> None:
    model = nn.Linear(3, 2)
    model.weight.grad = torch.full((2, 3), 2.0)
    model.bias.grad = torch.tensor([float("nan"), 1.0])
    norm = vdist.clip_grad_norm(model, 1.0)
    assert torch.isnan(norm)
    assert torch.equal(model.weight.grad, torch.full((2, 3), 2.0))


def test_measuring_only_leaves_grads_alone() -> None:
    model = nn.Linear(3, 2)
    model.weight.grad = torch.full((2, 3), 2.0)
    model.bias.grad = torch.zeros(2)
    for max_norm in (None, float("inf")):
        norm = vdist.clip_grad_norm(model, max_norm)
        torch.testing.assert_close(norm, torch.tensor(24.0).sqrt())
        assert torch.equal(model.weight.grad, torch.full((2, 3), 2.0))


def _train_kept_fp32_rank(rank: int, world: int, path: str) -> dict[str, Any]:
    """One AdamW step of the pure-bf16 policy at ``path`` (Hugging Face loads its router in
    float32) under DDP and under FSDP2, on this rank's half of a batch."""
    from verlite.config import ModelConfig
    from verlite.models import build_policy

    ids = torch.randint(0, 64, (4, 10), generator=torch.Generator().manual_seed(2))
    ids = ids[rank * 2 : (rank + 1) * 2]
    out: dict[str, Any] = {}
    for strategy in ("ddp", "fsdp"):
        model = build_policy(
            ModelConfig(path=path, precision="bf16"), vocab_size=64, max_positions=64, seed=0
        )
        wrapped = vdist.apply_ddp(model) if strategy == "ddp" else vdist.apply_fsdp(model)
        optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
        wrapped(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
        norm = vdist.clip_grad_norm(wrapped, 1.0)
        grads = vdist.full_grads(wrapped)
        optimizer.step()
        out[strategy] = {
            "norm": norm,
            "grads": grads,
            "state": vdist.full_state_dict(wrapped),
            "units": sum(isinstance(m, FSDPModule) for m in wrapped.modules()),
        }
    # A module whose own parameters are of two dtypes cannot be split into groups of one.
    mixed = _Gpt2Like()
    mixed.transformer.h[0].bias.data = mixed.transformer.h[0].bias.data.to(torch.float64)
    try:
        vdist.apply_fsdp(mixed)
    except ValueError as exc:
        out["refused"] = str(exc)
    return out


def test_fsdp_shards_a_pure_bf16_model_that_keeps_its_router_in_fp32(tmp_path) -> None:
    """GLM-4-MoE keeps its router's weight in float32 whatever the dtype Hugging Face loads
    it in (``_keep_in_fp32_modules_strict``); in a pure-bf16 policy its decoder block holds
    bf16 and float32 parameters, which one FSDP2 group refuses ("FSDP expects uniform original
    parameter dtype"). The router becomes a group of its own: FSDP2 trains the model as DDP
    does, the router in float32."""
    from tests.model_support import tiny_moe

    model = tiny_moe("glm4_moe", n_routed_experts=4, first_k_dense_replace=1, head_dim=8)
    with torch.no_grad():  # a router that routes: HF initializes its weight to zeros
        model.model.layers[1].mlp.gate.weight.normal_()
    model.save_pretrained(tmp_path)
    for rank in vdist.run_on_ranks(
        _train_kept_fp32_rank, world_size=2, args=(str(tmp_path),), timeout_s=300
    ):
        ddp, fsdp = rank["ddp"], rank["fsdp"]
        # two blocks and the root, and the MoE block's router
        assert fsdp["units"] == 4
        router = "model.layers.1.mlp.gate.weight"
        assert fsdp["state"][router].dtype == torch.float32
        assert not torch.equal(fsdp["state"][router], model.state_dict()[router])
        # Pure bf16 rounds each tensor's norm, a shard's under FSDP2, to bf16 (it is not
        # layout-invariant: docs/invariance-audit.md): the global norm agrees to its spacing.
        torch.testing.assert_close(fsdp["norm"], ddp["norm"], rtol=2**-7, atol=0)
        _assert_same(fsdp["grads"], ddp["grads"])
        _assert_same(fsdp["state"], ddp["state"])
        assert rank["refused"] == (
            "Linear holds parameters of its own in ['torch.float64'] beside torch.float32: "
            "FSDP2 shards a module's parameters in one dtype; use DDP (strategy=ddp)"
        )


def _host_shards_norm_rank(rank: int, world: int) -> dict[str, float]:
    """``clip_grad_norm`` of gradients held as FSDP2's CPU offload holds them (DTensor shards
    of a mesh of every rank, on the host), in the group ``run_on_ranks`` joined; and the
    norm of the whole gradients."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    mesh, sharded = init_device_mesh("cpu", (world,)), [Shard(0)]
    whole = [torch.randn(4, 3, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    model = nn.Module()
    for i, grad in enumerate(whole):
        shard = grad.chunk(world)[rank]
        param = nn.Parameter(DTensor.from_local(torch.zeros_like(shard), mesh, sharded))
        param.grad = DTensor.from_local(shard.clone(), mesh, sharded)
        model.register_parameter(f"p{i}", param)
    norm = vdist.clip_grad_norm(model, None)
    return {"norm": float(norm), "whole": float(torch.cat([g.flatten() for g in whole]).norm())}


def test_shards_held_on_the_host_reduce_their_norm_in_the_group_a_gpu_worker_joins() -> None:
    """With ``offload=all`` FSDP2 keeps the shards of the gradients on the host, and DTensor
    reduces their norm there (``clip_grad_norm``): a group of cuda ranks holds a CPU backend
    beside NCCL for it (``backend_for(..., host_shards=True)``). On this machine gloo stands
    in for NCCL: the group NCCL alone made (``cuda:gloo`` here) fails as a GPU would ("No
    backend type associated with device type cpu"); the one joined now gives the norm of the
    whole gradients."""
    cuda = torch.device("cuda")

    def stand_in(backend: str) -> str:  # NCCL reduces cuda tensors alone
        return "cuda:gloo" if backend == "nccl" else backend.replace("nccl", "gloo")

    joined = stand_in(vdist.backend_for(cuda, host_shards=True))
    for out in vdist.run_on_ranks(_host_shards_norm_rank, world_size=2, backend=joined):
        assert out["norm"] == pytest.approx(out["whole"], rel=1e-6)
    with pytest.raises(
        vdist.RankFailedError, match="No backend type associated with device type cpu"
    ):
        vdist.run_on_ranks(
            _host_shards_norm_rank, world_size=2, backend=stand_in(vdist.backend_for(cuda))
        )
