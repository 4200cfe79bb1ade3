"""Atomic checkpoints of a run: the folder layout, finding the one to resume, pruning.

``<output_dir>/checkpoints/step_N/`` holds everything needed to continue after step N:

    actor/, critic/        each worker group's model + optimizer (DCP, one shard per rank),
                           LR schedule, the streak of skipped updates (``engine_state.json``),
                           and one RNG file per rank
    trainer_state.json     the driver's state: step, data position, KL coefficient, the
                           settings the weights were built with, the identity of the
                           base model's weight files (``model.path``; ``base_weights``),
                           and the versions of the packages that shape the numbers
                           (``versions``: ``verlite.package_versions``)
    generated_ahead.pt     with rollout.max_staleness >= 1: the batches generated ahead by
                           older weights, those whose generation completed
                           (``StepSource.save_ahead``)

A checkpoint is written into ``step_N.tmp/`` and renamed to ``step_N`` only when complete,
so a crash while saving leaves the previous checkpoint valid and the partial one ignored
(and removed by the next save); its files are flushed to the disk before the rename, so a
crash of the machine does too (on this machine's disk: a network file system's other
clients flush their own writes when they close them). Workers write directly into the folder, so on a
multi-node cluster ``trainer.output_dir`` must be on storage every node can see.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from verlite.base_weights import differences
from verlite.checkpoint_files import (
    ENGINE_FILES,
    ENGINE_STATE,
    RNG_FILE,
    SCHEDULE,
    TRAIN_STATE,
)
from verlite.config import MOVED_KEYS, flatten, recorded_config, relative_path_hint
from verlite.config.inert import without_effect
from verlite.errors import UserError, shown
from verlite.package_versions import MODEL_PACKAGES, unversioned, version_changes
from verlite.redaction import redact_config
from verlite.user_files import check_readable, parse_json, read_text

STEP_DIR = re.compile(r"^step_(\d+)$")
TRAINER_STATE = "trainer_state.json"


class CheckpointError(UserError):
    """A checkpoint named for resuming is missing or incomplete."""


class DamagedCheckpointError(CheckpointError):
    """A checkpoint whose files are damaged: its message names them and says what to resume
    instead (:func:`resume_instead`), where a new run of its folder would resume it again."""


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Finished checkpoints, oldest first (``step_N.tmp`` folders never count)."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = [
        (int(m[1]), p)
        for p in root.iterdir()
        if (m := STEP_DIR.match(p.name)) and (p / TRAINER_STATE).is_file()
    ]
    return [p for _, p in sorted(found)]


def checkpoint_step(path: Path) -> int:
    """The step of a checkpoint of a run's own folder (``step_N``), by its name."""
    found = STEP_DIR.match(path.name)
    if found is None:
        raise ValueError(f"{path} is not named as a checkpoint (step_N)")
    return int(found[1])


def placed_path(tmp: Path) -> Path:
    """Where :func:`commit_checkpoint` puts the checkpoint written into ``tmp``."""
    return tmp.with_name(tmp.name.removesuffix(".tmp"))


def resume_checkpoint(output_dir: str | Path, resume: str) -> Path | None:
    """The checkpoint ``trainer.resume`` asks for: ``auto`` (latest complete, if any),
    ``disable`` (none), or a path to a ``step_N`` folder."""
    if resume == "disable":
        return None
    if resume == "auto":
        done = complete_checkpoints(output_dir)
        return done[-1] if done else None
    path = Path(resume)
    if not path.exists():  # a typo, or a checkpoint pruned since (trainer.max_checkpoints)
        raise CheckpointError(
            f"trainer.resume={shown(resume)}: no such folder{relative_path_hint(resume)}; give a "
            "checkpoint folder (<trainer.output_dir>/checkpoints/step_N), auto or disable"
        )
    if not path.is_dir():
        raise CheckpointError(
            f"trainer.resume={shown(resume)}: not a folder; give a checkpoint folder "
            "(<trainer.output_dir>/checkpoints/step_N), auto or disable"
        )
    if not (path / TRAINER_STATE).is_file():
        raise CheckpointError(
            f"trainer.resume={shown(resume)}: not a complete checkpoint (no {TRAINER_STATE} in it)"
        )
    return path


