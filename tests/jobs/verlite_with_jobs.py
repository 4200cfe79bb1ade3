"""``verlite`` with the job commands registered, for the tests: the real ``verlite.cli.main``
(its one-line errors and exit codes), whether or not cli.py wires ``add_job_commands`` yet."""

import argparse
import sys

import verlite.cli
from verlite.jobs import add_job_commands

build_parser = verlite.cli.build_parser


def build_parser_with_jobs() -> argparse.ArgumentParser:
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    if "submit" not in commands.choices:
        add_job_commands(commands)
    return parser


verlite.cli.build_parser = build_parser_with_jobs

if __name__ == "__main__":
    sys.exit(verlite.cli.main())
