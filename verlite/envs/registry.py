"""Environments by name: the built-in ones, and user classes by import path."""

from __future__ import annotations

import inspect

from verlite.config import ConfigError
from verlite.envs.lookup import Lookup, LookupWithoutTool
from verlite.user_code import load_object

ENVIRONMENTS: dict[str, type] = {"lookup": Lookup, "lookup_without_tool": LookupWithoutTool}
FIELD = "rollout.multi_turn.env"


def get_environment(spec: str) -> type:
    """A registered environment class by name, or a user class by ``"package.module:Class"``:
    a class whose instances have ``reset(record)`` and ``step(action)``, made without
    arguments."""
    if spec in ENVIRONMENTS:
        return ENVIRONMENTS[spec]
    target = load_object(
        spec,
        field=FIELD,
        what="environment",
        example="package.module:Class",
        registered=ENVIRONMENTS,
    )
    if not inspect.isclass(target):
        raise ConfigError(f"{FIELD}={spec!r} is not a class (it is a {type(target).__name__})")
    missing = [name for name in ("reset", "step") if not callable(getattr(target, name, None))]
    if missing:
        raise ConfigError(f"{FIELD}={spec!r}: the class has no {' or '.join(missing)} method")
    try:
        inspect.signature(target).bind()
    except TypeError as exc:
        raise ConfigError(f"{FIELD}={spec!r} must be made without arguments: {exc}") from None
    except ValueError:  # no introspectable signature
        pass
    return target


def environment_name(cls: type) -> str:
    """How messages name an environment: its registered name, else ``module:qualname``."""
    for name, registered in ENVIRONMENTS.items():
        if registered is cls:
            return name
    return f"{cls.__module__}:{cls.__qualname__}"
