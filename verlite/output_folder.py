"""The contract of ``trainer.output_dir``: a run never writes over what it did not make, and
never silently starts over a run it could continue.

Before Ray starts, the folder is one of:

- missing or empty: a fresh run starts there;
- a run with a complete checkpoint, and ``trainer.resume`` is ``auto`` (or names one of its
  checkpoints): the run continues from it — unless that checkpoint is already at
  ``trainer.total_steps``, which is refused (nothing would be trained);
- anything else (someone's files, an earlier run without a checkpoint, ``resume=disable``
  over a run, a checkpoint of another folder resumed into this one): refused, with one
  line naming what is there. With ``trainer.overwrite=true``
  its contents are moved aside, whole, to a sibling ``<name>.replaced-<UTC time>`` folder,
  and a fresh run starts in the emptied folder. Nothing is deleted.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from verlite.checkpoint import (
    CheckpointError,
    check_resumable,
    complete_checkpoints,
    read_trainer_state,
    resume_checkpoint,
)
from verlite.config import Config, ConfigError
from verlite.errors import shown


def prepare_output_folder(cfg: Config) -> Path | None:
    """Make ``trainer.output_dir`` ready under the contract above; the checkpoint to resume
    from, or None for a fresh run. Raises a one-line user error otherwise."""
    out = Path(cfg.trainer.output_dir)
    try:
        out.exists()
    except OSError as exc:  # e.g. a name too long for the file system
        raise ConfigError(f"trainer.output_dir={shown(str(out))}: {exc.strerror}") from None
    if out.exists() and not out.is_dir():
        raise ConfigError(f"trainer.output_dir={shown(str(out))} is a file, not a folder")
    resume_from = _resume_point(cfg, out)
    continuing = resume_from is not None and resume_from.resolve().is_relative_to(out.resolve())
    if not continuing and _has_contents(out):
        if not cfg.trainer.overwrite:
            raise ConfigError(
                f"trainer.output_dir={shown(str(out))} is not empty ({_describe(out, cfg)}) and holds "
                "no checkpoint this run continues; choose an empty folder, or set "
                "trainer.overwrite=true to move its contents aside"
            )
        moved = _move_contents_aside(out)
        print(f"moved the earlier contents of {out} to {moved}", flush=True)
    _make_writable_folder(out)
    return resume_from


def _resume_point(cfg: Config, out: Path) -> Path | None:
    path = resume_checkpoint(out, cfg.trainer.resume)
    if path is None:
        return None
    changed = check_resumable(
        path,
        config=cfg.model_dump(mode="json"),
        roles=cfg.roles,
        total_steps=cfg.trainer.total_steps,
    )
    step = int(read_trainer_state(path)["step"])
    if step == cfg.trainer.total_steps:
        raise CheckpointError(
            f"the run in {shown(str(out))} already reached trainer.total_steps={step} (checkpoint "
            f"{path.name}); raise trainer.total_steps to train further, or choose another "
            "trainer.output_dir for a new run"
        )
    if changed:
        print(f"resuming {path} with changed settings: {'; '.join(changed)}", flush=True)
    return path


def _has_contents(out: Path) -> bool:
    return out.is_dir() and any(out.iterdir())


def _describe(out: Path, cfg: Config) -> str:
    """What the folder holds, in a few words."""
    if (out / "metrics.jsonl").is_file() or (out / "workers.json").is_file():
        if cfg.trainer.resume == "disable" and complete_checkpoints(out):
            return "a run with checkpoints, and trainer.resume=disable"
        return "an earlier run"
    entries = sorted(p.name for p in out.iterdir())
    shown = ", ".join(entries[:3]) + (f" and {len(entries) - 3} more" if len(entries) > 3 else "")
    return f"it holds {shown}"


def _move_contents_aside(out: Path) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    target = out.with_name(f"{out.name}.replaced-{stamp}")
    suffix = 1
    while target.exists():
        suffix += 1
        target = out.with_name(f"{out.name}.replaced-{stamp}-{suffix}")
    try:
        os.replace(out, target)
    except OSError as exc:
        raise ConfigError(
            f"trainer.overwrite=true: cannot move {shown(str(out))} aside to {str(target)!r}: "
            f"{exc.strerror}"
        ) from None
    return target


def _make_writable_folder(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".verlite-write-check"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(
            f"trainer.output_dir={shown(str(out))} cannot be written: {exc.strerror or exc}"
        ) from None
