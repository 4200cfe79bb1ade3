"""Data parallelism applied from outside the model: DDP / FSDP2 wrapping, gradient-sync
control for accumulation, global grad-norm clipping, and full (unsharded) state and grads.
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.parallel import DistributedDataParallel

from verlite.core.sharding import fsdp_shards
from verlite.distributed.process_group import backend_for, get_world_size, is_initialized

# Attribute names Hugging Face models use for their stack of decoder blocks:
# `layers` (Llama, Qwen2, Mistral, Gemma: model.model.layers) and `h` (GPT-2, Falcon).
_LAYER_LIST_NAMES = ("layers", "h")


def _device_type(model: nn.Module) -> str:
    param = next(model.parameters(), None)
    return param.device.type if param is not None else "cpu"


def unwrap(model: nn.Module) -> nn.Module:
    """The module a DDP wrapper holds (``model`` itself otherwise: FSDP2 shards in place)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def inference_module(model: nn.Module) -> nn.Module:
    """The module to run forward-only passes on, with as few collectives as possible.

    DDP's forward broadcasts buffers from rank 0 (a collective per call), which would
    deadlock ranks that decode a different number of steps; its inner module holds the same
    weights on every rank, so inference bypasses the wrapper. FSDP2 parameters are shards:
    forward must go through the sharded module (and ranks must call it in lockstep).
    """
    return unwrap(model)


def sharded(model: nn.Module) -> bool:
    """Whether ``model``'s parameters are FSDP2 shards, each layer gathered for its passes
    (``apply_fsdp`` leaves a model of one rank whole unless it offloads)."""
    return isinstance(model, FSDPModule)


def find_decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder blocks of ``model``: children of every ``nn.ModuleList`` attribute named
    ``layers`` or ``h`` found anywhere below it (so a value-model wrapper holding a trunk
    works too), outermost lists only.
    """
    found: list[nn.Module] = []
    taken: list[str] = []
    for name, module in model.named_modules():
        attr = name.rsplit(".", 1)[-1]
        if not isinstance(module, nn.ModuleList) or attr not in _LAYER_LIST_NAMES:
            continue
        # A list nested inside an already-found block belongs to that block's shard unit.
        if any(name.startswith(prefix + ".") for prefix in taken):
            continue
        taken.append(name)
        found.extend(module)
    return found


def apply_ddp(model: nn.Module) -> nn.Module:
    """Wrap ``model`` in DDP over the default group; unchanged at world size 1.

    DDP broadcasts rank 0's parameters at construction, so ranks start identical.
    """
    if get_world_size() == 1:
        return model
    param = next(model.parameters())
    device_ids = [param.device.index] if param.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids)


def apply_fsdp(
    model: nn.Module, *, reshard_after_forward: bool = True, offload: bool = False
) -> nn.Module:
    """Shard ``model`` with FSDP2: each decoder block, then the root; unchanged at world 1.

    Unlike DDP, FSDP2 does not broadcast: every rank must hold the same weights beforehand
    (same seed, or the same checkpoint). The model is modified in place and returned.

    ``offload``: FSDP2's CPU offload, parameters, gradients and optimizer state on the CPU
    (each block's parameters are copied to the device for its forward and backward, the
    optimizer steps on the CPU). It shards at world 1 too, over a group of one rank made
    here when the worker has none.
    """
    world = get_world_size()
    if not fsdp_shards(world, offload=offload):
        return model
    device_type = _device_type(model)
    if not is_initialized():
        _join_single_rank_group(device_type)
    mesh = init_device_mesh(device_type, (world,))
    # Pinned host memory needs CUDA; on CPU the parameters already live on the host.
    policy = CPUOffloadPolicy(pin_memory=device_type == "cuda") if offload else OffloadPolicy()
    layers = find_decoder_layers(model)
    for i, layer in enumerate(layers):
        # The last block's parameters are needed again right at the start of backward, so
        # freeing them after forward would only cost an extra all-gather (torchtitan does this).
        keep = i == len(layers) - 1
        _shard_by_dtype(
            layer,
            mesh=mesh,
            reshard_after_forward=reshard_after_forward and not keep,
            offload_policy=policy,
        )
    _shard_by_dtype(
        model, mesh=mesh, reshard_after_forward=reshard_after_forward, offload_policy=policy
    )
    return model


def _shard_by_dtype(module: nn.Module, **shard: Any) -> None:
    """``fully_shard(module)`` in groups of one dtype, as FSDP2 shards each group's
    parameters as one flat buffer: where the parameters it would take hold several dtypes
    (a pure-bf16 model whose class keeps its MoE router in float32, Hugging Face's
    ``_keep_in_fp32_modules_strict``, loaded as it loads it), the smallest submodules that
    hold those of a dtype other than the most common one become groups of their own first."""
    sizes: Counter[torch.dtype] = Counter()
    for param in _unsharded_params(module):
        sizes[param.dtype] += param.numel()
    if len(sizes) > 1:
        _split_off(module, sizes.most_common(1)[0][0], shard)
    fully_shard(module, **shard)


def _split_off(module: nn.Module, main: torch.dtype, shard: dict[str, Any]) -> None:
    """A group of its own for each submodule of ``module`` whose parameters are all of one
    dtype other than ``main``, the smallest that hold them."""
    own = {param.dtype for param in module.parameters(recurse=False)} - {main}
    if own:
        raise ValueError(
            f"{type(module).__name__} holds parameters of its own in {sorted(map(str, own))} "
            f"beside {main}: FSDP2 shards a module's parameters in one dtype; use DDP "
            "(strategy=ddp)"
        )
    for child in module.children():
        if isinstance(child, FSDPModule):  # a group already: its parameters are held
            continue
        dtypes = {param.dtype for param in _unsharded_params(child)}
        if dtypes == {main} or not dtypes:
            continue
        if len(dtypes) == 1:
            fully_shard(child, **shard)
        else:
            _split_off(child, main, shard)


def _unsharded_params(module: nn.Module) -> list[nn.Parameter]:
    """The parameters ``fully_shard(module)`` would take: those no group inside it holds."""
    held = {
        id(param)
        for sub in module.modules()
        if sub is not module and isinstance(sub, FSDPModule)
        for param in sub.parameters()
    }
    return [param for param in module.parameters() if id(param) not in held]


def _join_single_rank_group(device_type: str) -> None:
    """A default process group of this process alone (an in-memory store: no port), which
    FSDP2's device mesh needs; the worker of a one-rank group has none."""
    torch.distributed.init_process_group(
        backend_for(torch.device(device_type)),
        store=torch.distributed.HashStore(),
        rank=0,
        world_size=1,
    )


