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
import difflib
import os
import shlex
import signal
import sys
import traceback
from collections.abc import Sequence
from typing import Any, NoReturn

from verlite import export, invariance_command, measure_packing, report, train_command
from verlite.errors import RunFailure, UserError, shown
from verlite.jobs import commands as job_commands
from verlite.jobs.entrypoint import UTF8_OUTPUT_ENV, run_with_utf8_output
from verlite.package_versions import installed_version
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
_OVERRIDE_FORM = "a config override is one word, dotted.key=value"
HF_PROGRESS_BARS_ENV = "HF_HUB_DISABLE_PROGRESS_BARS"


class _OneLineParser(argparse.ArgumentParser):
    """Flag mistakes in one line, like every other user error (argparse prints its usage),
    by the command they were given to; a command's misspelled flag is named before the flags
    it leaves missing (argparse would only say that ``--config`` is required after
    ``--confg``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Set before argparse's __init__, which adds -h through add_argument.
        self.arguments: list[argparse.Action] = []  # what add_argument made, in its order
        super().__init__(*args, **kwargs)
        self.given: list[str] = []  # what the last parse was given
        self.parsed = argparse.Namespace()  # what it took from them, as far as it came
        self.commands: dict[str, _OneLineParser] = {}  # verlite's: each command's parser

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        """argparse's, the action it returns kept (:attr:`arguments`): the flags and values
        the messages below name, read without argparse's private tables of them. The
        commands add their arguments to their parser itself (no argument groups)."""
        action = super().add_argument(*args, **kwargs)
        self.arguments.append(action)
        return action

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        self.given = list(sys.argv[1:] if args is None else args)
        self.parsed = argparse.Namespace() if namespace is None else namespace
        return super().parse_known_args(args, self.parsed)

    def error(self, message: str) -> NoReturn:
        if self.commands and self.unknown_flags(self.given[:1]):
            # verlite's own: a command's flag given before the command (its value may be
            # taken for the command, or the command found missing)
            message = self.before_a_command(self.given[0])
        elif self.commands and message.startswith("argument COMMAND: invalid choice"):
            close = difflib.get_close_matches(self.given[0], list(self.commands), n=1)
            message += f"; did you mean {close[0]}?" if close else ""
        elif message.startswith("the following arguments are required"):
            unknown = self.unknown_flags(self.given)
            if unknown:
                message = self.unrecognized(unknown)
            elif "--config" in message:
                message += self.config_without_its_flag()
        self.exit(EXIT_USER_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def config_without_its_flag(self) -> str:
        """What to write when ``--config`` is missing but a YAML file was given without it
        (``verlite train configs/ppo_tiny.yaml``, read as an override): the flag before it.
        Only a word argparse took as an override, never another flag's value
        (``verlite submit --runtime-env env.yaml``)."""
        words = getattr(self.parsed, "overrides", [])
        files = [arg for arg in words if arg.endswith((".yaml", ".yml")) and "=" not in arg]
        return f"; give the config file with the flag: --config {files[0]}" if files else ""

    @property
    def known_flags(self) -> list[str]:
        return [flag for action in self.arguments for flag in action.option_strings]

    def unknown_flags(self, given: list[str]) -> list[str]:
        """The flags in ``given`` before any ``--`` that this command does not know (a known
        flag's prefix is one, as argparse reads it). Values are not told from flags: enough
        for a message."""
        known = self.known_flags
        flags = given[: given.index("--")] if "--" in given else given
        return [
            arg
            for arg in flags
            if arg.startswith("--")
            and not any(flag.startswith(arg.split("=", 1)[0]) for flag in known)
        ]

    def before_a_command(self, flag: str) -> str:
        """The message for a command's ``flag`` given to verlite before its command: the
        commands that know it, and the line with the command (the one given later, else the
        first that knows the flag) moved to the front."""
        name = flag.split("=", 1)[0]
        owners = [c for c, parser in self.commands.items() if name in parser.known_flags]
        named = [f"{self.prog} {c}" for c in owners]
        given = next((arg for arg in self.given if arg in self.commands), None)
        if given is not None and given not in owners:
            where = f" (a flag of {', '.join(named)})" if owners else ""
            return f"{name} is not a flag of {self.prog} {given}{where}"
        if not owners:
            flags = {f for parser in (self, *self.commands.values()) for f in parser.known_flags}
            close = difflib.get_close_matches(name, sorted(flags), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            return (
                f"unrecognized arguments: {flag}{hint}; a command comes first: "
                f"{self.prog} COMMAND ..."
            )
        rest = list(self.given)
        if given is not None:
            rest.remove(given)
        line = " ".join(shlex.quote(arg) for arg in [self.prog, given or owners[0], *rest])
        return (
            f"{name} is a flag of {', '.join(named)}, given before the command; a command "
            f"comes first, as in: {line}"
        )

    def unrecognized(self, flags: Sequence[str]) -> str:
        """The message for ``flags``, with the closest known flag of each; a dotted key
        written as a flag (``--trainer.total_steps=5``, as other trainers' command lines take
        it) is shown as the override it meant, for the commands that take overrides."""
        named = []
        for flag in flags:
            name = flag.split("=", 1)[0]
            if self.takes_overrides and flag.startswith("-") and "." in name:
                override = flag.lstrip("-") if "=" in flag else f"{name.lstrip('-')}=VALUE"
                named.append(f"{flag} (an override takes no dashes: {override})")
                continue
            close = difflib.get_close_matches(name, self.known_flags, n=1)
            named.append(f"{flag} (did you mean {close[0]}?)" if close else flag)
        return f"unrecognized arguments: {' '.join(named)}"

    def word_after_a_flag(self, overrides: Sequence[str]) -> str | None:
        """The message for a word of ``overrides`` without '=' that stands right after a
        flag and the values it takes (``--dp 2 4``, ``--json 4``): a second value given to
        the flag, which argparse leaves over for the overrides (where it would be refused
        as an override without '='). A word that starts with a config section
        (``trainer.total_steps 5``) is an override that lacks its '=', as the config loader
        says; words after ``--`` are overrides."""
        given = self.given[: self.given.index("--")] if "--" in self.given else self.given
        for i, arg in enumerate(given):
            name, inline, value = arg.partition("=")
            action = self.flag_action(name) if arg.startswith("-") else None
            if action is None or action.nargs not in (None, 0):
                continue
            after = i + (2 if action.nargs is None and not inline else 1)
            word = given[after] if after < len(given) else None
            if word is None or word.startswith("-") or "=" in word or word not in overrides:
                continue
            if word.split(".", 1)[0] in _config_sections():
                continue
            flag = action.option_strings[-1]
            if action.nargs == 0:
                return f"{flag} takes no value, got {shown(word)} after it; {_OVERRIDE_FORM}"
            value = value if inline else given[i + 1]
            return (
                f"{flag} takes one value, got {shown(value)} and then {shown(word)}; "
                f"{_OVERRIDE_FORM}"
            )
        return None

    def flag_action(self, name: str) -> argparse.Action | None:
        """The action of flag ``name`` as argparse reads it: by its name, or a prefix of one
        flag's name."""
        actions = {flag: action for action in self.arguments for flag in action.option_strings}
        if name in actions:
            return actions[name]
        found = {a for f, a in actions.items() if f.startswith(name)}
        return found.pop() if len(found) == 1 and name.startswith("--") else None

    @property
    def takes_overrides(self) -> bool:
        """Whether this command takes dotted config overrides (its ``overrides`` words)."""
        return any(action.dest == "overrides" for action in self.arguments)


def _config_sections() -> list[str]:
    """The config's top-level sections (``trainer``, ...); the schema loads torch, which only
    a word left over by a mistake costs here."""
    from verlite.config.schema import Config

    return list(Config.model_fields)


def build_parser() -> _OneLineParser:
    parser = _OneLineParser(prog="verlite", description="Ray-distributed RL post-training for LMs.")
    parser.add_argument("--version", action="version", version=f"verlite {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMAND_MODULES:
        module.add_commands(commands)
    parser.commands = commands.choices
    return parser


def _version() -> str:
    """verlite's version as installed; a source folder on the path (an offline GPU machine's
    ``PYTHONPATH``) has no installed version."""
    return installed_version("verlite") or "(not installed: run from its source folder)"


def _parse(parser: _OneLineParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """The parsed arguments; arguments the chosen command does not know are refused by that
    command (``verlite train: error: ...``, its help), not by ``verlite``. A command's
    overrides may stand on both sides of its flags (``--config C a=1 --wait b=2``): argparse
    takes the first run of them for the positional and leaves the words after a flag over,
    which are overrides too, in their order, and so is every word after ``--`` (argparse
    leaves it over with them once the positional is taken: ``a=1 --wait -- b=2``)."""
    args, extra = parser.parse_known_args(argv)
    command = parser.commands[args.command]
    if command.takes_overrides:
        end = extra.index("--") if "--" in extra else len(extra)
        words = [arg for arg in extra[:end] if not arg.startswith("-")] + extra[end + 1 :]
        args.overrides = [*args.overrides, *words]
        extra = [arg for arg in extra[:end] if arg.startswith("-")]
        stray = command.word_after_a_flag(args.overrides)
        if stray is not None:
            command.error(stray)
    if extra:
        command.error(command.unrecognized(extra))
    return args


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
    args = _parse(build_parser(), argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    # Before a command imports transformers, and inherited by the ranks it spawns
    # (check-invariance, measure-packing): Hugging Face's progress bars ("Loading weights" at
    # every load of model.path) are not a command's output. Ray's workers get the same
    # (controller.session.WORKER_ENV); HF_HUB_DISABLE_PROGRESS_BARS=0 keeps them.
    os.environ.setdefault(HF_PROGRESS_BARS_ENV, "1")
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
        # A run said before this what a new one of its folder does (driver.checkpoint).
        print("verlite: terminated (SIGTERM)", file=sys.stderr)
        return 128 + signal.SIGTERM
    except BrokenPipeError:
        # The reader of stdout left (`verlite metrics ... | head`): stop quietly. Point stdout
        # at /dev/null so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    return code


if __name__ == "__main__":
    sys.exit(main())