def resolved_resume(resume: str) -> str:
    """``trainer.resume`` as :func:`resume_checkpoint` reads it here: ``auto`` and
    ``disable`` as they are, a checkpoint's path made absolute (a relative one is this
    process's current folder's, which a later reader of the run's record does not share)."""
    return resume if resume in ("auto", "disable") else str(Path(resume).absolute())


# Settings that must be the same to resume: the model's shape (its precision may change: weights
# convert), and what the data position of the checkpoint counts in (the prompts and their
# order), and the adapters a LoRA checkpoint holds (its shapes, their scale, the layers they
# apply to; the base is rebuilt from the model settings and the seed), and each role's
# optimizer (its saved state is that optimizer's: AdamW's moments are not SGD's). The run's
# place may change freely; any other change is allowed and reported in one line (an
# optimizer's settings then apply from the resumed step: ``TrainEngine.load``; a new
# ``trainer.total_steps`` moves the end a cosine schedule decays to).
# A setting of these that both configs leave without effect (its feature off in both:
# ``verlite.config.inert``; a built-in model's shape under ``model.path``, ``actor.lora.alpha``
# at ``actor.lora.rank=0``) was never part of what the checkpoint holds: it may change, reported.
# model.device too, reported: model.precision=auto resolves by the device (fp32 on the CPU,
# bf16-mixed on cuda), so moving the run changes its arithmetic.
_MAY_CONVERT = {"model.dtype", "model.precision", "model.device"}
_MUST_MATCH = (
    "model.",
    "data.",
    "trainer.seed",
    "actor.lora.rank",
    "actor.lora.alpha",
    "actor.lora.target_modules",
    "actor.optim.name",
    "critic.optim.name",
)
# Lists of names whose order means nothing (peft adapts the layers a list names in the
# model's order): the same names in another order are the same setting.
_UNORDERED = {"actor.lora.target_modules"}
# Settings added after checkpoints were first written, as those older checkpoints ran them.
_PREDATED = {"actor.lora.rank": 0, "data.chat_template_kwargs": {}, "model.vocab_size": None}
_FREE = {
    "model.logits_chunk_tokens",  # how log-probs are computed, not what: a memory setting
    "model.attention_crossover",  # how packed rows are balanced: this machine's measurement
    "data.val_file",
    "data.num_val_samples",  # the held-out prompts (training prompts it moves: refused below)
    "trainer.output_dir",
    "trainer.resume",
    "trainer.overwrite",
    "trainer.loggers",
    "trainer.ray_address",
    "trainer.mlflow_tracking_uri",
    "trainer.resource_timeout_s",
}


def _same(key: str, there: Any, here: Any) -> bool:
    if key in _UNORDERED and isinstance(there, list | tuple) and isinstance(here, list | tuple):
        return sorted(map(str, there)) == sorted(map(str, here))
    return bool(there == here)


class ResumeChanges(NamedTuple):
    """What resuming a checkpoint changes that it may: settings (``"actor.optim.lr: 0.001 ->
    0.0005"``), and the versions of the packages that shape the numbers
    (``"torch 2.11.0 -> 2.13.0"``: the resumed run's metrics may then differ from an
    uninterrupted run's)."""

    settings: list[str]
    versions: list[str]


