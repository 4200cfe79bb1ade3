"""``verlite train``: a run of the config (with overrides, and a Ray address) through the
Python API's :func:`verlite.api.train`, which loads torch and Ray once the command runs.

Not ``verlite/train.py``: that submodule would shadow the API's ``verlite.train``."""

from __future__ import annotations

import argparse


def add_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``verlite train`` on the CLI's subparsers."""
    train = subparsers.add_parser(
        "train",
        help="train with RL on an embedded local Ray or an existing cluster",
        description="Run PPO/GRPO/Dr. GRPO/RLOO/REINFORCE++ as configured. Metrics go to the "
        "console and <trainer.output_dir>/metrics.jsonl; workers.json records where every worker "
        "ran; the trained policy goes to <trainer.output_dir>/hf_actor (Hugging Face "
        "format, unless trainer.export=false; see verlite export).",
    )
    train.add_argument("--config", required=True, help="run config YAML")
    train.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="dotted config overrides, e.g. trainer.total_steps=50 (every field: docs/config.md)",
    )
    train.add_argument(
        "--address", default=None, help="Ray cluster address (same as trainer.ray_address=...)"
    )
    train.set_defaults(handler=cmd_train)


def cmd_train(args: argparse.Namespace) -> int:
    from verlite.api import train

    overrides = list(args.overrides)
    if args.address:
        overrides.append(f"trainer.ray_address={args.address}")
    train(args.config, overrides)
    return 0