def move_optimizer_state(
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    params: Sequence[torch.Tensor] | None = None,
) -> None:
    """Move the state that mirrors each parameter (AdamW's moments; not its step counter,
    which stays where the optimizer keeps it) to ``device``: exact copies, done when this
    returns; of ``params`` only when given (those without state yet have none to move). To
    the CPU they land in pageable memory: a pinned copy would be faster, but torch's
    pinned-memory cache rounds each allocation up to a power of two and keeps it (some 110 GB
    of host memory for a 7B model's 61 GB of AdamW state)."""
    to_host = device.type == "cpu"
    states = optimizer.state
    chosen = states.items() if params is None else [(p, states[p]) for p in params if p in states]
    for param, state in chosen:
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.shape == param.shape:
                state[key] = value.to(device, non_blocking=not to_host)
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        torch.cuda.synchronize()


@contextlib.contextmanager
def grad_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Run a backward with (``enabled``) or without gradient reduction across ranks.

    Accumulation micro-batches run with ``enabled=False``; the last one with ``True`` then
    reduces the accumulated sum once. A plain module needs nothing.
    """
    if enabled:
        yield
        return
    if isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
        return
    fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in fsdp_modules:
        m.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        # Always restore: a sync left off would silently train each rank on its own shard.
        for m in fsdp_modules:
            m.set_requires_gradient_sync(True, recurse=False)


def clip_grad_norm(model: nn.Module, max_norm: float | None) -> torch.Tensor:
    """Global L2 norm of all gradients (plain tensor); clip to ``max_norm`` when it is finite.

    ``max_norm`` None or inf only measures. A non-finite norm is returned unclipped: scaling
    by a NaN/inf coefficient would poison every gradient, and the caller skips the step.
    """
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return torch.zeros(())
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if isinstance(total, DTensor):
        # FSDP2 grads are shards: the local norm is a partial; full_tensor() reduces it.
        total = _whole(total)
    if max_norm is not None and math.isfinite(max_norm) and bool(torch.isfinite(total)):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total.detach()


def _cpu_snapshot(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    out = t.cpu()
    # On CPU, .cpu() aliases the live tensor; a snapshot must not change after a step.
    return out.clone() if out.data_ptr() == t.data_ptr() else out


def full_state_dict(model: nn.Module, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """Full, unsharded CPU copy of the model state, keyed as the unwrapped model's.

    Collective under FSDP2: every rank must call it. With ``rank0_only`` only rank 0 gets
    the tensors (others get ``{}``), which bounds host memory when exporting large models.
    """
    options = StateDictOptions(full_state_dict=True, cpu_offload=rank0_only)
    state = get_model_state_dict(model, options=options)
    # get_model_state_dict already keys a DDP model's state without the `module.` prefix.
    return {
        name: _cpu_snapshot(value)
        for name, value in state.items()
        if isinstance(value, torch.Tensor)
    }


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's live state keyed as the unwrapped model's: whole tensors of a DDP or
    plain model, FSDP2's sharded ones (DTensors, whose shapes are the full ones)."""
    return dict(unwrap(model).state_dict())


