"""A training run on the driver, from checked inputs to the exported policy.

``verlite train`` calls :func:`run_training`: it reads and checks everything it can before Ray
starts (:class:`~verlite.driver.preflight.RunInputs`), opens the Ray session, and :func:`run` places
the run's worker groups (:func:`start_groups`), hands them to the
:class:`~verlite.driver.trainer.Trainer`, and takes them down again; when a worker or node is lost
it restarts them, up to ``trainer.max_restarts`` times, from the latest checkpoint
(docs/design.md, "Restarts"). Tests and benchmarks call :func:`run` and
:func:`start_groups` inside a Ray session they share.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import ray
from transformers import PreTrainedTokenizerBase

from verlite.config import Config
from verlite.config.derived import precision_warning
from verlite.config.inert import inert_settings_line
from verlite.controller import (
    PLACEMENT_FILES,
    WorkerGroup,
    WorkerGroupError,
    lost_embedded_node,
    other_versions,
    ray_session,
    run_pools,
    write_placement_report,
)
from verlite.driver.checkpoint import DamagedCheckpointError, complete_checkpoints
from verlite.driver.output_folder import (
    FolderChange,
    FolderState,
    stopped_run_hint,
    tell_node_watcher,
)
from verlite.driver.preflight import RunInputs, check_placement
from verlite.driver.trainer import RunGroups, Trainer
from verlite.errors import RunFailure, UserError
from verlite.workers.actor import ActorWorker
from verlite.workers.critic import CriticWorker
from verlite.workers.reward_model import RewardModelWorker
from verlite.workers.rollout import RolloutWorker


@contextlib.contextmanager
def start_groups(cfg: Config, tokenizer: PreTrainedTokenizerBase) -> Iterator[RunGroups]:
    """Place the run's pools in the open Ray session, start a group per role with its model
    built, and on leaving shut the groups down and release the pools."""
    pools = run_pools(cfg)
    run_id = uuid.uuid4().hex[:8]
    common = {"cfg": cfg, "vocab_size": len(tokenizer)}
    tokens = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    role_kwargs = {
        "actor": (ActorWorker, tokens),
        "critic": (CriticWorker, {}),
        "rollout": (RolloutWorker, tokens),
        "reward": (RewardModelWorker, {}),
    }
    started: dict[str, WorkerGroup] = {}
    graceful = False
    try:
        for role, (pool, share) in pools.items():
            worker_cls, kwargs = role_kwargs[role]
            started[role] = WorkerGroup(
                role,
                worker_cls,
                pool,
                share=share,
                worker_kwargs={**common, **kwargs},
                torch_threads=cfg.trainer.torch_threads_per_worker,
                run_id=run_id,
                join=False,  # every group's processes start (import torch) side by side
            )
        for group in started.values():
            group.join()
        # One group's model after another: each builds its model on the host first (a 7B
        # policy is ~30 GB in float32, its reference a copy), and groups of one node side by
        # side would hold those peaks at once.
        for group in started.values():
            group.call("init_model", dispatch="broadcast", collect="list")
        yield RunGroups(
            actor=started["actor"],
            critic=started.get("critic"),
            rollout=started.get("rollout"),
            reward_model=started.get("reward"),
        )
        graceful = True
    finally:
        # After any failure, ranks may wait on a lost peer: they are killed without waiting.
        for group in started.values():
            group.shutdown(graceful=graceful)
        for pool in {id(pool): pool for pool, _ in pools.values()}.values():
            pool.remove()


def run(cfg: Config, inputs: RunInputs) -> Path:
    """One whole run in the open Ray session: place the groups, resume when a checkpoint was
    found, train to ``trainer.total_steps``, export the policy; the output folder.

    A lost worker or node (:attr:`WorkerGroupError.lost`) restarts the run from its latest
    checkpoint, up to ``trainer.max_restarts`` times; any other failure ends it."""
    output_dir = Path(cfg.trainer.output_dir)
    limit = cfg.trainer.max_restarts
    if limit and not cfg.trainer.save_freq:
        print(
            f"trainer.max_restarts={limit} with trainer.save_freq=0: a restart trains again "
            "from the first step",
            flush=True,
        )
    resume_from, restarts = inputs.resume_from, 0
    saved: list[Path] = []  # the checkpoints this run saved, oldest first
    tell_node_watcher(output_dir, cfg.trainer)
    try:
        while True:
            try:
                _attempt(cfg, inputs, resume_from, restarts, saved)
                return output_dir
            except WorkerGroupError as err:
                if not err.lost:
                    raise
                if (gone := lost_embedded_node()) is not None:
                    raise RunFailure(f"{gone}, so nothing can restart in it: {err}") from err
                if restarts == limit:
                    if not limit:
                        raise
                    spent = f"{limit} restart{'s' if limit > 1 else ''}"
                    raise RunFailure(
                        f"{err} (after {spent}; trainer.max_restarts={limit})"
                    ) from err
                restarts += 1
                # This run's own latest checkpoint: the folder may hold later ones of a run
                # this one resumed from an earlier step.
                resume_from = next(
                    (p for p in reversed(saved) if p in complete_checkpoints(output_dir)),
                    inputs.resume_from,
                )
                print(
                    f"restart {restarts} of {limit} (trainer.max_restarts): {err}; the groups "
                    f"torn down {time.monotonic() - err.detected_at:.1f} s after it was seen; "
                    f"resuming from {resume_from or 'the first step (no checkpoint yet)'}",
                    flush=True,
                )
    except DamagedCheckpointError:  # says what to resume instead: a new run resumes it again
        raise
    # A worker died, the run diverged, a service stays down, ...; or bad input found as the
    # run meets it (a reward function's value, an environment that breaks its contract).
    except (RunFailure, UserError) as err:
        err.then(stopped_run_hint(output_dir, cfg.trainer))
        raise
    except (KeyboardInterrupt, SystemExit):  # Ctrl-C; SIGTERM (`verlite stop`, a preemption)
        print(f"stopped: {stopped_run_hint(output_dir, cfg.trainer)}", flush=True)
        raise
    finally:
        inputs.folder.release()


def _attempt(
    cfg: Config, inputs: RunInputs, resume_from: Path | None, restarts: int, saved: list[Path]
) -> None:
    """Place the groups, resume from ``resume_from`` (None: the first step), train (recording
    each checkpoint in ``saved``), export; after a restart, say how long the groups took to
    place and the checkpoint to load."""
    started = time.perf_counter()
    with start_groups(cfg, inputs.tokenizer) as groups:
        placed = time.perf_counter()
        # The folder holds the run's files from the placement report on.
        out = Path(cfg.trainer.output_dir)
        files = tuple(out / name for name in PLACEMENT_FILES)
        tell_node_watcher(out, cfg.trainer, FolderChange(files, True, _with_contents))
        print(write_placement_report(groups.all, out), flush=True)
        placed_workers = [w for g in groups.all for w in g.placement()]
        if (foreign := other_versions(placed_workers, lora=cfg.actor.lora.rank > 0)) is not None:
            print(foreign, flush=True)
        tell_node_watcher(out, cfg.trainer)
        trainer = Trainer(cfg, inputs, groups=groups, restarts=restarts, saved=saved)
        start = trainer.resume(resume_from) if resume_from else 0
        if restarts:
            print(
                f"restart {restarts}: training again from step {start + 1} after "
                f"{time.perf_counter() - started:.1f} s (place and start the workers "
                f"{placed - started:.1f} s, load the checkpoint {time.perf_counter() - placed:.1f} s)",
                flush=True,
            )
        trainer.fit(start)
        if cfg.trainer.export:
            trainer.export_policy()


def _with_contents(state: FolderState) -> FolderState:
    return dataclasses.replace(state, contents=True)


def prepare_run(cfg: Config, *, in_session: bool, cpus: int | None = None) -> RunInputs:
    """What a run checks, says and reads before its workers start: the lines on settings it
    ignores or that lose updates (said once every check passed), the workers' fit where they
    will run (``in_session``: the Ray session this process has open; else an embedded one of
    ``cpus`` CPUs, None: the machine's, or ``trainer.ray_address``), and its inputs
    (:class:`RunInputs`). Called before that session opens, where it is not open yet: bad
    input fails in one line before Ray starts."""
    said = (inert_settings_line(cfg), precision_warning(cfg))
    check_placement(cfg, in_session=in_session, cpus=cpus)
    return RunInputs.load(cfg, [line for line in said if line is not None])


def run_training(cfg: Config) -> Path:
    """``verlite train`` and ``verlite.train``: the inputs checked before Ray starts, then
    :func:`run` in a Ray session of its own (embedded, or a connection to
    ``trainer.ray_address``), or in the one this process opened before (a notebook's)."""
    joined = ray.is_initialized()
    if joined and cfg.trainer.ray_address is not None:
        raise UserError(
            f"trainer.ray_address={cfg.trainer.ray_address!r}: this process is already "
            "connected to a Ray session; leave trainer.ray_address unset to train in it, "
            "or call ray.shutdown() first"
        )
    inputs = prepare_run(cfg, in_session=joined)
    if joined:
        return run(cfg, inputs)
    with ray_session(cfg.trainer.ray_address):
        return run(cfg, inputs)
