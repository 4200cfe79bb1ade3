"""TrainEngine: one worker's model, optimizer and LR schedule, driven one mini-batch at a time.

``train_mini_batch`` is where the normalization contract (docs/design.md) is carried out:

1. count the valid tokens and sequences of the DP-local mini-batch and all-reduce them
   once, before any split (``global_counts``), and stamp them on every micro-batch;
2. split into micro-batches — fixed size, or a token budget with the same number of
   micro-batches on every rank (FSDP pairs collectives across ranks);
3. run each micro-batch trimmed to its own longest prompt and response, backward without
   gradient sync, and sync only on the last (no ``1/grad_accum`` factor: ``agg_loss``
   already divides by the global counts);
4. clip with the global norm, step, and reduce metrics over micro-batches.

Metrics come back per rank; the caller reduces them over ranks (``Stage.RANKS``).
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch
from tensordict import TensorDict
from torch import nn

from verlite.checkpoint_files import ENGINE_STATE, SCHEDULE, TRAIN_STATE
from verlite.config import OptimConfig, WorkerRoleConfig
from verlite.core.losses import GlobalCounts, count_valid
from verlite.core.metrics import Metric, MetricDict, Stage, reduce_metrics
from verlite.core.partition import (
    MicroBatchPlan,
    PackedTokenPartition,
    TokenBudgetPartition,
    inverse_permutation,
    split_fixed,
)
from verlite.distributed import (
    all_reduce_max,
    all_reduce_sum,
    apply_ddp,
    apply_fsdp,
    clip_grad_norm,
    get_rank,
    get_world_size,
    grad_sync,
    inference_module,
    move_optimizer_state,
    sharded,
)
from verlite.distributed.sharded_state import load_train_state, save_train_state
from verlite.models import enable_gradient_checkpointing
from verlite.models.precision import autocast
from verlite.models.varlen import use_verlite_attention
from verlite.step_batch import (
    pad_responses,
    prompt_lengths,
    response_width,
    sequence_lengths,
    stamp_counts,
    take_rows,
    trim_padding,
)
from verlite.workers.forward import mark_packed, mark_padding
from verlite.workers.packing import pack_rows

Copyable = TypeVar("Copyable", torch.Tensor, TensorDict)
LossFn = Callable[[nn.Module, TensorDict], tuple[torch.Tensor, MetricDict]]
InferFn = Callable[[nn.Module, TensorDict], dict[str, torch.Tensor]]


def lr_multiplier(step: int, *, optim: OptimConfig, total_updates: int) -> float:
    """Linear warm-up to 1, then constant or cosine decay to ``min_lr_ratio`` at ``total_updates``."""
    if step < optim.warmup_steps:
        return (step + 1) / optim.warmup_steps
    if optim.schedule == "constant":
        return 1.0
    decay_steps = max(1, total_updates - optim.warmup_steps)
    progress = min(1.0, (step - optim.warmup_steps) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return optim.min_lr_ratio + (1.0 - optim.min_lr_ratio) * cosine


def optimizer_settings(optim: OptimConfig) -> dict[str, Any]:
    """The settings of an optimizer's parameter group that ``optim`` decides: those it is
    built with, and those a resume applies over the checkpoint's (``TrainEngine.load``)."""
    if optim.name == "sgd":
        return {"lr": optim.lr, "weight_decay": optim.weight_decay}
    return {"lr": optim.lr, "betas": optim.betas, "weight_decay": optim.weight_decay}


def build_optimizer(model: nn.Module, optim: OptimConfig) -> torch.optim.Optimizer:
    """The optimizer of ``model``'s trainable parameters (a LoRA policy's adapters only)."""
    params = [p for p in model.parameters() if p.requires_grad]
    kind = torch.optim.SGD if optim.name == "sgd" else torch.optim.AdamW
    return kind(params, **optimizer_settings(optim))


