"""The invariance audit behind ``verlite check-invariance``.

One actor update and one critic update run on the same reproducible ragged batch under
every requested layout — data-parallel size, micro-batching and strategy — on real spawned
ranks: gloo on CPU, NCCL with one GPU per rank when the model runs on cuda. Each is compared
with a single-process, full-batch reference: gradients, updated parameters, the reported
loss and grad_norm must agree within a tolerance.

The difference of two tensors is ``max|a - b| / max|b|`` (b: the reference), the maximum
over all parameters; loss and grad_norm differences are relative too.

By default the update is a plain SGD step whatever the configured optimizer: Adam's first
step is about ``lr * sign(g)``, which turns rounding noise in near-zero gradient entries into
whole steps, so comparing parameters after it would measure float noise, not the
normalization. With SGD the parameter update is linear in the gradient and checks the
(sharded) optimizer step itself. Gradient clipping is off for the same reason: it rescales
every layout to the same norm and would hide a wrong gradient scale (grad_norm is still
measured and compared).

``optimizer="configured"`` audits the update as users run it instead: the configured
optimizer (AdamW) and gradient clipping, over ``steps`` updates on the same batch, so that a
wrong gradient shows in the second and later steps' moments (float64 makes the rounding
noise negligible).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch
from tensordict import TensorDict
from torch import nn

from verlite.audit.tolerances import (
    CONFIGURED_OPTIMIZER_TOLERANCE,
    TOLERANCE,
    calibrated_tolerance,
    noise_refusal,
)
from verlite.config import Config, TrainedRole, WorkerRoleConfig
from verlite.core.losses import LOSS_AGG_MODES, GlobalCounts
from verlite.core.metrics import MetricDict, Stage, reduce_metrics, to_floats
from verlite.core.partition import dp_shares
from verlite.data import position_ids
from verlite.distributed import (
    all_gather_object,
    backend_for,
    full_grads,
    full_state_dict,
    get_rank,
    get_world_size,
    rank_gpus,
    run_on_ranks,
)
from verlite.errors import UserError
from verlite.models import build_policy, build_value_model, model_dtype, probe_config
from verlite.models.precision import autocast, check_precision_supported
from verlite.step_batch import row_costs, stamp_counts, take_rows
from verlite.workers.forward import response_log_probs
from verlite.workers.objectives import (
    ActorLossSettings,
    AggSettings,
    CriticLossSettings,
    ppo_loss,
    value_loss,
)
from verlite.workers.train_engine import TrainEngine

# The roles an audit checks: the policy and the value model (each by its own loss).
ROLES: tuple[TrainedRole, ...] = ("actor", "critic")
MICRO_LAYOUTS = ("1", "2", "full", "dynamic", "packed", "packed-dynamic", "checkpointed")
STRATEGIES = ("ddp", "fsdp")
Optimizer = Literal["sgd", "configured"]
LOSS_METRIC = {"actor": "actor/loss", "critic": "critic/vf_loss"}
# Small on purpose: 4 ranks share 2 CPU cores in tests; raggedness matters, size does not.
# The batch's token ids are drawn below it, or below the model's vocabulary when that is
# smaller (audit_vocab_size).
VOCAB_SIZE = 64
NUM_SEQUENCES = 16
# The most sequences of an audit batch (audit_rows): every --dp size up to 64 alone, and lists
# whose sizes share factors (1,2,4,8; 3,6,12; 5,10,20). Sizes without common factors multiply
# the batch (--dp 5,7: 560; --dp 5,7,11: 6160), and every layout's ranks work through all of it.
MAX_AUDIT_ROWS = 1024
# What one spawned rank holds (torch, transformers and the tiny model: ~350 MiB measured),
# with room to spare; a layout whose ranks would not fit the memory available is refused.
RANK_MEMORY_BYTES = 512 * 2**20


@dataclass(frozen=True)
class Case:
    role: TrainedRole
    loss_agg_mode: str
    micro: str


@dataclass(frozen=True)
class Outcome:
    grads: dict[str, torch.Tensor]
    params: dict[str, torch.Tensor]
    loss: float
    grad_norm: float


@dataclass(frozen=True)
class LayoutReport:
    dp: int
    micro: str
    strategy: str
    role: str
    loss_agg_mode: str
    max_rel_grad_diff: float
    max_rel_param_diff: float
    loss_diff: float
    grad_norm_diff: float
    tolerance: float  # what this layout is held to
    noise: float | None  # its case's bf16 rounding noise (bf16-mixed), None when not calibrated

    def worst(self) -> float:
        return max(
            self.max_rel_grad_diff, self.max_rel_param_diff, self.loss_diff, self.grad_norm_diff
        )

    def refusal(self) -> str | None:
        """Why this layout gets no verdict (its case's noise is too large), None when it does."""
        if self.noise is None:
            return None
        return noise_refusal(self.role, self.loss_agg_mode, self.noise)

    def verdict(self) -> str:
        """``ok``, ``FAIL`` (over its tolerance) or ``REFUSED`` (:meth:`refusal`)."""
        if self.refusal() is not None:
            return "REFUSED"
        return "ok" if self.worst() <= self.tolerance else "FAIL"


# ---------------------------------------------------------------------------- the batch


def make_batch(cfg: Config, *, seed: int = 0, num_sequences: int = NUM_SEQUENCES) -> TensorDict:
    """A reproducible ragged batch in verlite's layout (``verlite.step_batch``), ready for both losses.

    Prompt and response lengths vary per row; responses have observation holes (tokens the
    model attends to that are not the policy's, 0 in the loss mask, as in multi-turn rows)
    and one row's loss mask is all zero; old/reference log-probs sit near the model's own
    so that some tokens clip, and
    truncated importance weights in [0.5, 2] (0 on pads) weight the policy token losses.
    """
    gen = torch.Generator().manual_seed(seed)
    dtype = model_dtype(cfg.model)
    prompt_width, width = cfg.data.max_prompt_length, cfg.response_width  # all turns
    prompt_lens = torch.randint(1, prompt_width + 1, (num_sequences,), generator=gen)
    response_lens = torch.randint(1, width + 1, (num_sequences,), generator=gen)
    cols = torch.arange(prompt_width + width)
    prompt_part = (cols < prompt_width) & (cols >= prompt_width - prompt_lens[:, None])
    response_part = (cols >= prompt_width) & (cols < prompt_width + response_lens[:, None])
    attention_mask = (prompt_part | response_part).long()
    vocab = audit_vocab_size(cfg)
    low = min(1, vocab - 1)  # ids from 1, as pads are 0, unless 0 is the only one
    input_ids = torch.randint(low, vocab, attention_mask.shape, generator=gen) * attention_mask
    response_mask = attention_mask[:, prompt_width:].clone()
    # Multi-turn rows: every other row of 3 or more response tokens holds an observation
    # between the policy's tokens (attended to, but 0 in the loss mask), and one row's whole
    # response is observation (it counts for nothing).
    for row in range(0, num_sequences, 2):
        length = int(response_lens[row])
        if length >= 3:
            start = 1 + int(torch.randint(length - 2, (), generator=gen))
            end = start + 1 + int(torch.randint(length - 1 - start, (), generator=gen))
            response_mask[row, start:end] = 0
    response_mask[num_sequences // 3] = 0
    td = TensorDict(
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids(attention_mask),
            "responses": input_ids[:, prompt_width:],
            "response_mask": response_mask,
            "uid": torch.arange(num_sequences),
            "advantages": torch.randn(num_sequences, width, generator=gen, dtype=dtype),
            "values": 0.5 * torch.randn(num_sequences, width, generator=gen, dtype=dtype),
        },
        batch_size=[num_sequences],
    )
    td["returns"] = td["values"] + torch.randn(num_sequences, width, generator=gen, dtype=dtype)
    td.set_non_tensor("temperature", 1.0)
    policy = _build_model(cfg, "actor")
    with torch.no_grad(), autocast(cfg.precision, torch.device("cpu")):
        log_probs, _ = response_log_probs(policy, td, temperature=1.0, entropy="none")
    noise = torch.randn(2, num_sequences, width, generator=gen, dtype=dtype)
    td["old_log_probs"] = (log_probs + 0.3 * noise[0]) * response_mask
    td["ref_log_prob"] = (log_probs + 0.3 * noise[1]) * response_mask
    weights = 0.5 + 1.5 * torch.rand(num_sequences, width, generator=gen, dtype=dtype)
    td["rollout_is_weights"] = weights * response_mask
    return td


# ----------------------------------------------------------------------- one update


def audit_vocab_size(cfg: Config) -> int:
    """The tokens of the audit's batch, and the vocabulary it builds the built-in model
    with: :data:`VOCAB_SIZE`, or the model's own vocabulary when that is smaller (a
    ``model.path`` model's ``vocab_size``, ``model.vocab_size``), whose embedding a larger id
    would index past."""
    vocab = getattr(probe_config(cfg.model).get_text_config(), "vocab_size", None)
    return min(VOCAB_SIZE, vocab) if isinstance(vocab, int) and vocab > 0 else VOCAB_SIZE


def _build_model(cfg: Config, role: TrainedRole) -> nn.Module:
    max_positions = cfg.max_sequence_length
    seed = cfg.trainer.seed
    vocab = audit_vocab_size(cfg)
    if role == "critic":
        return build_value_model(
            cfg.model, vocab_size=vocab, max_positions=max_positions, seed=seed
        )
    # Dropout draws masks that depend on the micro-batch layout: the audit compares
    # without it (docs/design.md, "LoRA").
    lora = cfg.actor.lora.model_copy(update={"dropout": 0.0})
    model = build_policy(
        cfg.model, vocab_size=vocab, max_positions=max_positions, seed=seed, lora=lora
    )
    if lora.rank > 0:
        _perturb_adapters(model, seed)
    return model


@torch.no_grad()
def _perturb_adapters(model: nn.Module, seed: int) -> None:
    """Adapters start with ``B = 0``, where the gradient of every ``A`` is zero: the audit
    starts them from a random ``B`` (as after some training), so that both have one."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if ".lora_B." in name:
            noise = torch.randn(param.shape, generator=gen, dtype=param.dtype)
            param.copy_(0.1 * noise)


def audit_device(cfg: Config) -> torch.device:
    """Where the audit's ranks run: one GPU each (as cuda:0) only for ``model.device=cuda``;
    ``auto`` audits on CPU with gloo, whatever GPUs the machine has."""
    return torch.device("cuda", 0) if cfg.model.device == "cuda" else torch.device("cpu")


def micro_settings(micro: str, *, rows_per_worker: int, longest: int) -> dict[str, Any]:
    """A role's micro-batching fields for the micro layout ``micro``: a number of rows per
    micro-batch, ``full`` (the worker's whole mini-batch share, ``rows_per_worker``),
    ``dynamic`` (a token budget of two of the longest rows, so micro-batches differ in
    rows), ``packed`` / ``packed-dynamic``: 2 rows / that budget per micro-batch, run as
    packed rows (``packing``), or ``checkpointed``: 2 rows per micro-batch with activation
    checkpointing (``gradient_checkpointing``)."""
    if micro == "checkpointed":
        settings = micro_settings("2", rows_per_worker=rows_per_worker, longest=longest)
        return {**settings, "gradient_checkpointing": True}
    if micro.startswith("packed"):
        unpacked = "dynamic" if micro == "packed-dynamic" else "2"
        settings = micro_settings(unpacked, rows_per_worker=rows_per_worker, longest=longest)
        return {**settings, "packing": True}
    if micro == "dynamic":
        return {"use_dynamic_bsz": True, "max_token_len_per_worker": 2 * longest}
    rows = rows_per_worker if micro == "full" else int(micro)
    return {"use_dynamic_bsz": False, "micro_batch_size_per_worker": rows}


def _role_config(
    cfg: Config, case: Case, strategy: str, local_rows: int, optimizer: Optimizer
) -> WorkerRoleConfig:
    base: WorkerRoleConfig = getattr(cfg, case.role)
    if optimizer == "sgd":
        audit_optim = base.optim.model_copy(update={"name": "sgd", "grad_clip": None})
        base = base.model_copy(update={"optim": audit_optim})
    micro = micro_settings(case.micro, rows_per_worker=local_rows, longest=cfg.max_sequence_length)
    offload = layout_offload(base.offload, strategy)
    return base.model_copy(update={"strategy": strategy, "offload": offload, **micro})


def layout_offload(offload: str, strategy: str) -> str:
    """A role's ``offload`` in a layout of ``strategy``: ``all`` is FSDP2's CPU offload,
    which only the fsdp layouts can run; dropped to ``none`` in the others (the ddp layouts
    and the reference, strategy ``none``), as :func:`offload_note` says."""
    return "none" if offload == "all" and strategy != "fsdp" else offload


def offload_note(cfg: Config) -> str | None:
    """The line that says which layouts exercise the actor's and the critic's
    ``offload=all`` (:func:`layout_offload`); None when neither offloads all."""
    offloading = [f"{role}.offload=all" for role in ROLES if getattr(cfg, role).offload == "all"]
    if not offloading:
        return None
    return (
        f"{' and '.join(offloading)} (FSDP2's CPU offload) runs in the fsdp layouts only: the "
        "reference and the ddp layouts run without it"
    )


def _loss_fn(cfg: Config, case: Case, naive: bool) -> Any:
    scale = getattr(cfg, case.role).loss_scale_factor or float(cfg.rollout.max_response_length)
    agg = AggSettings(case.loss_agg_mode, scale)
    if case.role == "actor":
        actor = dataclasses.replace(ActorLossSettings.from_config(cfg.actor), agg=agg)
        fn = partial(ppo_loss, settings=actor)
    else:
        critic = dataclasses.replace(CriticLossSettings.from_config(cfg.critic), agg=agg)
        fn = partial(value_loss, settings=critic)
    return partial(_per_micro_batch_normalized, fn) if naive else fn


def _per_micro_batch_normalized(
    fn: Any, model: nn.Module, td: TensorDict
) -> tuple[torch.Tensor, MetricDict]:
    """The negative control: normalize each micro-batch by its own counts, as if alone."""
    stamp_counts(td, GlobalCounts.of(td["response_mask"]))
    result: tuple[torch.Tensor, MetricDict] = fn(model, td)
    return result


def run_case(
    cfg: Config,
    case: Case,
    batch: TensorDict,
    *,
    strategy: str,
    naive: bool = False,
    optimizer: Optimizer = "sgd",
    steps: int = 1,
) -> Outcome | None:
    """``steps`` updates of this rank's share of ``batch``; the full results after the last
    (its gradients, loss and grad_norm) on rank 0, None elsewhere.

    Must run on every rank of the group (gradients and parameters are gathered); without a
    process group it is the single-process reference.
    """
    world, rank = get_world_size(), get_rank()
    shares = dp_shares(row_costs(batch), world=world)
    local = take_rows(batch, shares[rank])
    role_cfg = _role_config(cfg, case, strategy, len(shares[rank]), optimizer)
    engine = TrainEngine(
        _build_model(cfg, case.role),
        cfg=role_cfg,
        total_updates=steps,
        metric_prefix=case.role,
        device=audit_device(cfg),
        precision=cfg.precision,
    )
    loss_fn = _loss_fn(cfg, case, naive)
    for _ in range(steps):
        metrics = engine.train_mini_batch(local, loss_fn)
    reduced = to_floats(reduce_metrics(all_gather_object(metrics), Stage.RANKS))
    grads, params = full_grads(engine.model), full_state_dict(engine.model)
    if rank != 0:
        return None
    return Outcome(
        grads, params, reduced[LOSS_METRIC[case.role]], reduced[f"{case.role}/grad_norm"]
    )


def _rank_job(
    rank: int,
    world: int,
    cfg: Config,
    batch: TensorDict,
    cases: Sequence[Case],
    strategy: str,
    naive: bool,
    optimizer: Optimizer,
    steps: int,
) -> list[Outcome | None]:
    return [
        run_case(cfg, case, batch, strategy=strategy, naive=naive, optimizer=optimizer, steps=steps)
        for case in cases
    ]


# ------------------------------------------------------------------------- the audit


def _rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = float(b.abs().max())
    diff = float((a.double() - b.double()).abs().max())
    return diff / scale if scale > 0 else diff


def _rel_scalar(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b != 0 else abs(a - b)


def compare(outcome: Outcome, reference: Outcome) -> dict[str, float]:
    if outcome.grads.keys() != reference.grads.keys():
        raise AssertionError("layouts produced gradients for different parameters")
    return {
        "max_rel_grad_diff": max(
            _rel_diff(outcome.grads[k], g) for k, g in reference.grads.items()
        ),
        "max_rel_param_diff": max(
            _rel_diff(outcome.params[k], p) for k, p in reference.params.items()
        ),
        "loss_diff": _rel_scalar(outcome.loss, reference.loss),
        "grad_norm_diff": _rel_scalar(outcome.grad_norm, reference.grad_norm),
    }


def audit_rows(dps: Sequence[int]) -> int:
    """The sequences of the audit batch for the data-parallel sizes ``dps``: the least multiple
    of ``NUM_SEQUENCES`` every size splits into equal shares. A size that is not a power of
    two scales the loss gradient by a factor whose rounding differs from one rank's (dp 3
    found float32 norms in an fp64 model), so every size is audited, not only 16's divisors."""
    return math.lcm(NUM_SEQUENCES, *dps)


def check_layouts(dps: Sequence[int]) -> None:
    """Refuse, before spawning anything, data-parallel sizes whose ranks would not fit this
    machine's available memory, or whose batch would hold more than :data:`MAX_AUDIT_ROWS`
    sequences."""
    available = _available_memory()
    need = max(dps) * RANK_MEMORY_BYTES
    if available is not None and need > available:
        raise UserError(
            f"--dp {max(dps)}: its ranks need about {need / 2**30:.1f} GiB "
            f"({RANK_MEMORY_BYTES // 2**20} MiB each); this machine has "
            f"{available / 2**30:.1f} GiB available"
        )
    rows = audit_rows(dps)
    if rows > MAX_AUDIT_ROWS:
        raise UserError(
            f"--dp {','.join(map(str, dps))}: the audit's batch would hold {rows} sequences "
            f"(the least multiple of {NUM_SEQUENCES} that every size splits into equal shares), "
            f"over the {MAX_AUDIT_ROWS} allowed; audit the sizes in separate runs"
        )


def _available_memory() -> int | None:
    """Bytes of memory available to new processes (Linux), None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_devices(cfg: Config, dps: Sequence[int], roles: Sequence[TrainedRole]) -> str:
    """The ranks' backend, once the devices they need are there: on a GPU each rank takes one
    visible GPU and the ranks talk over NCCL (and gloo for the shards FSDP2's CPU offload
    keeps on the host); bf16 there needs bf16 arithmetic. Each refused in one line
    (``UserError``, ``ConfigError``); ``verlite check-invariance`` calls it before it prints
    anything, so that the line is all a refused audit prints."""
    host_shards = any(getattr(cfg, role).offload == "all" for role in roles)
    device = audit_device(cfg)
    check_precision_supported(cfg, on_gpu=device.type == "cuda")
    backend = backend_for(device, host_shards=host_shards)
    try:
        rank_gpus(backend, max(dps))
    except ValueError as exc:
        raise UserError(f"--dp {max(dps)} with model.device=cuda: {exc}") from None
    return backend


def check_invariance(
    cfg: Config,
    *,
    dps: Sequence[int] = (1, 2, 4),
    micros: Sequence[str] = MICRO_LAYOUTS,
    strategies: Sequence[str] = STRATEGIES,
    roles: Sequence[TrainedRole] = ROLES,
    loss_agg_modes: Sequence[str] | None = None,
    naive: bool = False,
    optimizer: Optimizer = "sgd",
    steps: int = 1,
    tolerance: float | None = None,
    timeout_s: float = 900,
) -> list[LayoutReport]:
    """Run every layout and compare it with the single-process full-batch reference.

    ``loss_agg_modes`` defaults to each role's configured mode. ``naive`` swaps in
    per-micro-batch normalization, the negative control that shows the audit can fail.
    ``optimizer`` and ``steps``: see the module docstring. ``tolerance``: what every layout
    is held to; by default :func:`tolerance_for`, calibrated per case in bf16-mixed with the
    SGD step (:func:`reference_noise`, ``verlite.audit.tolerances``).
    """
    check_layouts(dps)
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    backend = check_devices(cfg, dps, roles)
    for mode in loss_agg_modes or ():
        if mode not in LOSS_AGG_MODES:
            raise ValueError(
                f"unknown loss_agg_mode {mode!r}; valid modes: {', '.join(LOSS_AGG_MODES)}"
            )
    batch = make_batch(cfg, seed=cfg.trainer.seed, num_sequences=audit_rows(dps))
    cases = [
        Case(role, mode, micro)
        for role in roles
        for mode in (loss_agg_modes or [getattr(cfg, role).loss_agg_mode])
        for micro in micros
    ]
    references = {}
    for case in dict.fromkeys(dataclasses.replace(c, micro="full") for c in cases):
        outcome = run_case(cfg, case, batch, strategy="none", optimizer=optimizer, steps=steps)
        assert outcome is not None
        references[(case.role, case.loss_agg_mode)] = outcome
    calibrate = tolerance is None and optimizer == "sgd" and cfg.precision == "bf16-mixed"
    noises = (
        {key: reference_noise(cfg, key, batch, outcome) for key, outcome in references.items()}
        if calibrate
        else {}
    )
    fixed = tolerance_for(cfg, optimizer) if tolerance is None else tolerance
    reports = []
    for dp in dps:
        for strategy in strategies:
            per_rank = run_on_ranks(
                _rank_job,
                world_size=dp,
                args=(cfg, batch, cases, strategy, naive, optimizer, steps),
                backend=backend,
                timeout_s=timeout_s,
            )
            for case, outcome in zip(cases, per_rank[0], strict=True):
                key = (case.role, case.loss_agg_mode)
                diffs = compare(outcome, references[key])
                noise = noises.get(key)
                reports.append(
                    LayoutReport(
                        dp,
                        case.micro,
                        strategy,
                        case.role,
                        case.loss_agg_mode,
                        **diffs,
                        tolerance=calibrated_tolerance(fixed, noise),
                        noise=noise,
                    )
                )
    return reports


def reference_noise(
    cfg: Config, key: tuple[TrainedRole, str], batch: TensorDict, reference: Outcome
) -> float:
    """The bf16 rounding noise of a case: how far its bf16-mixed single-process reference's
    gradient (``reference``) is from the same update in fp32, on the same batch from the same
    initial weights (bf16-mixed's master weights are fp32 already)."""
    model = cfg.model.model_copy(update={"precision": "fp32"})
    fp32 = run_case(
        cfg.model_copy(update={"model": model}), Case(*key, "full"), batch, strategy="none"
    )
    assert fp32 is not None
    return compare(reference, fp32)["max_rel_grad_diff"]


def tolerance_for(cfg: Config, optimizer: Optimizer = "sgd") -> float:
    table = TOLERANCE if optimizer == "sgd" else CONFIGURED_OPTIMIZER_TOLERANCE
    return table[cfg.precision]
