"""User code named in a config as ``"package.module:attribute"`` (reward functions,
environments): imported by ``importlib``, never ``eval``, with one-line errors that name the
config field."""

from __future__ import annotations

import difflib
import importlib
import re
from collections.abc import Iterable

from verlite.config import ConfigError

_DOTTED = r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*"
_IMPORT_PATH = re.compile(rf"(?P<module>{_DOTTED}):(?P<attr>{_DOTTED})")


def load_object(
    spec: str, *, field: str, what: str, example: str, registered: Iterable[str]
) -> object:
    """The object ``spec`` = ``"package.module:attribute"`` names; only that module is
    imported. ``field`` (the config key), ``what`` (e.g. "reward"), ``example`` (e.g.
    "package.module:function") and the ``registered`` names make the error when ``spec`` is
    neither."""
    match = _IMPORT_PATH.fullmatch(spec)
    if match is None:
        registered = list(registered)
        raise ConfigError(
            f"{field}={spec!r}: not a registered {what} ({', '.join(registered)}) "
            f"nor an import path {example!r}{_did_you_mean(spec, registered)}"
        )
    module_name, attr = match["module"], match["attr"]
    try:
        target: object = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (module_name + ".").startswith(exc.name + "."):
            raise ConfigError(
                f"{field}={spec!r}: no module named {exc.name!r} (is it on PYTHONPATH?)"
            ) from None
        raise ConfigError(f"{field}={spec!r}: importing {module_name!r} failed: {exc}") from exc
    except Exception as exc:
        raise ConfigError(
            f"{field}={spec!r}: importing {module_name!r} failed: {type(exc).__name__}: {exc}"
        ) from exc
    for part in attr.split("."):
        if not hasattr(target, part):
            public = [name for name in dir(target) if not name.startswith("_")]
            raise ConfigError(
                f"{field}={spec!r}: {getattr(target, '__name__', module_name)!r} has no "
                f"attribute {part!r}{_did_you_mean(part, public)}"
            )
        target = getattr(target, part)
    return target


def _did_you_mean(given: str, names: list[str]) -> str:
    """The closest of ``names`` to a mistyped ``given``, as the config's unknown keys get."""
    close = difflib.get_close_matches(given, names, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""