def distinct_entries(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` without the entries that hold an earlier entry's tensor again (a tied head
    is the embedding under a second name): the first name kept, in order
    (:func:`first_names`)."""
    first = first_names(state)
    return {name: value for name, value in state.items() if first[name] == name}


def first_names(state: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Each entry's name, and the first name under which ``state`` holds its tensor: its own
    but for an entry that holds an earlier one's tensor again (a tied head: the
    embedding's). Two entries are one tensor when they view the same elements of one storage
    object (a sharded tensor: its shard's). The names of a tied tensor are one parameter on
    every rank, so they share their shard's storage on every rank, an empty shard's too
    (FSDP2 shards dim 0: a tensor of fewer rows than ranks leaves some ranks none), and
    every rank pairs, and so gathers, alike. The storage object, not its address: every
    storage of no bytes is at address 0, and two empty tensors of two storages are not one."""
    # (storage, offset, shape, strides); torch types a storage offset int | SymInt, and
    # leaves StorageWeakRef (its own key for a storage) unannotated
    first: dict[
        tuple[StorageWeakRef, int | torch.SymInt, tuple[int, ...], tuple[int, ...]], str
    ] = {}
    names = {}
    for name, value in state.items():
        local = value.to_local() if isinstance(value, DTensor) else value
        where = (
            StorageWeakRef(local.untyped_storage()),  # type: ignore[no-untyped-call]
            local.storage_offset(),
            tuple(local.shape),
            local.stride(),
        )
        names[name] = first.setdefault(where, name)
    return names


def full_tensor(value: torch.Tensor) -> torch.Tensor:
    """A tensor of :func:`model_state` whole, without copying what is already whole (read
    it before the next update changes it).

    Collective for a sharded tensor: every rank must call it, in the same order.
    """
    if isinstance(value, DTensor):
        value = _whole(value)
    return value.detach()


def _whole(value: DTensor) -> torch.Tensor:
    """``value.full_tensor()``, gathered on its mesh's device: a shard that FSDP2's CPU
    offload keeps on the host is copied there first (NCCL gathers device tensors only)."""
    if value.device.type != value.device_mesh.device_type:
        # A DTensor's ``to`` is a DTensor; torch annotates Tensor.to as returning a Tensor.
        value = cast(DTensor, value.to(value.device_mesh.device_type))
    return value.full_tensor()


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full, unsharded CPU copy of every gradient, by parameter name of the unwrapped model.

    Collective under FSDP2 (each sharded grad is gathered): every rank must call it.
    """
    out: dict[str, torch.Tensor] = {}
    for name, param in unwrap(model).named_parameters():
        grad = param.grad
        if grad is None:
            continue
        if isinstance(grad, DTensor):
            grad = _whole(grad)
        out[name] = _cpu_snapshot(grad)
    return out