def check_resumable(
    path: Path,
    *,
    config: Mapping[str, Any],
    workers: Mapping[str, int],
    total_steps: int,
    train_set: Mapping[str, Any],
) -> ResumeChanges:
    """Before any worker starts: the checkpoint holds complete weights for every role
    (``workers``: each trained role's workers, ``Config.trained_workers``) and files that
    show no damage (:func:`damage`), a step the run has not passed, and was written under
    settings this run may continue, over the base weights ``model.path`` still holds (the
    reference policy and a LoRA policy's base are loaded from there, not from the
    checkpoint), and over the training prompts whose ``PromptDataset.fingerprint`` is
    ``train_set`` (its data position counts in their order; checkpoints from before this was
    recorded pass). Returns the settings that changed but may, and the packages' versions
    that changed since it was written, where it recorded them (:class:`ResumeChanges`)."""
    try:
        state = read_trainer_state(path)
    except CheckpointError as err:
        raise DamagedCheckpointError(
            f"cannot resume from {path}: {err}. {resume_instead(path, workers)}"
        ) from None
    step = int(state["step"])
    if step > total_steps:
        raise CheckpointError(
            f"trainer.total_steps={total_steps} but the checkpoint to resume, {path}, is at step "
            f"{step}; raise trainer.total_steps, or use trainer.resume=disable or another "
            "trainer.output_dir for a new run"
        )
    changes = setting_changes(state, config)
    blocking = [
        f"{key}={change.there!r} there, {change.here!r} here"
        for key, change in changes.items()
        if change.effective
        and key.startswith(_MUST_MATCH)
        and key not in _MAY_CONVERT
        and key not in _FREE
    ]
    missing = [role for role in workers if not (path / role).is_dir()]
    damaged = damage(path, {role: n for role, n in workers.items() if role not in missing})
    # As the checkpoint recorded it: credentials masked.
    base = flatten(redact_config(config)).get("model.path")
    recorded = state.get("base_weights")
    if (
        base is not None
        and isinstance(recorded, dict)
        and (changed_base := differences(recorded, base))
    ):
        blocking.append(
            f"model.path={base!r} no longer holds the base weights it was trained over "
            f"({', '.join(changed_base)})"
        )
    if blocking or missing:
        problems = blocking + [f"no {role} weights" for role in missing] + damaged
        raise CheckpointError(
            f"cannot resume from {path}: {'; '.join(problems)}. Use trainer.resume=disable or "
            "another trainer.output_dir for a new run"
        )
    if damaged:
        raise DamagedCheckpointError(
            f"cannot resume from {path}: {'; '.join(damaged)}. {resume_instead(path, workers)}"
        )
    saved_set = state.get("train_set")
    if saved_set is not None and saved_set != train_set:
        raise CheckpointError(
            f"cannot resume from {path}: the training prompts differ from those it trained on "
            f"({saved_set['records']} records of sha256 {saved_set['sha256'][:12]} there, "
            f"{train_set['records']} of {train_set['sha256'][:12]} here), so its data position "
            "would continue another order; restore data.train_file, or use "
            "trainer.resume=disable or another trainer.output_dir for a new run"
        )
    return ResumeChanges(
        settings=[
            f"{key}: {change.there!r} -> {change.here!r}"
            for key, change in changes.items()
            if key not in _FREE
        ],
        versions=version_changes(state.get("versions", {})),
    )


def mismatch_error(
    message: str,
    path: Path,
    state: Mapping[str, Any],
    *,
    model_path: str | None,
    workers: Mapping[str, int],
    readers: Sequence[Mapping[str, str]],
) -> CheckpointError:
    """The error that stops a resume whose workers' load (``message``) read the checkpoint at
    ``path``, of trainer ``state`` recording its whole config, as another model's
    (``MismatchedFileError``), though start-up found every setting that shapes the model as it
    recorded them. ``readers``: the package versions of the workers that read it (each one's
    placement ``versions``; a worker may run other packages than the driver). Where a package
    that may name or shape a model's values otherwise (``MODEL_PACKAGES``) is at another
    version there than it recorded: that, the files possibly whole. Else damage
    (:func:`resume_instead`), beside what no record of it covers: ``model.path``'s
    ``config.json`` where the model is read from there, and verlite or transformers where
    their versions do not tell their code apart (``unversioned``)."""
    recorded = state.get("versions", {})
    hint = resume_instead(path, workers)
    model_recorded = {k: v for k, v in recorded.items() if k in MODEL_PACKAGES}
    changed = _readers_changes(model_recorded, readers)
    if changed:
        return CheckpointError(
            f"{message}; it was written under other package versions ({', '.join(changed)}), "
            "whose model classes may name its values otherwise: resume it under those "
            f"versions; if it reads so there too, its files are damaged. {hint}"
        )
    unseen = unversioned(recorded, ("verlite", "transformers"), readers)
    if model_path is not None:
        unseen.append("model.path's config.json")
    other_causes = f" (or {' or '.join(unseen)} changed since it was written)" if unseen else ""
    # The same versions, where it recorded them and none changed (another torch or
    # tokenizers, said at start-up, names no model's values but is not "these" versions).
    same = (
        " and these package versions"
        if recorded and not _readers_changes(recorded, readers)
        else ""
    )
    return DamagedCheckpointError(
        f"{message}; it was written under this config's model settings{same}, so its files "
        f"are damaged{other_causes}. {hint}"
    )


