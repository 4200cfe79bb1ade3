"""The two kinds of failure the command line reports in one line, without a traceback: a
:class:`UserError` (bad input: exit 2) and a :class:`RunFailure` (a run that stopped for a
reason its message names: exit 1), their messages without credentials."""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable
from types import ModuleType

from verlite.redaction import redact_text, redact_values


class _OneLine(Exception):
    """A failure the command line reports as its one-line message, credentials masked."""

    def __init__(self, *args: object) -> None:
        # A message names what failed, and may quote what a server or a user's code said:
        # the credentials in it are masked when it is made, wherever it is shown later.
        super().__init__(*redact_values(args))

    def then(self, next_step: str) -> None:
        """Follow this failure's message with ``next_step``: what a new run of the output
        folder does, which the driver, knowing the folder, adds as the failure leaves the
        run (``driver.run.run``)."""
        self.args = (redact_text(f"{self}; {next_step}"),)


class UserError(_OneLine, ValueError):
    """Bad input: a config value, a data file, a reward function, a command-line flag."""


class DamagedFileError(UserError):
    """A file a run wrote and reads back (a checkpoint's) whose bytes are damaged: cut short,
    altered, not what verlite writes. Its message names the file."""


class MismatchedFileError(UserError):
    """A file a run wrote and reads back (a checkpoint's) whose values, whole, are another
    model's than the config builds (other names or shapes): written under other settings,
    or damaged so that it reads so. Its message names the file."""


class RunFailure(_OneLine, RuntimeError):
    """A run stopped for a reason its message names (a worker died, training diverged):
    the CLI prints it in one line and exits 1; checkpoints written so far stay valid."""


def shown(value: object, limit: int = 120, render: Callable[[object], str] = repr) -> str:
    """A user's value as a one-line message quotes it: its ``repr`` (or ``render``), the
    middle cut out when longer than ``limit`` characters (a pasted megabyte must not become
    the message). Secrets are masked before the cut, which could leave a part of one on each
    side of it."""
    text = redact_text(render(value))
    if len(text) <= limit:
        return text
    half = (limit - 5) // 2
    return f"{text[:half]}[...]{text[-half:]}"


def one_line(message: object, limit: int | None = None) -> str:
    """``str(message)`` (an exception's message, a value's ``repr``) as a one-line message
    quotes it: each run of white space one space, then its first ``limit`` characters (all
    of them without one)."""
    return " ".join(str(message).split())[:limit]


class MissingExtraError(UserError):
    """An optional feature is configured but its package is not installed."""


def import_extra(module: str, *, feature: str, extra: str) -> ModuleType:
    """Import the package behind an optional feature, or fail with the install command: the
    requirement of verlite's ``extra`` as its metadata (pyproject.toml) states it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtraError(
            f"{feature} needs the {module!r} package, which cannot be imported ({exc}); "
            f"install it with: {_install_command(extra)}"
        ) from None


def _install_command(extra: str) -> str:
    """How to install verlite's ``extra``: its requirements as verlite's metadata
    (pyproject.toml) states them, ``pip install 'math-verify>=0.7' (verlite's 'math'
    extra)``; the editable install of the extra where verlite is not installed."""
    try:
        requires = importlib.metadata.requires("verlite") or []
    except importlib.metadata.PackageNotFoundError:
        requires = []
    marker = f'extra == "{extra}"'
    found = [r.split(";")[0].strip() for r in requires if r.split(";")[-1].strip() == marker]
    if not found:
        return f"pip install -e '.[{extra}]' in verlite's folder"
    return f"pip install {' '.join(repr(r) for r in found)} (verlite's {extra!r} extra)"
