"""verlite: Ray-distributed RL post-training whose losses and gradients do not depend on how
the batch is split. The Python API (:mod:`verlite.api`): :func:`load_config`, :func:`train`,
:func:`read_metrics`, imported on first use so that the command line starts without torch."""

import importlib
from typing import Any

__all__ = ["load_config", "read_metrics", "train"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        # By name: type checkers of verlite/core do not follow it into the whole runtime.
        return getattr(importlib.import_module("verlite.api"), name)
    raise AttributeError(f"module 'verlite' has no attribute {name!r}")