def trained_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters of ``optimizer`` that its next step updates: those with a gradient."""
    return [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]


@contextlib.contextmanager
def stepping_only(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> Iterator[None]:
    """``optimizer`` with ``param`` its only parameter for the block: a step then updates it
    alone (its group's settings apply); every group's parameters are restored after."""
    groups = [(group, group["params"]) for group in optimizer.param_groups]
    for group, params in groups:
        group["params"] = [p for p in params if p is param]
    try:
        yield
    finally:
        for group, params in groups:
            group["params"] = params


def global_counts(td: TensorDict, *, device: torch.device) -> GlobalCounts:
    """The counts of the global mini-batch this rank holds a share of: counted here, before
    any split, and summed over the ranks in one all-reduce."""
    counts = all_reduce_sum(count_valid(td["response_mask"]).to(device))
    tokens, sequences = counts.tolist()
    return GlobalCounts(
        dp_size=get_world_size(), batch_num_tokens=tokens, global_batch_size=sequences
    )


class TrainEngine:
    """Owns a (wrapped) model, its optimizer and LR schedule; no Ray, no config of the run."""

    def __init__(
        self,
        model: nn.Module,
        *,
        cfg: WorkerRoleConfig,
        total_updates: int,
        metric_prefix: str,
        device: torch.device | None = None,
        precision: str = "fp32",
    ) -> None:
        self.cfg = cfg
        self.device = device or torch.device("cpu")
        self.precision = precision  # the model's parameters are already in its dtype
        self.metric_prefix = metric_prefix
        world = get_world_size()
        if cfg.strategy == "none" and world > 1:
            raise ValueError(f"strategy 'none' cannot train on {world} ranks; use ddp or fsdp")
        if cfg.offload == "all" and cfg.strategy != "fsdp":
            raise ValueError(
                f"offload 'all' is FSDP2's CPU offload; strategy {cfg.strategy!r} has none"
            )
        model = model.to(self.device)
        use_verlite_attention(model, packing=cfg.packing)
        if cfg.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        if cfg.strategy == "fsdp":
            model = apply_fsdp(model, offload=cfg.offload == "all")
        elif cfg.strategy == "ddp":
            model = apply_ddp(model)
        self.model = model
        # Moves on whenever the model's weights change (an update, a checkpoint loaded), alike
        # on every rank: what a copy of them (an actor's generation copy) is kept current by.
        self.weights_version = 0
        optim = cfg.optim
        self.optimizer = build_optimizer(model, optim)
        self.nonfinite_streak = 0
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda step: lr_multiplier(step, optim=optim, total_updates=total_updates),
        )

    # ----------------------------------------------------------------------- training

    def train_mini_batch(self, td: TensorDict, loss_fn: LossFn) -> MetricDict:
        """One optimizer step over this rank's share of a mini-batch; returns rank-local metrics.

        The update is skipped (and counted in ``<role>/skipped_updates``) when no token of the
        global mini-batch carries loss, or when the global gradient norm is not finite; every
        rank decides alike, since both figures are global. ``<role>/nonfinite_streak`` counts
        consecutive non-finite updates so the trainer can stop a run that diverged.
        """
        prefix = self.metric_prefix
        lr = self.scheduler.get_last_lr()[0]
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        counts = global_counts(td, device=self.device)
        if counts.batch_num_tokens == 0:
            # An all-masked mini-batch has no gradient; Adam would still move the weights.
            return {f"{prefix}/skipped_updates": Metric.count(1.0), f"{prefix}/lr": Metric.mean(lr)}
        parts = self.plan(td, training=True).parts
        micro_metrics = []
        for i, part in enumerate(parts):
            micro = micro_batch(td, part, device=self.device, packing=self.cfg.packing)
            stamp_counts(micro, counts)
            with grad_sync(self.model, enabled=i == len(parts) - 1):
                with autocast(self.precision, self.device):
                    loss, metrics = loss_fn(self.model, micro)
                loss.backward()
            micro_metrics.append(metrics)
        grad_norm = clip_grad_norm(self.model, self.cfg.optim.grad_clip)
        finite = bool(torch.isfinite(grad_norm))
        if finite:  # a skipped update consumes no step of the LR schedule either
            self._optimizer_step()
            self.scheduler.step()
            self.weights_version += 1
        self.nonfinite_streak = 0 if finite else self.nonfinite_streak + 1
        out = reduce_metrics(micro_metrics, Stage.MICRO_BATCHES)
        out[f"{prefix}/grad_norm"] = Metric.mean(grad_norm)
        out[f"{prefix}/lr"] = Metric.mean(lr)
        out[f"{prefix}/skipped_updates"] = Metric.count(0.0 if finite else 1.0)
        out[f"{prefix}/nonfinite_streak"] = Metric.max(self.nonfinite_streak)
        return {k: m.to_float() for k, m in out.items()}

    def _optimizer_step(self) -> None:
        """The optimizer's step. With ``offload=optimizer`` it steps one parameter at a time:
        each one's state comes to the model's device for its own step and goes back to the
        CPU after (AdamW creates it on the device at the first step), so besides the weights
        and gradients the device holds one parameter's state at most. Moved at once, a 7B
        policy's AdamW moments (61 GB) came on top of its fp32 weights and gradients (61 GB):
        the step needed the memory offloading saves. AdamW's and SGD's updates are
        elementwise: stepped apart, each parameter gets the joint step's update bit for bit."""
        if self.cfg.offload != "optimizer":
            self.optimizer.step()
            return
        cpu = torch.device("cpu")
        for param in trained_params(self.optimizer):
            with stepping_only(self.optimizer, param):
                move_optimizer_state(self.optimizer, self.device, [param])
                self.optimizer.step()
                move_optimizer_state(self.optimizer, cpu, [param])

    def train_step(self, td: TensorDict, loss_fn: LossFn) -> MetricDict:
        """All updates of one training step: ``ppo_epochs`` passes over the mini-batches.

        ``td`` is this rank's share cut into global mini-batches, ``(mini_batches, rows)``
        as ``DpSplit(mini_batches=k)`` dispatches it (``step_batch.cut_mini_batches``):
        ``td[j]`` is this rank's piece of global mini-batch j, so the updates are the same
        for any number of workers.
        """
        if td.batch_dims != 2:
            raise ValueError(
                f"train_step takes a share cut into mini-batches, (mini_batches, rows); got a "
                f"batch of size {tuple(td.batch_size)}"
            )
        metrics = [
            self.train_mini_batch(td[j], loss_fn)
            for _ in range(self.cfg.ppo_epochs)
            for j in range(td.batch_size[0])
        ]
        # The last update's gradients, which nothing reads again (the next update starts by
        # dropping them): kept, they held as much memory as the trained weights through the
        # next step's generation and log-prob or value passes (30 GB for a 7B policy).
        self.optimizer.zero_grad(set_to_none=True)
        return reduce_metrics(metrics, Stage.MINI_BATCHES)

    def plan(self, td: TensorDict, *, training: bool) -> MicroBatchPlan:
        """The micro-batches of ``td`` on this rank (collective: every rank agrees on the count)."""
        return plan_micro_batches(td, cfg=self.cfg, device=self.device, training=training)

    def infer(self, td: TensorDict, fn: InferFn, plan: MicroBatchPlan | None = None) -> TensorDict:
        """Forward-only ``fn`` over ``td`` with the policy being trained; ``plan`` reuses the
        micro-batches another pass over the same rows already agreed on."""
        plan = plan or self.plan(td, training=False)
        with autocast(self.precision, self.device, cache=not sharded(self.model)):
            return infer(
                inference_module(self.model),
                td,
                fn,
                plan=plan,
                device=self.device,
                packing=self.cfg.packing,
            )

    # -------------------------------------------------------------------- checkpoints

    def save(self, path: Path) -> None:
        """Collective: trainable parameters + optimizer (DCP, sharded per rank), LR schedule
        position, the streak of skipped updates. Frozen parameters (a LoRA policy's base)
        are rebuilt from the config, not saved; so is the optimizer state of a parameter
        that has none yet (never had a gradient; every parameter before the first update,
        the actor's during the critic's warm-up). Saving changes nothing the run trains on
        and creates no state to save."""
        # The last update's gradients, which nothing reads again (each update starts by
        # dropping them).
        self.optimizer.zero_grad(set_to_none=True)
        save_train_state(self.model, self.optimizer, path / TRAIN_STATE)
        if get_rank() == 0:
            # LambdaLR's state is plain numbers (the lambda itself is rebuilt from the config).
            (path / SCHEDULE).write_text(json.dumps(self.scheduler.state_dict()))
            # Every rank counts alike (the norm is global).
            (path / ENGINE_STATE).write_text(
                json.dumps({"nonfinite_streak": self.nonfinite_streak})
            )

    def load(self, path: Path) -> None:
        """Collective: restore what :meth:`save` wrote (any number of ranks may have saved it)."""
        if not (path / SCHEDULE).is_file():
            raise FileNotFoundError(f"{path} holds no engine checkpoint ({SCHEDULE} is missing)")
        # read into in place, where it is kept; a parameter without state saved gets none
        load_train_state(
            self.model, self.optimizer, path / TRAIN_STATE, create_state=self._create_state
        )
        self.weights_version += 1
        self.scheduler.load_state_dict(json.loads((path / SCHEDULE).read_text()))
        self._apply_settings()
        if self.scheduler.last_epoch == 0:
            # Checkpoints written before the first update by earlier versions hold the
            # placeholder state a zero-gradient step at lr 0 created to save: kept, it made
            # AdamW's first real update its second (another bias correction).
            self.optimizer.state.clear()
        # Checkpoints from before it was saved hold none: their streak restarts at 0.
        if (path / ENGINE_STATE).is_file():
            state = json.loads((path / ENGINE_STATE).read_text())
            self.nonfinite_streak = int(state["nonfinite_streak"])

    def _create_state(self) -> None:
        """Give a fresh optimizer, about to load a checkpoint that holds optimizer state, the
        state its first step creates, where the engine keeps it: DCP loads into state the
        optimizer holds. Left to DCP's ``get_state_dict`` and ``set_state_dict``, it was one
        step of the whole model with zero gradients, every gradient and every AdamW moment
        on the device at once (for a 7B policy, 91 GB beside its 30 GB of fp32 weights:
        what ``offload=optimizer`` exists to avoid). Here each parameter gets a zero
        gradient for its own step (:meth:`_optimizer_step`, which with
        ``offload=optimizer`` sends the state it creates to the CPU), dropped after it. The
        learning rate is 0 for these steps: the weights do not change, and the state's
        values are placeholders the load overwrites (or drops, for a parameter the
        checkpoint holds no state for). An optimizer that keeps no state (SGD without
        momentum) is left after its first parameter."""
        if self.optimizer.state:
            return
        groups = self.optimizer.param_groups
        rates = [group["lr"] for group in groups]
        for group in groups:
            group["lr"] = 0.0
        try:
            for param in [p for group in groups for p in group["params"]]:
                param.grad = torch.zeros_like(param)
                try:
                    self._optimizer_step()
                finally:
                    param.grad = None
                if not self.optimizer.state:
                    break
        finally:
            for group, rate in zip(groups, rates, strict=True):
                group["lr"] = rate

    def _apply_settings(self) -> None:
        """This run's optimizer settings over the loaded ones: the optimizer's and the
        schedule's state hold the peak learning rate, weight decay and betas the checkpoint
        was trained with, and a resume that changes them (lowering the learning rate of a
        run that diverged, say; ``check_resumable`` reports it) trains with its own from the
        schedule's position on. Unchanged, each value is the one loaded, bit for bit: the
        learning rate is computed as the schedule's step computes it."""
        settings = optimizer_settings(self.cfg.optim)
        groups = self.optimizer.param_groups
        for group in groups:
            group.update(settings, initial_lr=settings["lr"])
        scheduler = self.scheduler
        scheduler.base_lrs = [group["initial_lr"] for group in groups]
        for group, base, multiplier in zip(
            groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True
        ):
            group["lr"] = base * multiplier(scheduler.last_epoch)
        scheduler._last_lr = [group["lr"] for group in groups]  # what get_last_lr() reads


def micro_batch(
    td: TensorDict, rows: list[int], *, device: torch.device, packing: bool
) -> TensorDict:
    """The micro-batch of ``rows`` of ``td`` (on the CPU): trimmed to its own longest prompt
    and response, on ``device``, and with its packed row when ``packing``, else marked with
    whether a row is padded (``forward.mark_padding``: the attention mask is built knowing
    it). The trimming widths, the packed row and the padding are computed from the CPU copy,
    then copied (:func:`to_device`): computed on a GPU, each would wait for it to finish the
    micro-batches queued before."""
    micro = trim_padding(take_rows(td, rows))
    packed = pack_rows(micro) if packing else None
    padded = packed is None and not bool(micro["attention_mask"].all())
    micro = to_device(micro, device)
    if packed is not None:
        mark_packed(micro, packed.apply(partial(to_device, device=device)))
    else:
        mark_padding(micro, padded)
    return micro


def to_device(value: Copyable, device: torch.device) -> Copyable:
    """``value`` (a tensor or a TensorDict on the CPU) on ``device``; to a CUDA device it is
    copied from pinned memory without waiting: the copy is queued on the current stream, so
    the work queued after it reads it, and the host goes on to the next micro-batch. Each
    tensor is made dense first (a trimmed micro-batch's columns are views): pinning keeps a
    view's strides, and CUDA copies a strided host tensor through a contiguous temporary in
    pageable memory, a copy that waits for the device to finish its queue."""
    if device.type == "cuda":
        return value.contiguous().pin_memory().to(device, non_blocking=True)
    return value.to(device)


@torch.no_grad()
def infer(
    model: nn.Module,
    td: TensorDict,
    fn: InferFn,
    *,
    plan: MicroBatchPlan,
    device: torch.device,
    packing: bool,
) -> TensorDict:
    """Forward-only in the micro-batches of ``plan``; response-aligned outputs come back
    (B, R) in row order. The outputs of repeated micro-batches are dropped: they only keep
    this rank's FSDP collectives in step with the other ranks'."""
    model.eval()
    width = response_width(td)
    outputs: dict[str, list[torch.Tensor]] = {}
    for i, part in enumerate(plan.parts):
        micro = micro_batch(td, part, device=device, packing=packing)
        result = fn(model, micro)
        if i >= len(plan.real_parts):
            continue
        for key, value in result.items():
            padded = pad_responses(value, micro, width) if value.dim() == 2 else value
            outputs.setdefault(key, []).append(padded)
    order = inverse_permutation(plan.real_parts)
    restore = None if order == sorted(order) else to_device(torch.tensor(order), device)
    merged = {}
    for key, chunks in outputs.items():
        value = torch.cat(chunks)
        merged[key] = value if restore is None else value[restore]
    return TensorDict(merged, batch_size=td.batch_size)


def plan_micro_batches(
    td: TensorDict, *, cfg: WorkerRoleConfig, device: torch.device, training: bool
) -> MicroBatchPlan:
    """This rank's micro-batches of ``td``, as many as the rank that needs the most: a fixed
    number of rows each, or a token budget (``core.partition``). One all-reduce."""
    n = td.batch_size[0]
    if cfg.use_dynamic_bsz:
        assert cfg.max_token_len_per_worker is not None, "validated by the config"
        partition: TokenBudgetPartition | PackedTokenPartition
        if cfg.packing:  # a packed row has no padding: the budget counts real tokens
            partition = PackedTokenPartition(
                sequence_lengths(td), max_tokens=cfg.max_token_len_per_worker
            )
        else:
            partition = TokenBudgetPartition(
                sequence_lengths(td),
                max_tokens=cfg.max_token_len_per_worker,
                prompt_lens=prompt_lengths(td),
            )
        agreed = _max_over_ranks(partition.count, device)
        # More parts only make more of the same cuts: a rank gets exactly the agreed count
        # unless it has fewer rows than that.
        parts = partition.parts(min(agreed, n))
    else:
        parts = split_fixed(n, micro_batch_size=cfg.micro_batch_size_per_worker)
        agreed = _max_over_ranks(len(parts), device)
    return MicroBatchPlan.agreed(parts, agreed, training=training)


def _max_over_ranks(value: int, device: torch.device) -> int:
    return int(all_reduce_max(torch.tensor(value, device=device)))