def _readers_changes(
    recorded: Mapping[str, str], readers: Sequence[Mapping[str, str]]
) -> list[str]:
    """The packages of ``recorded`` at another version in any of ``readers``, each change
    once, in the order first found (``version_changes``)."""
    return list(dict.fromkeys(c for here in readers for c in version_changes(recorded, here)))


def damage(path: Path, workers: Mapping[str, int]) -> list[str]:
    """What the files of the checkpoint at ``path`` show to be damaged, or unreadable, for a
    resume by ``workers`` (each role's workers; folders it holds), before any worker reads
    them, each naming the file: the driver's state (:func:`read_trainer_state`), an engine
    file missing, its LR schedule or skip streak not what the engine reads, a shard the DCP
    index names missing or shorter than the index reads (``sharded_state.shard_problems``),
    the random state of a rank the resume has not what a worker restores
    (``rng_state.read_rng_states``; a rank past the resume's workers is never read). An I/O
    error of the machine's reading one (``user_files.check_readable``) raises ``RunFailure``."""
    # Here, not at the top: DCP's imports, which `verlite export`'s use of this module (the
    # hint of a stopped run, output_folder) does not need.
    from verlite.distributed.rng_state import read_rng_states
    from verlite.distributed.sharded_state import CheckpointLoadError, shard_problems

    found = []
    try:
        read_trainer_state(path)
    except CheckpointError as err:
        found.append(str(err))
    for role, ranks in workers.items():
        folder = path / role
        absent = [name for name in ENGINE_FILES if not (folder / name).is_file()]
        found += [f"{role}/{name} is missing" for name in absent]
        for name, problems in _ENGINE_JSON.items():
            if (folder / name).is_file():
                try:
                    value = _json_file(folder / name, named=f"{role}/{name}")
                except CheckpointError as err:
                    found.append(str(err))
                    continue
                if wrong := problems(value):
                    found.append(f"{role}/{name} is damaged: {'; '.join(wrong)}")
        if not absent:
            index = folder / TRAIN_STATE
            try:
                found += [f"{role}/{TRAIN_STATE}/{p}" for p in shard_problems(index)]
            except OSError as exc:
                found.append(
                    _unreadable(exc, index / ".metadata", f"{role}/{TRAIN_STATE}/.metadata")
                )
        # Each rank restores its own file, where there is one (``TrainingWorker``).
        for rng in [folder / RNG_FILE.format(rank=rank) for rank in range(ranks)]:
            try:
                if rng.is_file():
                    read_rng_states(rng)
            except CheckpointLoadError as exc:
                found.append(f"{role}/{rng.name} {exc}")
            except OSError as exc:
                found.append(_unreadable(exc, rng, f"{role}/{rng.name}"))
    return found


def _unreadable(exc: OSError, file: Path, named: str) -> str:
    """A checkpoint file that reading failed: raises ``RunFailure`` where the machine is at
    fault (an I/O error: no damage, try again), else says so (a file this user may not read)."""
    check_readable(exc, file, what="checkpoint file")
    return f"{named} cannot be read ({exc.strerror or exc})"


def _schedule_problems(state: dict[str, Any]) -> list[str]:
    """What LambdaLR's ``load_state_dict`` and the steps after it need of its saved state
    that ``state`` lacks (its other fields the engine sets from the config on load)."""
    lambdas = state.get("lr_lambdas")
    return [
        *(
            f"{key!r} is not a whole number >= 0"
            for key in ("last_epoch", "_step_count")
            if not _is_count(state.get(key))
        ),
        *(
            ["'lr_lambdas' is not a list of nulls"]
            if not (isinstance(lambdas, list) and all(fn is None for fn in lambdas))
            else []
        ),
    ]


def _engine_state_problems(state: dict[str, Any]) -> list[str]:
    if _is_count(state.get("nonfinite_streak")):
        return []
    return ["'nonfinite_streak' is not a whole number >= 0"]


# A role's JSON files and what each must hold for the engine's load to read it.
_ENGINE_JSON = {SCHEDULE: _schedule_problems, ENGINE_STATE: _engine_state_problems}


