"""A step's critic and actor updates are in flight together (``Trainer.train_step``, stages
5 and 6: neither reads the other's result), each timed to its own result; so are the critic's
values and the actor's log-probs of the generated rows (stage 3 beside stage 1's pass); the
critic learns from every response token while the overlong filter takes rows out of the
actor's loss; in the critic's warm-up the actor only reports (``skip_update``), beside the
critic's update; a failure of either update ends the step as any worker's failure does, and
nothing is left running.

Real worker groups on the shared local Ray, colocated (the roles share each bundle, the
default ``trainer.placement``), of workers that stand in for the actor and the critic: each
update opens its own gate and waits for the other's, so only updates in flight together both
see the other's (a bounded wait: an update that never sees it reports so and the step goes
on). A whole run with the real workers: tests/e2e/test_whole_run_invariance.py."""

import contextlib
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import ray
import torch
from ray.exceptions import RayActorError
from tensordict import TensorDict

from verlite.config import Config, load_config
from verlite.controller import DpSplit, PendingCall, Worker, WorkerGroup, WorkerGroupError
from verlite.core.metrics import Metric, MetricDict
from verlite.driver import run as driver_run
from verlite.driver.preflight import RunInputs
from verlite.driver.step_source import GeneratedStep
from verlite.driver.trainer import Timer, Trainer

# Ray workers cannot import this module: its worker classes travel by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

# How long an update waits for a gate; past it, the update reports the gate shut and ends
# (under a trainer that breaks what a test checks, the test fails then, not hangs).
GATE_WAIT_S = 60.0
# 4 rows a step in 2 mini-batches for each role; rollout.max_response_length is 4.
SMALL = (
    "data.train_batch_size=4",
    "actor.ppo_mini_batch_size=2",
    "actor.micro_batch_size_per_worker=2",
    "critic.ppo_mini_batch_size=2",
    "critic.micro_batch_size_per_worker=2",
    "critic.warmup_steps=0",
    "algorithm.overlong.filter=true",
    "trainer.cpus_per_worker=0.5",
)
# Two responses reach the limit (the filter takes them out of the actor's loss), two do not.
LENGTHS = (4, 4, 2, 2)
PROMPT, RESPONSE = 2, 4


@ray.remote(num_cpus=0, max_concurrency=8)
class Gates:
    """Named events the workers open and wait for, and the driver too."""

    def __init__(self) -> None:
        self.events: dict[str, threading.Event] = {}

    def _event(self, name: str) -> threading.Event:
        return self.events.setdefault(name, threading.Event())

    def open(self, name: str) -> None:
        self._event(name).set()

    def wait(self, name: str) -> bool:
        return self._event(name).wait(GATE_WAIT_S)

    def opened(self, name: str) -> bool:
        return self._event(name).is_set()

    def reset(self) -> None:
        self.events = {}


def gates_name(output_dir: str | Path) -> str:
    """The name of a run's :class:`Gates` actor: one of its own for each test's run."""
    return f"verlite-test-gates:{output_dir}"


