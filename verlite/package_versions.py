"""The versions of the installed packages that shape a run's numbers, as a checkpoint records
them (``trainer_state.json``'s ``versions``): a resume under other versions is told that its
metrics may differ from an uninterrupted run's, and a load that reads a checkpoint as another
model's names a version that changed rather than calling its files damaged.

Those packages: verlite (its own math), torch (the kernels), transformers (the models) and
tokenizers (the token ids), and peft where the policy has LoRA adapters. Each as installed,
by its metadata, as ``verlite --version`` reads verlite's: an editable install's is
pyproject.toml's whatever its commit (so a load's mismatch still names verlite as a possible
cause: ``unversioned``), and a package not installed (verlite run from its source folder on
the path) is neither recorded nor compared.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from collections.abc import Mapping, Sequence
from pathlib import Path

NUMERIC_PACKAGES = ("verlite", "torch", "transformers", "tokenizers")
# Those whose change may name or shape a model's values otherwise (its classes, its adapters).
MODEL_PACKAGES = ("verlite", "transformers", "peft")


def installed_version(package: str) -> str | None:
    """``package``'s version as installed; None where it is not."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def package_versions(*, peft: bool) -> dict[str, str]:
    """The versions of this process's packages that shape a run's numbers, by name, with
    peft's where ``peft`` (a run records it where the policy has LoRA adapters; a worker
    reports it always, compared only where they have)."""
    names = (*NUMERIC_PACKAGES, "peft") if peft else NUMERIC_PACKAGES
    return {name: found for name in names if (found := installed_version(name)) is not None}


def version_changes(
    recorded: Mapping[str, str], here: Mapping[str, str] | None = None
) -> list[str]:
    """Each package of ``recorded`` (:func:`package_versions` of the process that wrote a
    checkpoint, or of a worker) at another version ``here`` (this process's installed ones
    when None), in its order: ``torch 2.11.0 -> 2.13.0``. One that ``here`` lacks (verlite run
    from its source folder, not installed) has no version to compare."""
    found = {name: installed_version(name) for name in recorded} if here is None else here
    return [
        f"{name} {there} -> {found.get(name)}"
        for name, there in recorded.items()
        if found.get(name) is not None and found.get(name) != there
    ]


def unversioned(
    recorded: Mapping[str, str], names: tuple[str, ...], readers: Sequence[Mapping[str, str]]
) -> list[str]:
    """Those of ``names`` whose version does not tell the code of ``readers`` (the package
    versions of the processes that read what ``recorded``'s wrote) from the code that wrote
    it: not recorded there, not installed in a reader, or imported here from a source folder
    (an editable install, or the folder on the path: its version is pyproject.toml's, whatever
    the commit; a reader is taken to import it as this process does)."""
    return [
        name
        for name in names
        if name not in recorded
        or any(name not in versions for versions in readers)
        or _from_source(name)
    ]


def _from_source(package: str) -> bool:
    """Whether ``package`` is imported from outside the interpreter's installed packages."""
    spec = importlib.util.find_spec(package)
    origin = None if spec is None else spec.origin
    return origin is None or not {"site-packages", "dist-packages"} & set(Path(origin).parts)
