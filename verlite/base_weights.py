"""The identity of a base model folder (``model.path``, or the base a LoRA export wrote): the
SHA-256 of each of its weight files' bytes.

A run takes it once, before Ray, and records it in every checkpoint's trainer state and
beside a LoRA export's adapter; a resume, or ``verlite export --merge``, over a folder whose
weights have changed since is refused in one line naming the files that differ, rather than
continuing or merging the adapter over weights it was not trained with.

Why the files' bytes and not the loaded tensors: the identity is taken where no model is
built (the driver before Ray, ``verlite export`` before it loads anything), without torch,
streaming each file once at disk speed. A base re-saved with equal tensors but other bytes
(another serializer) counts as another base: refused, never merged unseen.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

from verlite.errors import UserError, shown

# Beside a LoRA export's adapter: the base it applies to and that base's identity.
RECORD_FILE = "base_weights.json"
# Hugging Face's weight files, whole or sharded, and their shard indexes.
_PREFIXES = ("model.", "model-", "pytorch_model.", "pytorch_model-")
_SUFFIXES = (".safetensors", ".bin", ".index.json")


def identity(folder: str | Path) -> dict[str, str]:
    """The SHA-256 of every weight file in ``folder``, by file name."""
    files = sorted(
        path
        for path in Path(folder).iterdir()
        if path.name.startswith(_PREFIXES) and path.name.endswith(_SUFFIXES) and path.is_file()
    )
    return {path.name: _sha256(path.resolve(), *_version(path)) for path in files}


def _version(path: Path) -> tuple[int, int, int]:
    info = path.stat()
    return info.st_ino, info.st_size, info.st_mtime_ns


@functools.lru_cache(maxsize=64)
def _sha256(path: Path, inode: int, size: int, mtime_ns: int) -> str:
    """One file's digest, read once per version of it in this process (a run takes the
    identity at start and a resume compares with it: the files are not read twice)."""
    with path.open("rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def differences(recorded: dict[str, str], base: str | Path) -> list[str]:
    """What differs between the identity ``recorded`` and ``base``'s now, file by file
    ("model.safetensors changed", "... is missing", "... is new"); empty when none."""
    now = identity(base)
    return [
        f"{name} {'is missing' if name not in now else 'is new' if name not in recorded else 'changed'}"
        for name in sorted(recorded.keys() | now.keys())
        if recorded.get(name) != now.get(name)
    ]


def write_record(folder: Path, base: str | Path, weights: dict[str, str]) -> None:
    """Record in ``folder`` (an export) that it applies to ``base``, whose identity is
    ``weights``."""
    record = {"base": str(base), "sha256": weights}
    (folder / RECORD_FILE).write_text(json.dumps(record, indent=1) + "\n")


def check_export_base(folder: Path, base: str | Path) -> bool:
    """Whether ``folder`` (an export) records the identity of its base; a one-line user error
    when ``base`` no longer holds those weights."""
    path = folder / RECORD_FILE
    if not path.is_file():
        return False  # exported before verlite recorded its base
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        weights = record["sha256"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{shown(str(path))} is damaged: {exc}") from None
    if changed := differences(weights, base):
        raise UserError(
            f"{folder}: its base {shown(str(base))} no longer holds the weights it was trained "
            f"over ({', '.join(changed)}); merge onto that base as it was, or train again"
        )
    return True
