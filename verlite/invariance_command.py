"""``verlite check-invariance``: the command of the two audits, one update under every DP and
micro-batch layout (``verlite.audit.invariance``), or with ``--run`` whole runs under several
worker layouts (``verlite.audit.run_invariance``). Both load torch when the command runs."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from verlite.arguments import int_list, path, positive_float, positive_int, str_list
from verlite.audit.tolerances import (
    CONFIGURED_OPTIMIZER_TOLERANCE,
    RUN_ATOL,
    TOLERANCE,
    by_precision,
    calibration_rule,
    run_precision_note,
)
from verlite.errors import UserError, shown
from verlite.table import format_table

if TYPE_CHECKING:
    from verlite.audit.invariance import LayoutReport, Optimizer
    from verlite.audit.run_invariance import RunReport
    from verlite.config import Config


def add_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``verlite check-invariance`` on the CLI's subparsers."""
    check = subparsers.add_parser(
        "check-invariance",
        help="audit a config: every DP/micro-batch layout must give the single-process update",
        description="Run one actor and one critic update of the configured model on a ragged batch under "
        "every layout (real spawned ranks, gloo) and compare gradients, updated parameters, reported loss "
        "and grad_norm with the single-process full-batch reference. With --run, train the configured "
        "job for a few steps under several worker/micro-batch layouts on Ray instead and compare every "
        "run's metrics with the first's. Exit 1 if any exceeds the tolerance or gets no verdict.",
    )
    check.add_argument("--config", required=True, help="run config YAML")
    check.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    check.add_argument(
        "--dp", type=int_list, default=None, help="data-parallel sizes (default 1,2,4)"
    )
    check.add_argument(
        "--micro",
        type=str_list,
        default=None,
        help="micro-batching: 1 or 2 sequences, full (one micro-batch), dynamic (token budget), "
        "packed (2 sequences a packed row), packed-dynamic (the token budget, packed), "
        "checkpointed (2 sequences, activation checkpointing on); "
        "comma-separated, default all",
    )
    check.add_argument("--strategy", type=str_list, default=None, help="ddp,fsdp (default both)")
    check.add_argument(
        "--tolerance",
        type=positive_float,
        default=None,
        help=f"max relative difference (default by model.precision: {by_precision(TOLERANCE)}; "
        f"{calibration_rule()}; with --optimizer configured: "
        f"{by_precision(CONFIGURED_OPTIMIZER_TOLERANCE)}); given, it holds for every layout",
    )
    check.add_argument(
        "--json", action="store_true", help="print one JSON object instead of a table"
    )
    check.add_argument(
        "--optimizer",
        choices=["sgd", "configured"],
        default=None,
        help="sgd: one plain SGD step without clipping (default; exposes a wrong gradient scale "
        "most directly); configured: the config's optimizer and gradient clipping, as training runs",
    )
    check.add_argument(
        "--steps",
        type=positive_int,
        default=None,
        help="updates on the batch before comparing (default 1 with sgd, 3 with configured: "
        "AdamW's first step is about lr*sign(g) and hides a wrong gradient); with --run, training "
        "steps of each run (default 10)",
    )
    check.add_argument(
        "--negative-control",
        action="store_true",
        help="normalize each micro-batch by its own counts (what the invariance rules out): must "
        "fail; with --run, sample with one random stream per actor worker (rollout.randomness=per_rank)",
    )
    check.add_argument(
        "--run",
        action="store_true",
        help="whole runs: train the job under several layouts and compare their metrics.jsonl "
        "(in bf16 at the fixed tolerance, which rounding alone can exceed: it says so first)",
    )
    check.add_argument(
        "--layout",
        action="append",
        default=None,
        metavar="A[/C[/R]]",
        help="with --run, a layout to train, repeatable, the first being the reference: the actor's "
        "WORKERS:STRATEGY:MICRO, then optionally /WORKERS:STRATEGY:MICRO for the critic (MICRO: rows, "
        "full, dynamic, packed, packed-dynamic or checkpointed), e.g. 2:fsdp:1/2:ddp:dynamic, then with a reward "
        "model optionally /WORKERS:MICRO for its group (MICRO: rows or full, a step's rows; "
        "default: the config's), e.g. 2:fsdp:1/1:ddp:full/2:3 (default: 4 layouts covering actor workers "
        "1/2/4, critic workers 1/2, micro 1/full/dynamic, ddp and fsdp, and with a reward model "
        "reward workers 1/2, micro full/1/2/3)",
    )
    check.add_argument(
        "--runs-dir",
        type=path,
        default=None,
        help="with --run, a new or empty folder that keeps the runs (default: a temporary one, removed)",
    )
    check.add_argument(
        "--atol",
        type=positive_float,
        default=None,
        help="with --run, absolute difference still equal, for metrics that are zero in exact "
        f"arithmetic (default by model.precision: {by_precision(RUN_ATOL)})",
    )
    check.set_defaults(handler=cmd_check_invariance)


