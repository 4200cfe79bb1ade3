"""The ``verlite`` command line.

User errors (bad config, bad flags) print one line on stderr and exit 2, without a
traceback; a failed audit exits 1. Commands import what they need when they run: torch,
transformers and Ray load only for the commands that train, audit or submit, so help,
status, logs, list, stop and metrics answer at once.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict
from typing import NoReturn

from verlite.compare import add_compare_command
from verlite.errors import RunFailure, UserError
from verlite.export import add_export_command
from verlite.jobs import add_job_commands
from verlite.jobs.entrypoint import UTF8_OUTPUT_ENV, run_with_utf8_output
from verlite.measure_packing import cmd_measure_packing
from verlite.redaction import redact_text, redacted_output
from verlite.report import add_metrics_command
from verlite.table import format_table

EXIT_USER_ERROR = 2


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {text!r}")
    return value


def _path(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("expected a path, got an empty string")
    return text


def _str_list(text: str) -> list[str]:
    return [v for v in text.split(",") if v]


def _checked_choices(flag: str, values: Sequence[str] | None, allowed: Sequence[str]) -> list[str]:
    """The values of a comma-separated flag (all of ``allowed`` when it is not given), each
    one of ``allowed``: checked once the command runs, since the allowed values live with
    the audit, which loads torch."""
    if values is None:
        return list(allowed)
    bad = [v for v in values if v not in allowed]
    if bad or not values:
        raise UserError(
            f"{flag}: got {','.join(values)!r}; allowed: {','.join(allowed)} (comma-separated)"
        )
    return list(values)


class _OneLineParser(argparse.ArgumentParser):
    """Flag mistakes in one line, like every other user error (argparse prints its usage)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USER_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="verlite", description="Ray-distributed RL post-training for LMs.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = commands.add_parser(
        "train",
        help="train with RL on an embedded local Ray or an existing cluster",
        description="Run PPO/GRPO/RLOO/REINFORCE++ as configured. Metrics go to the console and "
        "<trainer.output_dir>/metrics.jsonl; workers.json records where every worker ran.",
    )
    train.add_argument("--config", required=True, help="run config YAML")
    train.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    train.add_argument(
        "--address", default=None, help="Ray cluster address (same as trainer.ray_address=...)"
    )
    train.set_defaults(handler=cmd_train)

    check = commands.add_parser(
        "check-invariance",
        help="audit a config: every DP/micro-batch layout must give the single-process update",
        description="Run one actor and one critic update of the configured model on a ragged batch under "
        "every layout (real spawned ranks, gloo) and compare gradients, updated parameters, reported loss "
        "and grad_norm with the single-process full-batch reference. With --run, train the configured "
        "job for a few steps under several worker/micro-batch layouts on Ray instead and compare every "
        "run's metrics with the first's. Exit 1 if any exceeds the tolerance.",
    )
    check.add_argument("--config", required=True, help="run config YAML")
    check.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    check.add_argument(
        "--dp", type=_int_list, default=None, help="data-parallel sizes (default 1,2,4)"
    )
    check.add_argument(
        "--micro",
        type=_str_list,
        default=None,
        help="micro-batching: 1 or 2 sequences, full (one micro-batch), dynamic (token budget), "
        "packed (2 sequences a packed row), packed-dynamic (the token budget, packed); "
        "comma-separated, default all",
    )
    check.add_argument("--strategy", type=_str_list, default=None, help="ddp,fsdp (default both)")
    check.add_argument(
        "--tolerance",
        type=_positive_float,
        default=None,
        help="max relative difference (default 1e-5 float32, 1e-9 float64; with --optimizer "
        "configured 1e-3 float32, 1e-9 float64)",
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
        type=_positive_int,
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
        help="whole runs: train the job under several layouts and compare their metrics.jsonl",
    )
    check.add_argument(
        "--layout",
        action="append",
        default=None,
        metavar="A[/C]",
        help="with --run, a layout to train, repeatable, the first being the reference: the actor's "
        "WORKERS:STRATEGY:MICRO, then optionally /WORKERS:STRATEGY:MICRO for the critic (MICRO: rows, "
        "full, dynamic, packed or packed-dynamic), e.g. 2:fsdp:1/2:ddp:dynamic (default: 4 layouts covering actor workers "
        "1/2/4, critic workers 1/2, micro 1/full/dynamic, ddp and fsdp)",
    )
    check.add_argument(
        "--runs-dir",
        type=_path,
        default=None,
        help="with --run, a new or empty folder that keeps the runs (default: a temporary one, removed)",
    )
    check.add_argument(
        "--atol",
        type=_positive_float,
        default=None,
        help="with --run, absolute difference still equal, for metrics that are zero in exact "
        "arithmetic (default 1e-15 float64, 1e-6 float32)",
    )
    check.set_defaults(handler=cmd_check_invariance)

    measure = commands.add_parser(
        "measure-packing",
        help="measure a packed row's cost on this machine: the model.attention_crossover to set",
        description="Time forward and backward passes of the configured policy over packed rows "
        "(sequences of 8 up to data.max_prompt_length + rollout.max_response_length tokens, up to "
        "the token budget a row) on the device the workers would use, fit seconds ~ a x tokens + "
        "b x sum of squared lengths + c, and print a / b: the model.attention_crossover that "
        "balances the DP shares of packing roles by this measurement instead of the FLOP count.",
    )
    measure.add_argument("--config", required=True, help="run config YAML")
    measure.add_argument(
        "overrides", nargs="*", metavar="key=value", help="dotted config overrides"
    )
    measure.add_argument(
        "--budget",
        type=_positive_int,
        default=None,
        help="most tokens of a packed row (default: actor.max_token_len_per_worker, or "
        "actor.micro_batch_size_per_worker x the longest sequence)",
    )
    measure.add_argument(
        "--trials", type=_positive_int, default=40, help="packed rows to time (default 40)"
    )
    measure.add_argument("--json", action="store_true", help="print one JSON object instead")
    measure.set_defaults(handler=cmd_measure_packing)

    add_metrics_command(commands)
    add_compare_command(commands)
    add_export_command(commands)
    add_job_commands(commands)
    return parser