def resume_instead(path: Path, workers: Mapping[str, int]) -> str:
    """What a run does instead of resuming the damaged checkpoint at ``path``: resume the
    latest earlier checkpoint of its run's folder that shows no damage, or start afresh."""
    found = STEP_DIR.match(path.name)
    earlier = (
        [p for p in complete_checkpoints(path.parent.parent) if checkpoint_step(p) < int(found[1])]
        if found is not None and path.parent.name == "checkpoints"
        else []
    )
    whole = next((p for p in reversed(earlier) if not damage(p, workers)), None)
    afresh = (
        "start afresh with trainer.resume=disable and trainer.overwrite=true (which moves the "
        "output folder's files aside)"
    )
    if whole is None:
        return f"No earlier checkpoint of its run is whole: {afresh}"
    return f"Resume from an earlier one with trainer.resume={whole.absolute()}, or {afresh}"


class SettingChange(NamedTuple):
    """A setting's value in a checkpoint's config (``there``) and in the resuming run's
    (``here``); ``effective``: it takes effect in one of them at least (a setting without
    effect in both, its feature off, ``verlite.config.inert``, was no part of what the
    checkpoint holds)."""

    there: Any
    here: Any
    effective: bool


def setting_changes(
    state: Mapping[str, Any], config: Mapping[str, Any]
) -> dict[str, SettingChange]:
    """The settings of ``config`` (the resuming run's, ``Config.model_dump(mode="json")``)
    that differ from those the checkpoint's trainer ``state`` recorded, by flat key, in key
    order. Checkpoints record the whole config with its credentials masked (``config`` is
    compared so; older ones under keys that moved since, read under their new names); the
    oldest only the model settings."""
    here = flatten(redact_config(config))
    there = (
        {**_PREDATED, **{MOVED_KEYS.get(k, k): v for k, v in flatten(state["config"]).items()}}
        if "config" in state
        else flatten({"model": state.get("model", {})})
    )
    changed = sorted(
        key for key in there.keys() & here.keys() if not _same(key, there[key], here[key])
    )
    configs = [recorded_config(there), recorded_config(here)]
    return {
        key: SettingChange(
            there[key],
            here[key],
            not all(cfg is not None and without_effect(cfg, key) for cfg in configs),
        )
        for key in changed
    }


def remove_folder(path: Path, *, ignore_errors: bool = False) -> None:
    """Remove a folder of the run's (a checkpoint, the policy export), or a link by its name:
    the link alone, never what it points to, which may be someone's, outside the output
    folder (``shutil.rmtree`` refuses a link, which ended the run)."""
    if not path.is_symlink():
        shutil.rmtree(path, ignore_errors=ignore_errors)
        return
    try:
        path.unlink()
    except OSError:
        if not ignore_errors:
            raise


def clear_folder(path: Path) -> None:
    """Make way at ``path`` for a new folder of the run's (its policy export): a folder
    removed; a link to one written through, as a linked output folder or ``checkpoints/`` is:
    the folder it leads to emptied (an entry that is a link removed as a link), or made where
    the link leads nowhere yet. Before the run, ``output_folder.prepare_output_folder``
    refused a linked folder that holds files of someone's."""
    if not path.is_symlink():
        remove_folder(path)
        return
    target = path.resolve()
    target.mkdir(parents=True, exist_ok=True)
    for entry in target.iterdir():
        if entry.is_dir():
            remove_folder(entry)
        else:
            entry.unlink()


def begin_checkpoint(output_dir: str | Path, step: int) -> Path:
    """A fresh, empty ``step_N.tmp`` folder to write into."""
    tmp = checkpoint_root(output_dir) / f"step_{step}.tmp"
    if os.path.lexists(tmp):
        remove_folder(tmp)
    tmp.mkdir(parents=True)
    return tmp


def seal_checkpoint(tmp: Path, trainer_state: dict[str, Any]) -> None:
    """Flush what the workers wrote into ``tmp`` to the disk, then write the driver state,
    which vouches for it, last: all of a save's cost but the rename (:func:`commit_checkpoint`),
    so that the step's metrics, logged before that rename, can count it."""
    _sync_tree(tmp)  # what the workers wrote is on disk before the state that vouches for it
    state_file = tmp / TRAINER_STATE
    state_file.write_text(json.dumps(trainer_state, indent=1))
    _sync(state_file)


