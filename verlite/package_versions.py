"""The versions of the installed packages that shape a run's numbers, as a checkpoint records
them (``trainer_state.json``'s ``versions``): a resume under other versions is told that its
metrics may differ from an uninterrupted run's, and a load that reads a checkpoint as another
model's names the version that changed rather than calling its files damaged.

Those packages: verlite (its own math), torch (the kernels), transformers (the models) and
tokenizers (the token ids), and peft where the policy has LoRA adapters. Each as installed,
by its metadata, as ``verlite --version`` reads verlite's: an editable install's is
pyproject.toml's whatever its commit, and a package not installed (verlite run from its source
folder on the path) is not recorded.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Mapping

NUMERIC_PACKAGES = ("verlite", "torch", "transformers", "tokenizers")


def installed_version(package: str) -> str | None:
    """``package``'s version as installed; None where it is not."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def package_versions(*, lora: bool) -> dict[str, str]:
    """The versions of this process's packages that shape a run's numbers, by name (peft's
    with ``lora``: the policy has adapters)."""
    names = (*NUMERIC_PACKAGES, "peft") if lora else NUMERIC_PACKAGES
    return {name: found for name in names if (found := installed_version(name)) is not None}


def version_changes(recorded: Mapping[str, str]) -> list[str]:
    """Each package of ``recorded`` (:func:`package_versions` of the process that wrote a
    checkpoint) installed here at another version, or not at all, in its order:
    ``torch 2.11.0 -> 2.13.0``."""
    here = {name: installed_version(name) for name in recorded}
    return [
        f"{name} {there} -> {here[name] or '(not installed)'}"
        for name, there in recorded.items()
        if here[name] != there
    ]