class StandIn(Worker):
    """What the trainer asks of every trained role besides its update."""

    def __init__(self, *, cfg: Config, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.gates = gates_name(cfg.trainer.output_dir)

    def open_gate(self, name: str) -> None:
        ray.get(ray.get_actor(self.gates).open.remote(name))

    def seen(self, name: str) -> float:
        """1.0 when gate ``name`` opened within :data:`GATE_WAIT_S`, else 0.0."""
        return float(ray.get(ray.get_actor(self.gates).wait.remote(name)))

    def init_model(self) -> None:
        pass

    def compute_profile(self) -> tuple[None, None]:
        return None, None  # on CPU: no MFU

    @staticmethod
    def tokens(td: TensorDict) -> Metric:
        """The loss tokens of this rank's share (``(mini_batches, rows)``)."""
        return Metric.sum(float(td["response_mask"].sum()))


class Critic(StandIn):
    def compute_values(self, td: TensorDict) -> TensorDict:
        return TensorDict({"values": torch.zeros(td["responses"].shape)}, batch_size=td.batch_size)

    def update_critic(self, td: TensorDict) -> MetricDict:
        self.open_gate("critic_started")
        return {
            "critic/saw_actor_update": Metric.max(self.seen("actor_started")),
            # the driver stopped the actor's clock while this update still ran
            "critic/saw_actor_timed": Metric.max(self.seen("actor_timed")),
            "critic/tokens": self.tokens(td),
        }


class Actor(StandIn):
    def update_actor(self, td: TensorDict) -> MetricDict:
        self.open_gate("actor_started")
        return {
            "actor/saw_critic_update": Metric.max(self.seen("critic_started")),
            "actor/tokens": self.tokens(td),
        }

    def skip_update(self) -> MetricDict:
        return {
            "actor/skipped": Metric.max(1.0),
            # the driver stopped the critic's clock while this call still ran
            "actor/saw_critic_timed": Metric.max(self.seen("critic_timed")),
        }


class GeneratingActor(Actor):
    """The actor of a colocated step source: its rows, then their log-probs in a call of
    their own, which waits to see the critic's value pass begin."""

    def generate(
        self, prompts: TensorDict, params: Any, seed: int, records: Any, *, in_step: bool
    ) -> TensorDict:
        return step_batch().exclude("old_log_probs")

    def compute_log_probs(self, td: TensorDict, with_old: bool) -> TensorDict:
        self.open_gate("log_probs_started")
        if self.seen("values_started"):
            self.open_gate("log_probs_saw_values")
        return TensorDict({"old_log_probs": torch.zeros(td["responses"].shape)}, td.batch_size)


class ValuesCritic(Critic):
    """A value pass that waits to see the actor's log-prob pass begin."""

    def compute_values(self, td: TensorDict) -> TensorDict:
        self.open_gate("values_started")
        if self.seen("log_probs_started"):
            self.open_gate("values_saw_log_probs")
        return super().compute_values(td)


class FailingCritic(Critic):
    def update_critic(self, td: TensorDict) -> MetricDict:
        raise ValueError("the critic's update broke")


class FailingActor(Actor):
    def update_actor(self, td: TensorDict) -> MetricDict:
        raise ValueError("the actor's update broke")


class Waiting(Critic):
    """Either role's update, which runs until its group is shut down (or
    :data:`GATE_WAIT_S`)."""

    def update_critic(self, td: TensorDict) -> MetricDict:
        self.seen("never")
        return {}

    def update_actor(self, td: TensorDict) -> MetricDict:
        return self.update_critic(td)


def step_batch() -> TensorDict:
    """A step batch of :data:`LENGTHS` responses, as the actor generates it."""
    rows = len(LENGTHS)
    response_mask = (torch.arange(RESPONSE) < torch.tensor(LENGTHS)[:, None]).long()
    attention_mask = torch.cat([torch.ones(rows, PROMPT, dtype=torch.long), response_mask], 1)
    responses = torch.full((rows, RESPONSE), 5) * response_mask
    zeros = torch.zeros(rows, RESPONSE)
    return TensorDict(
        {
            "input_ids": torch.cat([torch.full((rows, PROMPT), 3), responses], 1),
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0),
            "responses": responses,
            "response_mask": response_mask,
            "rollout_log_probs": zeros,
            "old_log_probs": zeros.clone(),
            "uid": torch.arange(rows),
            "sample_key": torch.zeros(rows, 2, dtype=torch.long),
        },
        batch_size=[rows],
    )


@pytest.fixture
def gates(tmp_path: Path, local_ray) -> Iterator[Any]:
    """The gates of the test's run (:func:`trainer_of`), all shut."""
    handle = Gates.options(name=gates_name(tmp_path / "run")).remote()  # type: ignore[attr-defined]
    ray.get(handle.reset.remote())
    yield handle
    ray.kill(handle)


@contextlib.contextmanager
def trainer_of(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    *,
    actor: type[Worker] = Actor,
    critic: type[Worker] = Critic,
    overrides: tuple[str, ...] = (),
    step_source: bool = False,
) -> Iterator[Trainer]:
    """A Trainer of ``configs/ppo_tiny.yaml`` over groups of stand-in workers, whose steps
    train on :func:`step_batch` (generated by the actor through the trainer's own step
    source with ``step_source``), scored 1 and 0 by turns."""
    out = f"trainer.output_dir={tmp_path / 'run'}"
    cfg = load_config("configs/ppo_tiny.yaml", [*SMALL, *overrides, out])
    monkeypatch.setattr(driver_run, "ActorWorker", actor)
    monkeypatch.setattr(driver_run, "CriticWorker", critic)
    inputs = RunInputs.load(cfg)
    try:
        with driver_run.start_groups(cfg, inputs.tokenizer) as groups:
            trainer = Trainer(cfg, inputs, groups=groups)
            if not step_source:
                trainer.step_source = SimpleNamespace(  # type: ignore[assignment]
                    take=lambda step, log_probs=True: GeneratedStep([], step_batch(), {}),
                    add_log_probs=lambda batch: {},
                    updated=lambda step: {},
                )
            scores = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=torch.float64)
            trainer.scorer = SimpleNamespace(  # type: ignore[assignment]
                score=lambda batch, records: (scores, {})
            )
            yield trainer
    finally:
        inputs.folder.release()