def _checked_choices(flag: str, values: Sequence[str] | None, allowed: Sequence[str]) -> list[str]:
    """The values of a comma-separated flag (all of ``allowed`` when it is not given), each
    one of ``allowed``: checked once the command runs, since the allowed values live with
    the audit, which loads torch."""
    if values is None:
        return list(allowed)
    bad = [v for v in values if v not in allowed]
    if bad or not values:
        raise UserError(
            f"{flag}: got {shown(','.join(values))}; allowed: {','.join(allowed)} (comma-separated)"
        )
    return list(values)


def _check_packed_layouts(cfg: Config, packed: list[str]) -> None:
    """The packed layouts asked for can run the model, as ``verlite train`` checks
    ``<role>.packing=true`` (``models.support.packing_unsupported``: no sliding window a sequence of
    the audit's batch, as long as ``max_sequence_length``, could pass, and packed sequences
    kept apart); refused before any rank starts, where the first packed pass would stop it
    or the ranks would compare attention across sequences."""
    if not packed:
        return
    from verlite.config.checks import longest_sequence_fields
    from verlite.models.support import packing_unsupported

    why = packing_unsupported(
        cfg.model, max_sequence_length=cfg.max_sequence_length, fields=longest_sequence_fields(cfg)
    )
    if why is not None:
        raise UserError(f"--micro {','.join(packed)}: {why}; leave the packed layouts out")


def _check_checkpointed_layout(cfg: Config, micros: list[str]) -> None:
    """The ``checkpointed`` layout (one of the default ``--micro``) can run the model: its
    classes (the actor's causal LM, the critic's trunk) support activation checkpointing;
    refused before any rank starts, where every rank's first build would stop it."""
    if "checkpointed" not in micros:
        return
    from verlite.audit.invariance import ROLES
    from verlite.models.support import checkpointing_unsupported

    for role in ROLES:
        unsupported = checkpointing_unsupported(cfg.model, role=role)
        if unsupported is not None:
            raise UserError(
                f"--micro checkpointed: {unsupported} (the {role}'s model) does not support "
                "activation checkpointing; leave checkpointed out of --micro"
            )


def cmd_check_invariance(args: argparse.Namespace) -> int:
    if args.run:
        return _check_run_invariance(args)
    from verlite.audit.invariance import (
        MICRO_LAYOUTS,
        NUM_SEQUENCES,
        ROLES,
        STRATEGIES,
        audit_rows,
        check_devices,
        check_invariance,
        check_layouts,
        offload_note,
        tolerance_for,
    )
    from verlite.config import check_inputs, load_config
    from verlite.models.support import check_attention_supported, check_training_features

    for flag in ("layout", "runs_dir", "atol"):
        if getattr(args, flag) is not None:
            raise UserError(f"--{flag.replace('_', '-')} needs --run")
    micros = _checked_choices("--micro", args.micro, MICRO_LAYOUTS)
    strategies = _checked_choices("--strategy", args.strategy, STRATEGIES)
    dps = args.dp or [1, 2, 4]
    optimizer: Optimizer = args.optimizer or "sgd"  # one of argparse's --optimizer choices
    check_layouts(dps)
    cfg = load_config(args.config, args.overrides)
    check_inputs(cfg)  # one line for an input that is not there, before any rank starts
    check_attention_supported(cfg.model)
    check_training_features(cfg)  # the config's packing and checkpointing, every layout's
    _check_packed_layouts(cfg, [m for m in micros if m.startswith("packed")])
    _check_checkpointed_layout(cfg, micros)
    check_devices(cfg, dps, ROLES)
    tolerance = args.tolerance if args.tolerance is not None else tolerance_for(cfg, optimizer)
    started = time.monotonic()
    rows = audit_rows(dps)
    launches = len(dps) * len(strategies)
    note = offload_note(cfg)
    if not args.json:
        why = (
            f" (the least multiple of {NUM_SEQUENCES} that every --dp size splits into equal "
            "shares)"
            if rows > NUM_SEQUENCES
            else ""
        )
        layout_count = len(dps) * len(strategies) * len(micros) * len(ROLES)
        print(
            f"checking {layout_count} layouts in {launches} rank "
            f"launch{'es' if launches > 1 else ''} on a "
            f"batch of {rows} sequences{why} ...",
            file=sys.stderr,
            flush=True,
        )
        if note is not None:
            print(note, file=sys.stderr, flush=True)
    steps = args.steps or (3 if optimizer == "configured" else 1)
    reports = check_invariance(
        cfg,
        dps=dps,
        micros=micros,
        strategies=strategies,
        naive=args.negative_control,
        optimizer=optimizer,
        steps=steps,
        tolerance=args.tolerance,
    )
    ok = all(r.verdict() == "ok" for r in reports)
    if args.json:
        layouts = [asdict(r) for r in reports]
        setting = {
            "precision": cfg.precision,
            "optimizer": optimizer,
            "steps": steps,
            "sequences": rows,
            "rank_launches": launches,
            "negative_control": args.negative_control,
            "offload_note": note,
        }
        print(json.dumps({"ok": ok, "tolerance": tolerance, **setting, "layouts": layouts}))
    else:
        print(format_table(invariance_rows(reports)))
        calibrated = calibration_lines(reports)
        for line in calibrated:
            print(line)
        held = "tolerance per case (above)" if calibrated else f"tolerance {tolerance:g}"
        verdict = "ok" if ok else "FAILED"
        print(f"{verdict}: {len(reports)} layouts, {held}, {time.monotonic() - started:.0f} s")
    return 0 if ok else 1


