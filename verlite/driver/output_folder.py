"""The contract of ``trainer.output_dir``: a run never writes over what it did not make, and
never silently starts over a run it could continue.

Before Ray starts, the folder is one of:

- missing or empty: a fresh run starts there;
- a run with a complete checkpoint, and ``trainer.resume`` is ``auto`` (or names one of its
  checkpoints): the run continues from it — unless that checkpoint is already at
  ``trainer.total_steps``, which is refused (nothing would be trained), but for a run that
  stopped before its policy export was whole (``policy_folder.policy_exported``): it resumes
  to export (a run continued past its end marks its earlier export as not whole as it starts);
- anything else (someone's files, an earlier run without a checkpoint, ``resume=disable``
  over a run, a checkpoint of another folder resumed into this one): refused, with one
  line naming what is there. With ``trainer.overwrite=true``
  its contents are moved aside, whole, to a sibling ``<name>.replaced-<UTC time>`` folder,
  and a fresh run starts in the emptied folder. Nothing is deleted.

:func:`new_run` decides which, for a config and the folder's state (:class:`FolderState`):
:func:`prepare_output_folder` acts on it, and :func:`stopped_run_hint` says it when a run
ends early (and what to change where the same config is refused).

A run holds its folder while it runs (:class:`FolderLock`): a second run into a folder in
use is refused, whatever ``trainer.overwrite`` says, so two runs (jobs submitted at once with
one config) never write into one folder. The lock file is only ever a regular file verlite
made: a link or anything else by that name is someone's, never followed or truncated, and
counts as contents.

The folder is judged, held and moved aside by its resolved path (links, ``.`` and ``..``
gone), so the aside folder is a sibling of the real folder, on its file system. A move aside
that fails part-way moves back what it moved; the one line says what is where if even that
fails.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from verlite.config import Config, ConfigError, TrainerConfig
from verlite.driver.checkpoint import (
    CheckpointError,
    check_resumable,
    checkpoint_root,
    checkpoint_step,
    complete_checkpoints,
    read_trainer_state,
    resume_checkpoint,
)
from verlite.errors import UserError, shown
from verlite.policy_folder import (
    INCOMPLETE_MARK,
    POLICY_FOLDER,
    STEP_RECORD,
    exported_step,
    policy_exported,
)
from verlite.redaction import redact_text
from verlite.user_files import resolved_path

LOCK_FILE = ".verlite-lock"


class FolderLock:
    """A run's hold on its output folder: an exclusive ``flock`` of ``<output_dir>/.verlite-lock``,
    which says who holds it. The operating system lets go when the process ends, however it
    ends, so a killed run leaves nothing to clean up."""

    def __init__(self, file: IO[str]) -> None:
        self._file = file

    @classmethod
    def take(cls, out: Path) -> FolderLock:
        """Hold ``out`` (an existing folder); a one-line user error naming the holder when
        another run holds it."""
        path = out / LOCK_FILE
        try:
            # Never through a link: its target (someone's file) would be locked and truncated.
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise _not_a_lock_file(path, "a symbolic link") from None
            raise ConfigError(f"cannot create {shown(str(path))}: {exc.strerror or exc}") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO or device by that name
            os.close(fd)
            raise _not_a_lock_file(path, "not a regular file")
        file = os.fdopen(fd, "r+")
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.seek(0)
            holder = file.read().strip() or "a process"
            file.close()
            raise ConfigError(
                f"trainer.output_dir={shown(str(out))} is in use by another run ({holder}); "
                "wait for it to end, or choose another folder"
            ) from None
        except OSError as exc:
            file.close()
            raise ConfigError(
                f"cannot lock {shown(str(path))} ({exc.strerror or exc}): the output folder's "
                "file system does not support flock; choose a folder on one that does"
            ) from None
        file.seek(0)
        file.truncate()
        started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        file.write(f"pid {os.getpid()} on {socket.gethostname()}, since {started}\n")
        file.flush()
        return cls(file)

    def release(self) -> None:
        """Let go of the folder (idempotent)."""
        self._file.close()

    # A hold dropped without release (a test that builds a run's inputs and no run) lets go.
    __del__ = release


def _not_a_lock_file(path: Path, what: str) -> ConfigError:
    return ConfigError(
        f"{shown(str(path))} is {what}, not a lock file verlite made; it is left as it is: "
        "move it away, or choose another trainer.output_dir"
    )


def _is_lock_file(path: Path) -> bool:
    """Whether ``path`` (a folder's entry) is a run's lock file: a regular file (not a link to
    one) named ``.verlite-lock``. Anything else by that name is contents."""
    if path.name != LOCK_FILE:
        return False
    try:
        return stat.S_ISREG(path.lstat().st_mode)
    except FileNotFoundError:
        return False


def resolved_output_dir(cfg: Config) -> Path:
    """``trainer.output_dir`` with links, ``.`` and ``..`` resolved: the one place the run's
    checks, hold and moves name (a relative path is the current folder's). A one-line user
    error for a link loop (of the folder or of its ``checkpoints``), a name the file system
    refuses, or the file system's root."""
    raw = cfg.trainer.output_dir
    out = resolved_path(raw, f"trainer.output_dir={shown(raw)}", error=ConfigError)
    if out.parent == out:
        raise ConfigError(
            f"trainer.output_dir={shown(raw)} is the file system's root; choose a folder in it"
        )
    checkpoints = checkpoint_root(out)  # linked to a scratch disk, it is followed
    resolved_path(
        checkpoints,
        f"{shown(str(checkpoints))} (trainer.output_dir's checkpoints)",
        error=ConfigError,
    )
    return out


def prepare_output_folder(
    cfg: Config, *, train_set: Mapping[str, Any]
) -> tuple[Path | None, FolderLock, list[str]]:
    """Make ``trainer.output_dir`` ready under the contract above and hold it; the checkpoint
    to resume from (None for a fresh run; checked, over the training prompts of fingerprint
    ``train_set``, before anything moves), the hold, which the run releases when it ends, and
    the lines a run that starts says of its resume (what it changes, or that it exports
    alone): the caller prints them once every check passed, so a refused run says one line.
    Raises a one-line user error otherwise."""
    out = resolved_output_dir(cfg)
    # the folder, or the first of its parents that exists: a file inside which no folder is
    existing = next(path for path in (out, *out.parents) if path.exists())
    if not existing.is_dir():
        where = "is" if existing == out else f"lies inside {shown(str(existing))}, which is"
        raise ConfigError(
            f"trainer.output_dir={shown(cfg.trainer.output_dir)} {where} a file, not a folder"
        )
    if _is_lock_file(out / LOCK_FILE):  # a run was here: it may still be running
        FolderLock.take(out).release()
    plan = new_run(out, cfg.trainer, FolderState.read(out))
    if plan.refused is not None:
        raise plan.refused  # refused before this run writes anything there
    notes = [] if plan.resume_from is None else _check_resume_point(cfg, out, plan, train_set)
    _make_writable_folder(out)
    hold = FolderLock.take(out)
    try:
        # Under the hold the contents are judged again: a run that started here after the
        # checks above may have ended since, leaving its files.
        if not plan.continuing and _has_contents(out):
            if not cfg.trainer.overwrite:
                raise _not_empty(out, cfg.trainer.output_dir, cfg.trainer.resume)
            moved = _move_contents_aside(out)
            print(f"moved the earlier contents of {out} to {moved}", flush=True)
        if plan.continuing and cfg.trainer.export:
            _check_linked_export(out)
        if plan.continuing and cfg.trainer.export and policy_exported(out):
            # A run continued past its end: its export is an earlier step's policy from now
            # on; stopped after its last checkpoint, the run again resumes to export its own.
            (out / INCOMPLETE_MARK).touch()
            print(
                f"{shown(str(out / POLICY_FOLDER))} holds an earlier step's policy until this "
                "run exports its own",
                flush=True,
            )
    except BaseException:
        hold.release()
        raise
    return plan.resume_from, hold, notes


def _check_linked_export(out: Path) -> None:
    """The run exports its policy through a link ``hf_actor`` (to a larger disk), into the
    folder it leads to, which it empties first (``checkpoint.clear_folder``): refused where
    that is not a folder, or holds files but no policy export of a run (its step record, or
    the mark of an export under way beside the link)."""
    export = out / POLICY_FOLDER
    if not export.is_symlink():
        return
    target = resolved_path(export, shown(str(export)), error=ConfigError)
    if not target.exists():
        return  # made as the run exports
    where = f"{shown(str(export))} links to {shown(str(target))}"
    if not target.is_dir():
        raise ConfigError(
            f"{where}, which is not a folder; the run exports its policy there: link a folder "
            "or remove the link"
        )
    ours = (target / STEP_RECORD).exists() or (out / INCOMPLETE_MARK).exists()
    if not ours and any(target.iterdir()):
        raise ConfigError(
            f"{where}, which holds files that are not a policy export; the run's export would "
            "replace them: link an empty folder or remove the link"
        )


def _not_empty(out: Path, output_dir: str, resume: str) -> ConfigError:
    return ConfigError(
        f"trainer.output_dir={shown(output_dir)} is not empty ({_describe(out, resume)}) and "
        "holds no checkpoint this run continues; choose an empty folder, or set "
        "trainer.overwrite=true to move its contents aside"
    )


def _check_resume_point(
    cfg: Config, out: Path, plan: NewRun, train_set: Mapping[str, Any]
) -> list[str]:
    """Refuse a checkpoint the config cannot resume (``check_resumable``); the lines that say
    what resuming it changes (its settings, the packages' versions), or that it resumes to
    export alone (none where neither)."""
    assert plan.resume_from is not None
    changed = check_resumable(
        plan.resume_from,
        config=cfg.model_dump(mode="json"),
        workers=cfg.trained_workers,
        total_steps=cfg.trainer.total_steps,
        train_set=train_set,
    )
    if plan.export_only:
        state = "incomplete" if (out / POLICY_FOLDER).exists() else "missing"
        return [
            f"{shown(str(plan.resume_from))} reached trainer.total_steps="
            f"{cfg.trainer.total_steps} but its policy export ({POLICY_FOLDER}) is {state} in "
            f"{shown(str(out))}: resuming to export it"
        ]
    notes = []
    if changed.settings:
        notes.append(
            f"resuming {plan.resume_from} with changed settings: {'; '.join(changed.settings)}"
        )
    if changed.versions:
        notes.append(
            f"resuming {plan.resume_from} under other package versions than it was written "
            f"with: {', '.join(changed.versions)}; its metrics may then differ from an "
            "uninterrupted run's"
        )
    return notes


@dataclass(frozen=True)
class FolderState:
    """What an output folder holds, as far as the contract above reads it."""

    checkpoints: tuple[Path, ...]  # complete, oldest first
    contents: bool  # anything but a run's lock file
    exported: bool  # the run's whole policy export (``policy_exported``)

    @classmethod
    def read(cls, out: Path) -> FolderState:
        """The folder's state now (an ``OSError`` where it cannot be read)."""
        return cls(tuple(complete_checkpoints(out)), _has_contents(out), policy_exported(out))


@dataclass(frozen=True)
class NewRun:
    """What ``verlite train`` of a config does with its output folder, by the contract above:
    :func:`prepare_output_folder` acts on it, :func:`stopped_run_hint` says it."""

    resume_from: Path | None = None  # the checkpoint it resumes from; None: the first step
    continuing: bool = False  # resume_from is the folder's own: its files stay
    export_only: bool = False  # resume_from is at trainer.total_steps: it exports, no more
    moves_aside: bool = False  # the folder's files are moved aside (trainer.overwrite=true)
    refused: UserError | None = None  # the one line it is refused with
    needs_overwrite: bool = False  # refused for the folder's files: overwrite moves them aside
    complete: bool = False  # refused: resume_from is at trainer.total_steps, the run whole


def new_run(out: Path, trainer: TrainerConfig | None, state: FolderState) -> NewRun:
    """What a new ``verlite train`` with the settings ``trainer`` does with the folder ``out``
    (its resolved path) in ``state``; ``trainer`` None: settings not known (then
    ``trainer.resume=auto``, no overwrite, the end not known). Whether the checkpoint fits
    the rest of the config (``check_resumable``) is not judged here: a stopped run's own does."""
    resume = "auto" if trainer is None else trainer.resume
    try:
        if resume == "auto":
            resume_from = state.checkpoints[-1] if state.checkpoints else None
            step = None if resume_from is None else checkpoint_step(resume_from)
        else:
            resume_from = resume_checkpoint(out, resume)  # None for disable
            step = None if resume_from is None else int(read_trainer_state(resume_from)["step"])
    except UserError as exc:  # no such checkpoint, or its state unreadable
        return NewRun(refused=exc)
    export_only = False
    continuing = resume_from is not None and _in_folder(resume_from, out)
    if resume_from is not None and trainer is not None and step == trainer.total_steps:
        # The export of the checkpoint's own run: this folder's, or the one of the folder
        # that holds another folder's checkpoint (an export in this folder is another run's).
        exported = state.exported if continuing else _exported_by_its_run(resume_from, step)
        if not trainer.export or exported:
            reached = _reached(out, trainer, step, resume_from, continuing=continuing)
            return NewRun(resume_from, continuing, refused=reached, complete=True)
        export_only = True
    if continuing or not state.contents:
        return NewRun(resume_from, continuing=continuing, export_only=export_only)
    if trainer is None or not trainer.overwrite:
        refused = _not_empty(out, str(out) if trainer is None else trainer.output_dir, resume)
        return NewRun(resume_from, export_only=export_only, refused=refused, needs_overwrite=True)
    return NewRun(resume_from, export_only=export_only, moves_aside=True)


def _spellings(checkpoint: Path) -> tuple[Path, Path]:
    """``checkpoint`` as named (absolute, ``..`` folded) and as it lies on disk (links
    followed): a ``checkpoints`` folder linked to a scratch disk is its run folder's own."""
    return Path(os.path.normpath(checkpoint.absolute())), checkpoint.resolve()


def _in_folder(checkpoint: Path, out: Path) -> bool:
    """Whether ``checkpoint`` is one of the folder ``out``'s (its resolved path): named under
    it, or lying in it, or one of the checkpoints in the folder its ``checkpoints`` links to
    (also where it is named through a link to ``out``): a ``step_N`` there, not a folder
    further down (that folder may be a scratch disk's, holding other runs' folders)."""
    linked = checkpoint_root(out).resolve()
    return any(path.is_relative_to(out) or path.parent == linked for path in _spellings(checkpoint))


def _its_runs_export(checkpoint: Path) -> Path:
    """Where the run that saved ``checkpoint`` (``<run>/checkpoints/step_N``, as named or
    as it lies) exports."""
    path = next((p for p in _spellings(checkpoint) if p.parent.name == "checkpoints"), None)
    return (path or checkpoint.resolve()).parent.parent / POLICY_FOLDER


def _exported_by_its_run(checkpoint: Path, step: int) -> bool:
    """Whether the run that saved ``checkpoint`` (another folder's, at ``step``) exported
    this checkpoint's policy: the run folder holding it has a whole export of that step
    (``exported_step``). A run continued past it exported a later step's policy, also one
    with trainer.save_freq=0, whose latest checkpoint stays this one."""
    return exported_step(_its_runs_export(checkpoint).parent) == step


def _reached(
    out: Path, trainer: TrainerConfig, step: int, resume_from: Path, *, continuing: bool
) -> CheckpointError:
    """The refusal of a checkpoint at ``trainer.total_steps`` whose policy is exported by its
    own run or not exported at all: the folder's own run is complete, or the checkpoint that
    ``trainer.resume`` names (another folder's) is, its own run having exported it."""
    if continuing:
        return CheckpointError(
            f"the run in {shown(str(out))} already reached trainer.total_steps={step} "
            f"(checkpoint {resume_from.name}); raise trainer.total_steps to train further, "
            "or choose another trainer.output_dir for a new run"
        )
    why = (
        f"its run exported its policy ({shown(str(_its_runs_export(resume_from)))})"
        if trainer.export
        else "trainer.export=false"
    )
    return CheckpointError(
        f"trainer.resume={shown(trainer.resume)}: that checkpoint is at trainer.total_steps="
        f"{step} and {why}, so this run would train and export nothing; raise "
        "trainer.total_steps to train further from it, or name another checkpoint in "
        "trainer.resume"
    )


@dataclass(frozen=True)
class FolderChange:
    """A change the run is about to make to its folder: made once any of ``marks`` exists
    (``present``) or once none does, leaving the folder's state ``made(state)``."""

    marks: tuple[Path, ...]
    present: bool
    made: Callable[[FolderState], FolderState]


def stopped_run_hint(
    output_dir: str | Path, trainer: TrainerConfig | None, change: FolderChange | None = None
) -> str:
    """What a new ``verlite train`` of a stopped run's folder with the same config does
    (:func:`new_run`; ``trainer``: the run's settings, None where they are not known), and,
    where it is refused, what to change: continue from a checkpoint, start from the first
    step (the folder's files moved aside with ``trainer.overwrite=true``), or nothing more to
    train. ``change``: as the folder will be once the run made it. A folder that cannot be read
    is said so, never raised: the hint ends a run that is stopping already. Masked
    (:func:`~verlite.redaction.redact_text`): the node watcher prints it outside the driver's
    masked streams."""
    out = Path(output_dir)
    try:
        state = FolderState.read(out)
        said = _what_a_new_run_does(out, trainer, state if change is None else change.made(state))
    except (OSError, RuntimeError) as exc:  # RuntimeError: pathlib's report of a link loop
        said = (
            f"{out} could not be read ({type(exc).__name__}: "
            f"{getattr(exc, 'strerror', None) or exc}): a new `verlite train` with "
            "trainer.resume=auto continues from its latest complete checkpoint, if it holds one"
        )
    return redact_text(said)


def tell_node_watcher(
    output_dir: str | Path, trainer: TrainerConfig, change: FolderChange | None = None
) -> None:
    """Tell the node watcher (``say_after_node_loss``) what a new run of the folder does;
    before the run makes ``change``, what it does once it is made too: the watcher looks at
    the change's marks when the node is lost, so a loss between the change and the next
    word names what the folder then holds."""
    # Here, not at the top: `verlite export`'s hint (stopped_run_hint) imports no Ray.
    from verlite.controller import say_after_node_loss

    now = stopped_run_hint(output_dir, trainer)
    if change is None:
        say_after_node_loss(now)
        return
    made = stopped_run_hint(output_dir, trainer, change)
    say_after_node_loss(now, once=(change.marks, change.present, made))


def _what_a_new_run_does(out: Path, trainer: TrainerConfig | None, state: FolderState) -> str:
    plan = new_run(out.resolve(), trainer, state)
    new = "a new `verlite train`"
    if plan.complete:
        assert trainer is not None and plan.resume_from is not None
        exported = ", its policy exported" if trainer.export else ""
        if trainer.export and not plan.continuing:  # another folder's checkpoint: its run's
            exported += f" in {_its_runs_export(plan.resume_from)}"
        return (
            f"the run is complete ({plan.resume_from} is at trainer.total_steps="
            f"{trainer.total_steps}{exported}): {new} of the same config is refused; a larger "
            "trainer.total_steps continues it, trainer.resume=disable with "
            "trainer.overwrite=true starts it over (its files moved aside)"
        )
    export = " to export its policy" if plan.export_only else ""
    if plan.refused is not None and not plan.needs_overwrite:
        said = f"{new} of the same config is refused: {plan.refused}"
    elif plan.continuing:
        how = (
            "trainer.resume=auto"
            if trainer is None or trainer.resume == "auto"
            else "its trainer.resume"
        )
        said = f"{new} with {how} continues from {plan.resume_from}{export}"
    elif plan.resume_from is not None:
        said = f"{new} of {out} resumes from {plan.resume_from} again{export}"
    else:
        said = f"{_why_first_step(trainer, state)}: {new} of {out} starts from the first step"
    if plan.moves_aside:
        said += ", moving this run's files aside (trainer.overwrite=true)"
    if plan.needs_overwrite:
        said += ", with trainer.overwrite=true to move this run's files aside"
    if trainer is not None and trainer.resume != "auto":  # what the default does instead
        auto = new_run(out.resolve(), trainer.model_copy(update={"resume": "auto"}), state)
        if auto.continuing and auto.refused is None and auto.resume_from != plan.resume_from:
            said += f"; with trainer.resume=auto it continues from {auto.resume_from}"
    return said


def _why_first_step(trainer: TrainerConfig | None, state: FolderState) -> str:
    if trainer is not None and trainer.resume == "disable" and state.checkpoints:
        return "trainer.resume=disable"
    save_freq = None if trainer is None else trainer.save_freq
    if save_freq == 0:
        return "no checkpoint saved (trainer.save_freq=0 saves none)"
    if save_freq is not None:
        return f"no checkpoint saved yet (trainer.save_freq={save_freq})"
    return "no checkpoint saved"


def _entries(out: Path) -> list[Path]:
    """What the folder holds besides a run's lock file, by name."""
    return sorted(p for p in out.iterdir() if not _is_lock_file(p)) if out.is_dir() else []


def _has_contents(out: Path) -> bool:
    return bool(_entries(out))


def _describe(out: Path, resume: str) -> str:
    """What the folder holds, in a few words."""
    if (out / "metrics.jsonl").is_file() or (out / "workers.json").is_file():
        if resume == "disable" and complete_checkpoints(out):
            return "a run with checkpoints, and trainer.resume=disable"
        return "an earlier run"
    entries = sorted(p.name for p in _entries(out))
    shown = ", ".join(entries[:3]) + (f" and {len(entries) - 3} more" if len(entries) > 3 else "")
    return f"it holds {shown}"


def _move_contents_aside(out: Path) -> Path:
    """Move what ``out`` holds, but the run's lock file, into a new sibling folder. A move
    that fails part-way is undone: what was moved goes back, and the new folder is removed."""
    target = _new_aside_folder(out)
    moved: list[str] = []
    for entry in _entries(out):
        try:
            os.rename(entry, target / entry.name)
        except OSError as exc:
            undone = _move_back(moved, target, out)
            raise ConfigError(
                f"trainer.overwrite=true: cannot move {shown(str(entry))} aside to "
                f"{shown(str(target))}: {exc.strerror or exc}; {undone}"
            ) from None
        moved.append(entry.name)
    return target


def _new_aside_folder(out: Path) -> Path:
    """A new, empty ``<name>.replaced-<UTC time>[-N]`` folder beside ``out``; one that exists
    (or a link by that name) is never reused."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    for suffix in range(1, 1000):
        target = out.with_name(
            f"{out.name}.replaced-{stamp}" + (f"-{suffix}" if suffix > 1 else "")
        )
        try:
            target.mkdir()
            return target
        except FileExistsError:
            continue
        except OSError as exc:
            raise ConfigError(
                f"trainer.overwrite=true: cannot create {shown(str(target))} to move the "
                f"contents of {shown(str(out))} aside: {exc.strerror or exc}; nothing was moved"
            ) from None
    raise ConfigError(
        f"trainer.overwrite=true: 999 folders {out.name}.replaced-{stamp}-N exist already; "
        "nothing was moved"
    )


def _move_back(moved: list[str], target: Path, out: Path) -> str:
    """Undo a move aside that failed part-way: the entries named in ``moved`` back from
    ``target`` into ``out``, and ``target`` removed; what the one line says about it."""
    stuck = []
    for name in reversed(moved):
        try:
            os.rename(target / name, out / name)
        except OSError:
            stuck.append(name)
    if not stuck:
        target.rmdir()
        return f"nothing was moved ({shown(str(out))} is as it was)"
    return (
        f"{len(stuck)} entries could not be moved back and are in {shown(str(target))}: "
        f"{', '.join(sorted(stuck))}; the rest are in {shown(str(out))}"
    )


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