def commit_checkpoint(tmp: Path, *, keep: int) -> Path:
    """Rename a sealed ``tmp`` (:func:`seal_checkpoint`) into place, drop old checkpoints.

    The rename comes after the step's metrics are logged: a checkpoint in place is of a step
    every sink holds, so a run resumed from it logs each step once.

    Checkpoints of later steps than this one are of the run this one resumed before (a
    ``trainer.resume`` path of an earlier step): the resumed run dropped their records from
    ``metrics.jsonl`` and trains those steps again, so they go, and this one is the latest,
    which ``trainer.resume=auto`` continues and ``keep`` never prunes."""
    final = placed_path(tmp)
    # The run this one resumed before saved this step (an earlier one stays), or its name is
    # a link leading nowhere, which the rename of a folder would not replace.
    if os.path.lexists(final):
        _discard(final)
    os.replace(tmp, final)
    _sync(final.parent)  # the rename itself
    for stale in tmp.parent.glob("step_*.tmp"):  # partial saves of runs that crashed
        remove_folder(stale, ignore_errors=True)
    done = complete_checkpoints(tmp.parent.parent)
    mine = done.index(final)
    later = done[mine + 1 :]
    if later:
        print(
            f"removed the checkpoints of the run this one resumed before, past step "
            f"{final.name.removeprefix('step_')}: {', '.join(p.name for p in later)}",
            flush=True,
        )
    for old in later + done[: mine + 1][:-keep]:
        _discard(old)
    return final


def _sync(path: Path) -> None:
    """Flush a file's or a folder's (its entries') writes to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync_tree(folder: Path) -> None:
    """Flush every file and folder under ``folder``, itself included: after a crash of the
    machine (not only of the process) a checkpoint that is in place holds what was written,
    not files the disk never received."""
    for root, _, files in os.walk(folder):
        for name in files:
            _sync(Path(root, name))
        _sync(Path(root))


def _discard(checkpoint: Path) -> None:
    """Remove a checkpoint folder, first renamed out of the way (``step_N.discarded.tmp``, which
    no resume takes and the next save removes): a crash while deleting it leaves no partial
    ``step_N`` that its ``trainer_state.json`` would pass for complete."""
    aside = checkpoint.with_name(f"{checkpoint.name}.discarded.tmp")
    remove_folder(aside, ignore_errors=True)
    os.replace(checkpoint, aside)
    remove_folder(aside)


def read_trainer_state(path: Path) -> dict[str, Any]:
    """The driver's state saved with the checkpoint at ``path``, its fields checked."""
    state = _json_file(path / TRAINER_STATE)
    step, kl_coef = state.get("step"), state.get("kl_coef")
    # What a resume reads, each when the checkpoint has it (older ones lack some).
    mappings: list[str] = [key for key in ("config", "model") if key in state]
    versions = state.get("versions", {})
    if state.get("base_weights") is not None:  # None: the built-in model's run
        mappings.append("base_weights")
    train_set = state.get("train_set")
    problems = [
        *(["'step' is not a whole number >= 0"] if not _is_count(step) else []),
        *(["'kl_coef' is not a number"] if not _is_number(kl_coef) else []),
        *(["'loader' is not a mapping"] if not isinstance(state.get("loader"), dict) else []),
        *(f"'{key}' is not a mapping" for key in mappings if not isinstance(state[key], dict)),
        *(
            ["'train_set' is not a mapping of 'records' (a count) and 'sha256' (text)"]
            if train_set is not None
            and not (
                isinstance(train_set, dict)
                and _is_count(train_set.get("records"))
                and isinstance(train_set.get("sha256"), str)
            )
            else []
        ),
        *(
            ["'versions' is not a mapping of package names to versions (text)"]
            if not (
                isinstance(versions, dict) and all(isinstance(v, str) for v in versions.values())
            )
            else []
        ),
    ]
    if problems:
        raise CheckpointError(f"{path / TRAINER_STATE} is damaged: {'; '.join(problems)}")
    return state


def _json_file(path: Path, *, named: str | None = None) -> dict[str, Any]:
    """A JSON object the checkpoint holds; a missing or damaged file is one line naming it
    (as ``named``, or by its path)."""
    text = read_text(path, what="checkpoint file", error=CheckpointError)
    named = str(path) if named is None else named
    value = parse_json(text, f"{named} is damaged", error=CheckpointError)
    if not isinstance(value, dict):
        raise CheckpointError(f"{named} is damaged: a {type(value).__name__}, not a JSON object")
    return value


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
