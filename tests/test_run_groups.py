"""The worker groups a Trainer is handed are the ones its config runs with
(``RunGroups.check``): a critic, a rollout and a reward model group each exactly when the
config needs one; ``start_groups`` starts them side by side."""

import sys
from pathlib import Path
from typing import Any

import pytest
import ray
from ray.exceptions import RayActorError

from verlite.cli import main
from verlite.config import load_config
from verlite.controller import PendingCall, Worker, WorkerGroup, WorkerGroupError
from verlite.data import load_tokenizer
from verlite.driver import run as driver_run
from verlite.driver.trainer import RunGroups
from verlite.workers.actor import ActorWorker

# Ray workers cannot import this module: its worker class travels by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

GROUP = object()  # the check only asks which groups are there


@pytest.mark.parametrize(
    ("config", "overrides", "groups", "refused"),
    [
        ("ppo_tiny", [], {"critic": GROUP}, None),
        (
            "ppo_tiny",
            [],
            {},
            "algorithm.adv_estimator=gae needs a critic group; the trainer was handed none",
        ),
        ("grpo_tiny", [], {"critic": GROUP}, "needs no critic group; the trainer was handed one"),
        ("grpo_tiny", ["rollout.placement=split"], {"rollout": GROUP}, None),
        ("grpo_tiny", ["rollout.placement=split"], {}, "rollout.placement=split needs a rollout"),
        ("grpo_tiny", [], {"rollout": GROUP}, "rollout.placement=colocated needs no rollout"),
        (
            "grpo_tiny",
            [],
            {"reward_model": GROUP},
            "reward.model.path=None needs no reward model group",
        ),
    ],
)
def test_the_groups_are_those_the_config_runs_with(
    config: str, overrides: list[str], groups: dict, refused: str | None
) -> None:
    cfg = load_config(f"configs/{config}.yaml", overrides)
    handed = RunGroups(
        actor=GROUP,
        critic=groups.get("critic"),
        rollout=groups.get("rollout"),
        reward_model=groups.get("reward_model"),
    )
    if refused is None:
        handed.check(cfg)
        return
    with pytest.raises(ValueError, match=refused):
        handed.check(cfg)


class Idle(Worker):
    """A worker with nothing to load, for the order in which groups start."""

    def init_model(self) -> None:
        pass


def test_a_runs_groups_start_side_by_side_and_build_their_models_one_after_another(
    local_ray, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every group's workers are started before any group is waited for: their starts (a
    real worker imports torch and transformers, seconds) overlap. Joining a group only
    waits: its start was queued whole at construction, so the driver makes no calls (round
    trips) of its own on the way. The models are built one group after another: each build
    peaks on the host (a 7B policy in float32 is ~30 GB), and side by side the peaks of the
    groups of a node would add up."""
    events = []
    construct, join = WorkerGroup.__init__, WorkerGroup.join
    call_async, result = WorkerGroup.call_async, PendingCall.result
    remote = ray.actor.ActorMethod._remote
    joining: list[str] = []

    def constructed(group: WorkerGroup, name: str, *args: Any, **kwargs: Any) -> None:
        construct(group, name, *args, **kwargs)
        events.append(f"started {name}")

    def joined(group: WorkerGroup) -> None:
        events.append(f"waited for {group.name}")
        joining.append(group.name)
        join(group)
        joining.pop()

    def submitted(group: WorkerGroup, method: str, *args: Any, **kwargs: Any) -> PendingCall:
        events.append(f"{method} submitted to {group.name}")
        return call_async(group, method, *args, **kwargs)

    def awaited(call: PendingCall) -> Any:
        events.append(f"{call._method} awaited from {call._group.name}")
        return result(call)

    def sent(method: Any, *args: Any, **kwargs: Any) -> Any:
        if joining:
            events.append(f"{method._method_name} sent while joining {joining[-1]}")
        return remote(method, *args, **kwargs)

    monkeypatch.setattr(WorkerGroup, "__init__", constructed)
    monkeypatch.setattr(WorkerGroup, "join", joined)
    monkeypatch.setattr(WorkerGroup, "call_async", submitted)
    monkeypatch.setattr(PendingCall, "result", awaited)
    monkeypatch.setattr(ray.actor.ActorMethod, "_remote", sent)
    for name in ("ActorWorker", "CriticWorker"):
        monkeypatch.setattr(driver_run, name, Idle)
    cfg = load_config("configs/ppo_tiny.yaml", ["trainer.cpus_per_worker=0.5"])
    with driver_run.start_groups(cfg, load_tokenizer(None, task=cfg.data.task)):
        pass
    assert events == [
        "started actor",
        "started critic",
        "waited for actor",
        "waited for critic",
        "init_model submitted to actor",
        "init_model awaited from actor",
        "init_model submitted to critic",
        "init_model awaited from critic",
    ]


class FailingInit(Worker):
    """A worker whose model cannot be built."""

    def init_model(self) -> None:
        raise ValueError("no model at this path")


def test_a_groups_failed_init_ends_the_start_with_its_error_and_nothing_left_running(
    local_ray, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The critic's failure to build its model is reported as the critic's (group, rank,
    method, cause), and every worker of every group is gone."""
    handles: list[Any] = []
    construct = WorkerGroup.__init__

    def constructed(group: WorkerGroup, *args: Any, **kwargs: Any) -> None:
        construct(group, *args, **kwargs)
        handles.extend(group._workers)

    monkeypatch.setattr(WorkerGroup, "__init__", constructed)
    monkeypatch.setattr(driver_run, "ActorWorker", Idle)
    monkeypatch.setattr(driver_run, "CriticWorker", FailingInit)
    cfg = load_config("configs/ppo_tiny.yaml", ["trainer.cpus_per_worker=0.5"])
    with (
        pytest.raises(WorkerGroupError) as caught,
        driver_run.start_groups(cfg, load_tokenizer(None, task=cfg.data.task)),
    ):
        pytest.fail("the groups started")
    message = str(caught.value)
    assert message.startswith("worker group 'critic': rank 0 on node "), message
    assert message.endswith("failed in init_model(): ValueError: no model at this path"), message
    assert not caught.value.lost
    assert len(handles) == 2
    for handle in handles:
        with pytest.raises(RayActorError):
            ray.get(handle.ping.remote())


