"""A training run on the driver, from checked inputs to the exported policy.

``verlite train`` calls :func:`train`: it reads and checks everything it can before Ray
starts (:class:`~verlite.trainer.RunInputs`), opens the Ray session, and :func:`run` places
the run's worker groups (:func:`start_groups`), hands them to the
:class:`~verlite.trainer.Trainer`, and takes them down again. Tests and benchmarks call
:func:`run` and :func:`start_groups` inside a Ray session they share.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from verlite.config import Config
from verlite.controller import (
    WorkerGroup,
    check_fits_machine,
    ray_session,
    run_pools,
    write_placement_report,
)
from verlite.trainer import RunInputs, Trainer
from verlite.workers.actor import ActorWorker
from verlite.workers.critic import CriticWorker
from verlite.workers.rollout import RolloutWorker


@dataclass(frozen=True)
class RunGroups:
    """The worker groups of one run: the actor's, the critic's when the advantage
    estimator needs a value model, and the rollout's with ``rollout.placement=split``."""

    actor: WorkerGroup
    critic: WorkerGroup | None
    rollout: WorkerGroup | None

    @property
    def all(self) -> list[WorkerGroup]:
        return [g for g in (self.actor, self.critic, self.rollout) if g is not None]


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
    }
    started: dict[str, WorkerGroup] = {}
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
            )
        for group in started.values():
            group.call("init_model", dispatch="broadcast", collect="list")
        yield RunGroups(
            actor=started["actor"], critic=started.get("critic"), rollout=started.get("rollout")
        )
    finally:
        for group in started.values():
            group.shutdown()
        for pool in {id(pool): pool for pool, _ in pools.values()}.values():
            pool.remove()


def run(cfg: Config, inputs: RunInputs) -> Path:
    """One whole run in the open Ray session: place the groups, resume when a checkpoint was
    found, train to ``trainer.total_steps``, export the policy; the output folder."""
    output_dir = Path(cfg.trainer.output_dir)
    with start_groups(cfg, inputs.tokenizer) as groups:
        print(write_placement_report(groups.all, output_dir), flush=True)
        trainer = Trainer(
            cfg, inputs, actor=groups.actor, critic=groups.critic, rollout=groups.rollout
        )
        start = trainer.resume(inputs.resume_from) if inputs.resume_from else 0
        trainer.fit(start)
        trainer.export_policy()
    return output_dir


def train(cfg: Config) -> Path:
    """``verlite train``: the inputs checked before Ray starts, then :func:`run` in a Ray
    session of its own (embedded, or a connection to ``trainer.ray_address``)."""
    if cfg.trainer.ray_address is None:
        check_fits_machine(cfg)
    inputs = RunInputs.load(cfg)
    with ray_session(cfg.trainer.ray_address):
        return run(cfg, inputs)
