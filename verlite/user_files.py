"""Reading the files users give verlite and runs leave on disk (configs, prompt files,
metrics logs): the one place their bytes become text and their lines JSON values, so that a
missing, unreadable, oversized or undecodable file, or a line that is not JSON or sets a key
twice, is one line naming the file (and line), never a traceback; and the paths they name
resolved, where a link loop is one line too (:func:`resolved_path`). What is the user's to fix is
a path that names no file it may read; an I/O error of the machine's (:data:`MACHINE_ERRNOS`:
EIO, a stale network mount) is a :class:`~verlite.errors.RunFailure` naming the file, exit 1."""

from __future__ import annotations

import errno
import json
import sys
from pathlib import Path
from typing import Any

from verlite.errors import RunFailure, UserError, shown

# Why reading a file fails when the machine, not the path, is at fault: the disk or a
# network mount failing or gone stale, the process out of memory or of file handles. Any
# other errno is the path's to fix (none there, a folder, a socket, a device, no permission).
MACHINE_ERRNOS = frozenset(
    getattr(errno, name)
    for name in (
        "EIO",
        "ESTALE",
        "EREMOTEIO",
        "ETIMEDOUT",
        "ENOLINK",
        "ECOMM",
        "ENETDOWN",
        "ENETUNREACH",
        "EHOSTDOWN",
        "EHOSTUNREACH",
        "ECONNRESET",
        "ECONNABORTED",
        "ENOMEM",
        "EMFILE",
        "ENFILE",
        "EAGAIN",
        "EINTR",
    )
    if hasattr(errno, name)
)


# A path is named whole (Linux's longest): cut, it would not say which file.
PATH_MAX = 4096


def check_readable(exc: OSError, path: str | Path, *, what: str) -> None:
    """Raise :class:`RunFailure` naming ``path`` (``what``: how messages name it) when ``exc``,
    raised reading it, is the machine's (:data:`MACHINE_ERRNOS`), not the user's to fix (an
    OSError without an errno is a library's word on the content, as Hugging Face's "not a
    valid JSON file")."""
    if exc.errno in MACHINE_ERRNOS:
        raise RunFailure(
            f"reading {what} {shown(str(path), PATH_MAX)} failed: {exc.strerror or exc} (an I/O "
            "error of this machine, not the file's content; try again)"
        ) from exc


def resolved_path(value: str | Path, named: str, *, error: type[UserError] = UserError) -> Path:
    """``value`` with links, ``.`` and ``..`` resolved (a relative path is the current
    folder's); one line, ``error`` with ``named`` as its subject (``trainer.output_dir='x'``,
    a command's ``'RUN_DIR'``), for a link loop or a name the file system refuses. A missing
    path is returned: what it means is the caller's to say."""
    try:
        path = Path(value).resolve()
        path.stat()
        looped = False
    except RuntimeError:  # pathlib's report of a link loop (Python 3.11 and 3.12)
        looped = True
    except OSError as exc:
        # From Python 3.13 resolve() leaves a loop unresolved, and reading through it fails.
        looped = exc.errno == errno.ELOOP
        if not looped and exc.errno not in (errno.ENOENT, errno.ENOTDIR):
            # e.g. a name too long for the file system (a missing path is the caller's)
            raise error(f"{named}: {exc.strerror or exc}") from None
    if looped:
        raise error(
            f"{named} is a symbolic link loop (a link that leads back to itself); give a path "
            "to a real folder or file"
        )
    return path


def read_text(
    path: str | Path,
    *,
    what: str,
    error: type[UserError] = UserError,
    max_bytes: int | None = None,
) -> str:
    """The UTF-8 text of the file ``path``, without a leading byte-order mark. ``what``
    names the file in messages ("config file"); problems raise ``error`` with one line.
    With ``max_bytes``, reading stops there, so a device such as /dev/zero, or a pipe that
    never ends, is refused instead of filling the memory."""
    named = shown(str(path))
    if not str(path):  # Path("") is the current folder
        raise error(f"{what}: an empty path names no file")
    try:
        with Path(path).open("rb") as file:
            raw = file.read(-1 if max_bytes is None else max_bytes + 1)
    except OSError as exc:
        check_readable(exc, path, what=what)
        raise error(f"cannot read {what} {named}: {exc.strerror}") from None
    except ValueError as exc:  # a NUL byte in the path
        raise error(f"cannot read {what} {named}: {exc}") from None
    if max_bytes is not None and len(raw) > max_bytes:
        raise error(f"{what} {named} is larger than {max_bytes:,} bytes; is it the right file?")
    try:
        # A byte-order mark (what Windows editors and PowerShell write first) is no content.
        return raw.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise error(
            f"{what} {named} is not UTF-8 text (byte {exc.object[exc.start]:#x} at offset "
            f"{exc.start}, line {line})"
        ) from None


def parse_json(text: str, where: str, *, error: type[UserError] = UserError) -> Any:
    """The JSON value of ``text``, found at ``where`` ("file:line"); malformed JSON, an
    object that sets a key twice (json.loads would keep the last silently), and JSON that
    Python cannot hold (arrays nested past the recursion limit, an integer of more digits
    than ``sys.get_int_max_str_digits()``: valid JSON, which json.loads raises on with a
    RecursionError or a bare ValueError) raise ``error`` with one line naming ``where``."""
    try:
        return json.loads(text, object_pairs_hook=_keys_once)
    except json.JSONDecodeError as exc:
        raise error(f"{where}: malformed JSON: {exc.msg} (column {exc.colno})") from None
    except _KeyTwice as exc:
        raise error(f"{where}: field {exc.args[0]!r} is set twice") from None
    except RecursionError:
        raise error(f"{where}: JSON nests too deeply to read") from None
    except ValueError:  # the only other ValueError json.loads raises
        raise error(
            f"{where}: JSON holds an integer of more than {sys.get_int_max_str_digits():,} "
            "digits, more than Python reads"
        ) from None


class _KeyTwice(Exception):
    pass


def _keys_once(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for key, value in pairs:
        if key in fields:
            raise _KeyTwice(key)
        fields[key] = value
    return fields