def bad_input_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, config: str, *settings: str
) -> str:
    """``verlite train`` of ``config`` with ``settings`` in the shared local Ray (half a CPU
    a worker), which must end as bad input: exit 2, one line, no traceback; that line."""
    out = f"trainer.output_dir={tmp_path / 'run'}"
    code = main(["train", "--config", config, "trainer.cpus_per_worker=0.5", *settings, out])
    err: str = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


class ActorOnAT4(ActorWorker):
    """An actor on a GPU without bf16 arithmetic, as a cluster's worker finds it (torch
    faked in the worker's own process: Ray kills it with its group)."""

    def init_model(self) -> None:
        import torch

        torch.cuda.is_available = lambda: True
        torch.cuda.is_bf16_supported = lambda including_emulation=True: including_emulation
        torch.cuda.get_device_name = lambda device=None: "Tesla T4"
        super().init_model()


def test_bad_input_a_worker_finds_is_one_line_and_exit_2(
    local_ray, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path
) -> None:
    """model.precision=bf16-mixed where the actor's GPU has no bf16 arithmetic (on a
    cluster, only the worker knows its GPU): the worker refuses before it builds its model,
    and the run ends as any bad input does, the worker's line first, then where; it was a
    WorkerGroupError, a run failure (exit 1)."""
    monkeypatch.setattr(driver_run, "ActorWorker", ActorOnAT4)
    settings = ["model.device=auto", "model.precision=bf16-mixed"]
    err = bad_input_line(capsys, tmp_path, "configs/grpo_tiny.yaml", *settings)
    assert err.startswith(
        "verlite: error: model.precision=bf16-mixed: the workers' GPU (Tesla T4) has no bf16 "
        "arithmetic; set model.precision=fp32 (worker group 'actor': rank 0 on node "
    ), err
    assert "), in init_model())" in err, err


class ActorWithoutTheEnvironment(ActorWorker):
    """An actor on a node where the environment's module cannot be imported (the driver
    imported it before Ray started): its lookup faked in the worker's own process, as a
    missing module fails it."""

    def __init__(self, **kwargs: Any) -> None:
        from verlite.workers import policy_worker

        found = policy_worker.get_environment
        policy_worker.get_environment = lambda spec: found("no_such_env_module:Lookup")
        super().__init__(**kwargs)


def test_an_environment_only_a_worker_cannot_load_is_bad_input_in_one_line(
    local_ray, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path
) -> None:
    """A worker loads rollout.multi_turn.env (its class, tokenizer and turn format) as it
    starts its model, where a bad input it finds reaches the command line as bad input
    (exit 2, ``WorkerInputError``). It loaded them in its constructor: Ray reports a
    constructor's exception as a dead actor, its type lost, and the run failed as a run
    failure (exit 1, 'worker constructor raised ConfigError: ...')."""
    monkeypatch.setattr(driver_run, "ActorWorker", ActorWithoutTheEnvironment)
    err = bad_input_line(capsys, tmp_path, "configs/tool_tiny.yaml")
    assert err.startswith(
        "verlite: error: rollout.multi_turn.env='no_such_env_module:Lookup': no module named "
        "'no_such_env_module' (is it on PYTHONPATH?) (worker group 'actor': rank 0 on node "
    ), err
    assert "), in init_model()); " in err, err
