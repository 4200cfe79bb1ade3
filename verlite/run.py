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
from verlite.controller import WorkerGroup, build_pools, ray_session, write_placement_report
from verlite.trainer import RunInputs, Trainer
from verlite.workers.actor import ActorWorker
from verlite.workers.critic import CriticWorker


@dataclass(frozen=True)
class RunGroups:
    """The worker groups of one run: the actor's, and the critic's when the advantage
    estimator needs a value model."""

    actor: WorkerGroup
    critic: WorkerGroup | None

    @property
    def all(self) -> list[WorkerGroup]:
        return [self.actor] if self.critic is None else [self.actor, self.critic]


@contextlib.contextmanager
def start_groups(cfg: Config, tokenizer: PreTrainedTokenizerBase) -> Iterator[RunGroups]:
    """Place the run's pools in the open Ray session, start a group per role with its model
    built, and on leaving shut the groups down and release the pools."""
    pools = build_pools(cfg, cfg.roles)
    run_id = uuid.uuid4().hex[:8]
    common = {"cfg": cfg, "vocab_size": len(tokenizer)}
    role_kwargs = {
        "actor": (
            ActorWorker,
            {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id},
        ),
        "critic": (CriticWorker, {}),
    }
    started: dict[str, WorkerGroup] = {}
    try:
        for role in cfg.roles:
            worker_cls, kwargs = role_kwargs[role]
            pool, share = pools[role]
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
        yield RunGroups(actor=started["actor"], critic=started.get("critic"))
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
        trainer = Trainer(cfg, inputs, actor=groups.actor, critic=groups.critic)
        start = trainer.resume(inputs.resume_from) if inputs.resume_from else 0
        trainer.fit(start)
        trainer.export_policy()
    return output_dir


def train(cfg: Config) -> Path:
    """``verlite train``: the inputs checked before Ray starts, then :func:`run` in a Ray
    session of its own (embedded, or a connection to ``trainer.ray_address``)."""
    inputs = RunInputs.load(cfg)
    with ray_session(cfg.trainer.ray_address):
        return run(cfg, inputs)
