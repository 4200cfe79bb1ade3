"""The ``verlite`` command line: it assembles the commands of ``COMMAND_MODULES``, parses,
runs the chosen one and turns what it raises into the exit status.

Every command module has one function, ``add_commands(subparsers)``, which registers its
command (``jobs.commands``: five), each with ``set_defaults(handler=...)``: a function of the
parsed arguments that returns the exit status. User errors (bad config, bad flags) print
one line on stderr and exit 2, without a traceback; a failed audit exits 1. Commands import
what they need when they run: torch, transformers and Ray load only for the commands that
train, audit or submit, so help, status, logs, list, stop and metrics answer at once.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import traceback
from collections.abc import Sequence
from typing import NoReturn

from verlite import export, invariance_command, measure_packing, report, train_command
from verlite.errors import RunFailure, UserError
from verlite.jobs import commands as job_commands
from verlite.jobs.entrypoint import UTF8_OUTPUT_ENV, run_with_utf8_output
from verlite.records import compare
from verlite.redaction import redact_text, redacted_output

# In the order of ``verlite --help``.
COMMAND_MODULES = (
    train_command,
    invariance_command,
    measure_packing,
    report,
    compare,
    export,
    job_commands,
)

EXIT_USER_ERROR = 2


class _OneLineParser(argparse.ArgumentParser):
    """Flag mistakes in one line, like every other user error (argparse prints its usage)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USER_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="verlite", description="Ray-distributed RL post-training for LMs.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMAND_MODULES:
        module.add_commands(commands)
    return parser


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