def test_both_updates_are_in_flight_together_each_timed_to_its_own_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gates: Any
) -> None:
    """Step 1 is the critic's warm-up: the actor only reports. Step 2 updates both, side by
    side. Then what lets the overlong filter change the actor's batch once the critic's call
    is submitted: every rank's share is cut and serialized before ``call_async`` returns, so
    even a change in place reaches no worker."""
    stop = Timer.stop

    def stopped(timer: Timer, stage: str) -> None:
        stop(timer, stage)
        if stage in ("update_actor", "update_critic"):  # a result is in: its time ends here
            ray.get(gates.open.remote(f"{stage.removeprefix('update_')}_timed"))

    monkeypatch.setattr(Timer, "stop", stopped)
    with trainer_of(tmp_path, monkeypatch, overrides=("critic.warmup_steps=1",)) as trainer:
        for name in ("actor_started", "actor_timed"):  # no actor update in the warm-up
            ray.get(gates.open.remote(name))
        warm_up = trainer.train_step(1)
        ray.get(gates.reset.remote())  # shut again for step 2
        metrics = trainer.train_step(2)

        batch = step_batch()
        pending = trainer.critic.call_async(
            "update_critic", batch, dispatch=DpSplit(mini_batches=2), collect="metrics"
        )
        batch["response_mask"].zero_()
        assert pending.result()["critic/tokens"] == sum(LENGTHS)

    assert warm_up["actor/skipped"] == 1.0
    # the actor's report ran beside the critic's update, whose time it is no part of
    assert warm_up["actor/saw_critic_timed"] == 1.0
    assert "actor/tokens" not in warm_up and "timing_s/update_actor" not in warm_up
    assert warm_up["critic/tokens"] == sum(LENGTHS)
    assert "timing_s/update_critic" in warm_up

    # each update saw the other's begin: both were in flight at once
    assert metrics["critic/saw_actor_update"] == metrics["actor/saw_critic_update"] == 1.0
    # the actor's clock stopped at its own result, while the critic's update still ran
    assert metrics["critic/saw_actor_timed"] == 1.0
    # in the order the updates started, whichever ended first (here the actor's)
    timings = [key for key in metrics if key.startswith("timing_s/update_")]
    assert timings == ["timing_s/update_critic", "timing_s/update_actor"]
    # the critic learns from every response token; the actor from the rows the overlong
    # filter left, a mask set after the critic's call was submitted
    assert metrics["critic/tokens"] == sum(LENGTHS)
    assert metrics["actor/tokens"] == sum(n for n in LENGTHS if n < RESPONSE)
    assert metrics["response_length/overlong_filtered"] == 0.5


@pytest.mark.parametrize(
    ("actor", "critic", "failed", "running"),
    [(Waiting, FailingCritic, "critic", "actor"), (FailingActor, Waiting, "actor", "critic")],
)
def test_a_failed_update_ends_the_step_as_a_workers_failure_and_nothing_runs_on(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    gates: Any,
    actor: type[Worker],
    critic: type[Worker],
    failed: str,
    running: str,
) -> None:
    """The failure is the failed group's (group, rank, method, cause: no restart mends a
    raise), raised while the other update still runs; leaving the run's groups ends that
    update too, its worker killed without waiting for it."""
    calls: dict[str, PendingCall] = {}
    call_async = WorkerGroup.call_async

    def submitted(group: WorkerGroup, method: str, *args: Any, **kwargs: Any) -> PendingCall:
        calls[method] = call_async(group, method, *args, **kwargs)
        return calls[method]

    monkeypatch.setattr(WorkerGroup, "call_async", submitted)
    with (
        pytest.raises(WorkerGroupError) as caught,
        trainer_of(tmp_path, monkeypatch, actor=actor, critic=critic) as trainer,
    ):
        trainer.train_step(1)
    message = str(caught.value)
    assert message.startswith(f"worker group {failed!r}: rank 0 on node "), message
    assert message.endswith(f"failed in update_{failed}(): ValueError: the {failed}'s update broke")
    assert not caught.value.lost
    with pytest.raises(RayActorError):  # not the result it returns after GATE_WAIT_S
        ray.get(calls[f"update_{running}"].ref(0))


def test_the_values_are_in_flight_beside_the_actors_log_probs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gates: Any
) -> None:
    """With a critic, the actor's log-prob pass over the generated rows and the critic's
    value pass (stage 3: neither reads the other's result) run side by side, each seeing the
    other's begin; the batch has both columns in row order."""
    ray.get(gates.open.remote("actor_timed"))  # the updates' gates: not what this test checks
    with trainer_of(
        tmp_path,
        monkeypatch,
        actor=GeneratingActor,
        critic=ValuesCritic,
        step_source=True,
    ) as trainer:
        metrics = trainer.train_step(1)
    assert ray.get(gates.opened.remote("log_probs_saw_values"))
    assert ray.get(gates.opened.remote("values_saw_log_probs"))
    assert metrics["rollout/logprob_abs_diff"] == 0.0  # the actor's old log-probs came in
    assert metrics["critic/values/mean"] == 0.0  # and the critic's values
    for stage in ("gen", "log_probs", "rollout"):
        assert f"timing_s/{stage}" in metrics
    # The critic times its value pass itself and reports it with its update (the real
    # critic's: tests/e2e/test_e2e_train.py's CRITIC_KEYS); the driver's clock would run on
    # through the log-prob call and the scoring. Mutation: the driver times it -> fails
    assert "timing_s/values" not in metrics