def calibration_lines(reports: Sequence[LayoutReport]) -> list[str]:
    """A line per calibrated case (bf16-mixed): its noise and the tolerance it was held to, or
    why it gets no verdict; none when the audit was not calibrated."""
    lines = []
    for r in {(r.role, r.loss_agg_mode): r for r in reports}.values():
        if r.noise is None:
            continue
        refusal = r.refusal()
        lines.append(
            refusal
            if refusal is not None
            else f"{r.role} {r.loss_agg_mode}: bf16 noise {r.noise:.1e} (its reference's "
            f"gradient against fp32), tolerance {r.tolerance:.1e}"
        )
    return lines


def invariance_rows(reports: Sequence[LayoutReport]) -> list[tuple[str, ...]]:
    """The one-update audit's table: a header, then a row per layout, with its tolerance where
    the audit calibrated it per case."""
    calibrated = any(r.noise is not None for r in reports)
    header = ("role", "loss_agg_mode", "strategy", "dp", "micro", "grad", "param", "loss")
    rows: list[tuple[str, ...]] = [
        (*header, "grad_norm", *(("tolerance",) if calibrated else ()), "")
    ]
    for r in reports:
        diffs = [r.max_rel_grad_diff, r.max_rel_param_diff, r.loss_diff, r.grad_norm_diff]
        rows.append(
            (
                r.role,
                r.loss_agg_mode,
                r.strategy,
                str(r.dp),
                r.micro,
                *(f"{x:.1e}" for x in diffs),
                *((f"{r.tolerance:.1e}",) if calibrated else ()),
                r.verdict(),
            )
        )
    return rows


def _check_run_invariance(args: argparse.Namespace) -> int:
    """``verlite check-invariance --run``: the table, or one JSON object; exit 1 on a difference."""
    from verlite.audit.run_invariance import check_run_invariance, parse_layout
    from verlite.config import check_inputs, load_config

    for flag in ("dp", "micro", "strategy", "optimizer"):
        if getattr(args, flag) is not None:
            raise UserError(f"--{flag} is for the one-update audit; with --run, give --layout")
    layouts = [parse_layout(text) for text in args.layout] if args.layout else None
    base = load_config(args.config, args.overrides)
    check_inputs(base)  # one line for an input that is not there, before Ray starts
    tolerance = TOLERANCE[base.precision] if args.tolerance is None else args.tolerance
    atol = RUN_ATOL[base.precision] if args.atol is None else args.atol
    steps = args.steps or 10

    def progress(line: str) -> None:
        if not args.json:
            print(line, file=sys.stderr, flush=True)

    note = run_precision_note(base.precision)
    if note is not None:
        progress(note)
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        if args.runs_dir is None:
            runs_dir = Path(
                stack.enter_context(tempfile.TemporaryDirectory(prefix="verlite-runs-"))
            )
        else:
            runs_dir = Path(args.runs_dir)
        reports = check_run_invariance(
            base,
            layouts,
            steps=steps,
            tolerance=tolerance,
            atol=atol,
            runs_dir=runs_dir,
            negative_control=args.negative_control,
            progress=progress,
        )
    ok = all(r.ok for r in reports)
    if args.json:
        setting = {"tolerance": tolerance, "atol": atol, "steps": steps}
        print(json.dumps({"ok": ok, **setting, "runs": [asdict(r) for r in reports]}))
        return 0 if ok else 1
    print(format_table(run_rows(reports)))
    verdict = "ok" if ok else "FAILED"
    print(
        f"{verdict}: {len(reports)} runs of {steps} steps, tolerance {tolerance:g} "
        f"(absolute {atol:g}), {time.monotonic() - started:.0f} s"
        + ("" if args.runs_dir is None else f"; runs kept in {args.runs_dir}")
    )
    return 0 if ok else 1


def run_rows(reports: Sequence[RunReport]) -> list[tuple[str, ...]]:
    """The whole-run audit's table: a header, the reference, then a row per other layout."""
    rows: list[tuple[str, ...]] = [
        ("layout", "steps", "equal steps", "worst", "seconds", "first difference")
    ]
    for index, r in enumerate(reports):
        if index == 0:
            rows.append((r.layout, str(r.steps), "reference", "", f"{r.seconds:.0f}", ""))
            continue
        rows.append(
            (
                r.layout,
                str(r.steps),
                str(r.identical_steps),
                f"{r.worst:.1e}",
                f"{r.seconds:.0f}",
                r.first_difference or "-",
            )
        )
    return rows