def cmd_train(args: argparse.Namespace) -> int:
    from verlite.api import train

    overrides = list(args.overrides)
    if args.address:
        overrides.append(f"trainer.ray_address={args.address}")
    train(args.config, overrides)
    return 0


def cmd_check_invariance(args: argparse.Namespace) -> int:
    if args.run:
        from verlite.run_invariance import cmd_check_run_invariance

        return cmd_check_run_invariance(args)
    from verlite.config import load_config
    from verlite.invariance import (
        MICRO_LAYOUTS,
        STRATEGIES,
        check_invariance,
        check_layouts,
        tolerance_for,
    )

    for flag in ("layout", "runs_dir", "atol"):
        if getattr(args, flag) is not None:
            raise UserError(f"--{flag.replace('_', '-')} needs --run")
    micros = _checked_choices("--micro", args.micro, MICRO_LAYOUTS)
    strategies = _checked_choices("--strategy", args.strategy, STRATEGIES)
    dps = args.dp or [1, 2, 4]
    optimizer = args.optimizer or "sgd"
    check_layouts(dps)
    cfg = load_config(args.config, args.overrides)
    tolerance = args.tolerance if args.tolerance is not None else tolerance_for(cfg, optimizer)
    started = time.monotonic()
    if not args.json:
        print(
            f"checking {len(dps) * len(strategies)} rank launches ...",
            file=sys.stderr,
            flush=True,
        )
    steps = args.steps or (3 if optimizer == "configured" else 1)
    reports = check_invariance(
        cfg,
        dps=dps,
        micros=micros,
        strategies=strategies,
        naive=args.negative_control,
        optimizer=optimizer,
        steps=steps,
    )
    ok = all(r.worst() <= tolerance for r in reports)
    if args.json:
        layouts = [asdict(r) for r in reports]
        setting = {"optimizer": optimizer, "steps": steps}
        print(json.dumps({"ok": ok, "tolerance": tolerance, **setting, "layouts": layouts}))
    else:
        print(format_table(invariance_rows(reports, tolerance)))
        verdict = "ok" if ok else "FAILED"
        print(
            f"{verdict}: {len(reports)} layouts, tolerance {tolerance:g}, {time.monotonic() - started:.0f} s"
        )
    return 0 if ok else 1


def invariance_rows(reports: Sequence[object], tolerance: float) -> list[tuple[str, ...]]:
    """The one-update audit's table: a header, then a row per layout."""
    rows = [
        (
            "role",
            "loss_agg_mode",
            "strategy",
            "dp",
            "micro",
            "grad",
            "param",
            "loss",
            "grad_norm",
            "",
        )
    ]
    for r in reports:
        d = asdict(r)  # type: ignore[call-overload]
        diffs = [
            d["max_rel_grad_diff"],
            d["max_rel_param_diff"],
            d["loss_diff"],
            d["grad_norm_diff"],
        ]
        flag = "ok" if max(diffs) <= tolerance else "FAIL"
        rows.append(
            (
                d["role"],
                d["loss_agg_mode"],
                d["strategy"],
                str(d["dp"]),
                d["micro"],
                *(f"{x:.1e}" for x in diffs),
                flag,
            )
        )
    return rows


def _exit_on_sigterm(signum: int, frame: object) -> NoReturn:
    sys.exit(signum)


def _report(exc: Exception) -> None:
    print(f"verlite: error: {redact_text(str(exc))}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    if os.environ.get(UTF8_OUTPUT_ENV):  # a job's entrypoint: its log must be UTF-8 text
        args = sys.argv[1:] if argv is None else list(argv)
        return run_with_utf8_output([sys.executable, "-m", "verlite", *args])
    # Every line a command prints or logs, its own or its libraries', goes out masked.
    with redacted_output():
        try:
            return _main(argv)
        except Exception:
            # A bug: its traceback printed here, masked, not by the interpreter once the
            # streams are restored (the same exit status, 1).
            traceback.print_exc()
            return 1


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        code: int = args.handler(args)
    except UserError as exc:
        _report(exc)
        return EXIT_USER_ERROR
    except RunFailure as exc:
        # The cause is named in the message; a driver traceback would only bury it.
        _report(exc)
        return 1
    except KeyboardInterrupt:
        print("verlite: interrupted", file=sys.stderr)
        return 130
    except SystemExit as exc:
        # SIGTERM (`verlite stop`, a scheduler's preemption) raised SystemExit(15), here or
        # in Ray's handler, which does the same; the run's finally blocks closed its files.
        if exc.code != signal.SIGTERM:
            raise
        print(
            "verlite: terminated (SIGTERM); trainer.resume=auto continues from the last checkpoint",
            file=sys.stderr,
        )
        return 128 + signal.SIGTERM
    except BrokenPipeError:
        # The reader of stdout left (`verlite metrics ... | head`): stop quietly. Point stdout
        # at /dev/null so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    return code


if __name__ == "__main__":
    sys.exit(main())
