"""The only package of verlite that touches torch.distributed: process groups, collectives,
DDP/FSDP2 wrapping, and a launcher for spawned ranks.
"""

from verlite.distributed.collectives import (
    all_gather_object,
    all_reduce_max,
    all_reduce_mean,
    all_reduce_sum,
    broadcast_object,
)
from verlite.distributed.launch import RankFailedError, RankTimeoutError, rank_gpus, run_on_ranks
from verlite.distributed.parallel import (
    apply_ddp,
    apply_fsdp,
    clip_grad_norm,
    find_decoder_layers,
    full_grads,
    full_state_dict,
    full_tensor,
    grad_sync,
    inference_module,
    model_state,
    move_optimizer_state,
    unwrap,
)
from verlite.distributed.process_group import (
    default_backend,
    destroy_process_group,
    find_free_port,
    get_rank,
    get_world_size,
    init_from_env,
    init_process_group,
    is_initialized,
)

__all__ = [
    "RankFailedError",
    "RankTimeoutError",
    "all_gather_object",
    "all_reduce_max",
    "all_reduce_mean",
    "all_reduce_sum",
    "apply_ddp",
    "apply_fsdp",
    "broadcast_object",
    "clip_grad_norm",
    "default_backend",
    "destroy_process_group",
    "find_decoder_layers",
    "find_free_port",
    "full_grads",
    "full_state_dict",
    "full_tensor",
    "get_rank",
    "get_world_size",
    "grad_sync",
    "inference_module",
    "init_from_env",
    "init_process_group",
    "is_initialized",
    "model_state",
    "move_optimizer_state",
    "rank_gpus",
    "run_on_ranks",
    "unwrap",
]
