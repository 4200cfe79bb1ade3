"""Where each step's batch comes from (``verlite.rollouts``), over worker groups that run
their calls in submission order, as a Ray actor does: no batch is ever trained on by weights
more than ``rollout.max_staleness`` updates newer than the ones that generated it, every
generation runs on weights synced before it, and the run's last steps submit nothing past
its end; the old log-probs come from the actor unless the sampler's serve.
(Real Ray workers: tests/e2e/test_split_rollout.py.)"""

from typing import Any

import pytest
import torch
from tensordict import TensorDict

from verlite.config import load_config
from verlite.config.derived import old_log_probs_source
from verlite.controller import DpSplit
from verlite.rollout import SamplingParams, SyncLayout
from verlite.rollout.weights import TensorSpec
from verlite.rollouts import Rollouts, StepPrompts


class Done:
    def __init__(self, value: Any) -> None:
        self.value = value

    def result(self) -> Any:
        return self.value

    def ref(self, rank: int) -> Any:
        assert rank == 0
        return self.value


# two buckets of one tensor each
LAYOUT = SyncLayout(tuple((TensorSpec(name, "float32", (2,), 0, 0, 8),) for name in ("a", "b")))


class Groups:
    """An actor and a rollout group that run each call when it is submitted (the order a
    Ray actor runs them in), and log them."""

    def __init__(self) -> None:
        self.log: list[tuple[str, ...]] = []
        self.actor_version = 0
        self.held: int | None = None

    def actor_call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        self.log.append(("actor", method))
        if method == "weight_layout":
            assert kwargs["collect"] == "rank0"
            return LAYOUT
        if method == "put_bucket":
            version, index = args
            assert version == self.actor_version, "the actor publishes the weights it holds"
            return Done((version, index))
        if method == "compute_log_probs":
            batch, with_old = args
            assert not {"sample_key", "rollout_log_probs"} & set(batch.keys())
            out = TensorDict({}, batch_size=batch.batch_size)
            if with_old:
                out["old_log_probs"] = torch.full((2, 1), float(self.actor_version))
            return out
        assert method == "rollout"
        prompts, _, _, with_old, records = args
        assert records is None  # prompt records travel to the workers for environments only
        batch = prompts.clone()
        batch["rollout_log_probs"] = torch.zeros(2, 1)
        if with_old:
            batch["old_log_probs"] = torch.zeros(2, 1)
        return batch

    def rollout_call_async(self, method: str, *args: Any, **_: Any) -> Done:
        if method == "load_bucket":
            version, index = args[0]  # the publish's result, by reference
            if index < len(LAYOUT.buckets) - 1:
                self.held = None  # none while a sync is part-way
                return Done([None])
            self.held = version
            self.log.append(("rollout", "load", str(self.held)))
            return Done([(self.held, 0.0)])
        prompts, _, _, version, records = args
        assert records is None
        assert self.held == version, "generation runs on the weights it names"
        self.log.append(("rollout", "generate", str(int(prompts["step"][0])), str(version)))
        batch = prompts.clone()
        batch["rollout_log_probs"] = torch.zeros(2, 1)
        return Done(batch)


class Group:
    def __init__(self, groups: Groups, role: str) -> None:
        self.groups, self.role = groups, role

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.groups.actor_call(method, *args, **kwargs)

    def call_async(self, method: str, *args: Any, **kwargs: Any) -> Done:
        if self.role == "actor":
            return self.groups.actor_call(method, *args, **kwargs)
        return self.groups.rollout_call_async(method, *args, **kwargs)

    def placement(self) -> list[dict[str, Any]]:
        return [{"rank": 0, "node_ip": "127.0.0.1"}]


def prompts(step: int) -> StepPrompts:
    td = TensorDict(
        {"step": torch.full((2,), step), "sample_key": torch.zeros(2, 2, dtype=torch.int64)},
        batch_size=[2],
    )
    return StepPrompts(step, td, [], {"position": step})


def rollouts(groups: Groups, *overrides: str, with_old: bool = True) -> Rollouts:
    cfg = load_config("configs/grpo_tiny.yaml", list(overrides))
    return Rollouts(
        cfg,
        actor=Group(groups, "actor"),
        rollout=Group(groups, "rollout") if cfg.rollout.placement == "split" else None,
        sampling=SamplingParams(max_new_tokens=4),
        draw=prompts,
        actor_split=DpSplit(),
        with_old=with_old,
        with_reference=False,
    )


@pytest.mark.parametrize("staleness", [0, 1, 2, 3])
@pytest.mark.parametrize("total", [1, 2, 6])
@pytest.mark.parametrize("resumed_at", [0, 1])
def test_no_batch_is_staler_than_the_bound_and_nothing_runs_past_the_end(
    staleness: int, total: int, resumed_at: int
) -> None:
    if resumed_at >= total:
        return
    groups = Groups()
    groups.actor_version = resumed_at
    source = rollouts(
        groups,
        "rollout.placement=split",
        f"rollout.max_staleness={staleness}",
        f"trainer.total_steps={total}",
    )
    source.start(version=resumed_at)
    seen = []
    for step in range(resumed_at + 1, total + 1):
        taken = source.take(step)
        assert taken.prompts.step == step
        assert taken.batch["old_log_probs"][0, 0] == step - 1  # the proximal policy
        staleness_seen = taken.metrics["rollout/staleness/max"]
        assert step - 1 - taken.metrics["rollout/weight_version"] == staleness_seen
        seen.append(staleness_seen)
        groups.actor_version = step  # the update of this step
        source.updated(step)
    # fresh or resumed, staleness climbs to the bound and stays there
    steps = total - resumed_at
    assert seen == [min(i, staleness) for i in range(steps)]
    generated = [entry for entry in groups.log if entry[1] == "generate"]
    assert [int(entry[2]) for entry in generated] == list(range(resumed_at + 1, total + 1))
    assert not source._in_flight  # nothing left generating after the last step


def test_colocated_batches_come_from_the_actor_with_their_log_probs() -> None:
    groups = Groups()
    source = rollouts(groups)
    source.start(version=0)
    taken = source.take(1)
    assert "old_log_probs" in set(taken.batch.keys())
    assert taken.metrics == {
        "rollout/weight_version": 0.0,
        "rollout/staleness/mean": 0.0,
        "rollout/staleness/max": 0.0,
    }
    assert source.updated(1) == {}
    assert groups.log == [("actor", "rollout")]


def test_with_the_samplers_log_probs_serving_no_actor_pass_runs() -> None:
    groups = Groups()
    source = rollouts(groups, "rollout.placement=split", with_old=False)
    source.start(version=0)
    taken = source.take(1)
    assert "old_log_probs" not in set(taken.batch.keys())
    assert ("actor", "compute_log_probs") not in groups.log
    assert taken.metrics["perf/weight_sync_bytes"] == 16.0  # the first sync, reported


@pytest.mark.parametrize(
    ("overrides", "recompute", "because"),
    [
        ([], True, "algorithm.recompute_old_log_probs=always"),
        (["algorithm.recompute_old_log_probs=auto"], False, "the sampler's own"),
        (
            ["algorithm.recompute_old_log_probs=auto", "model.dtype=float64"],
            True,
            "model.dtype=float64, the sampler's is float32",
        ),
        (
            ["algorithm.recompute_old_log_probs=auto", "rollout.temperature=0"],
            True,
            "rollout.temperature=0 (greedy)",
        ),
        (["algorithm.recompute_old_log_probs=auto", "rollout.top_k=5"], True, "rollout.top_k=5"),
        (
            ["algorithm.recompute_old_log_probs=auto", "rollout.top_p=0.9"],
            True,
            "rollout.top_p=0.9",
        ),
        (
            [
                "algorithm.recompute_old_log_probs=auto",
                "rollout.placement=split",
                "rollout.max_staleness=1",
            ],
            True,
            "rollout.max_staleness=1",
        ),
        (
            ["algorithm.recompute_old_log_probs=auto", "algorithm.rollout_correction=tis"],
            False,
            "so algorithm.rollout_correction=tis has nothing to correct",
        ),
    ],
)
def test_the_old_log_probs_are_recomputed_unless_they_can_only_repeat_the_samplers(
    overrides: list[str], recompute: bool, because: str
) -> None:
    cfg = load_config("configs/grpo_tiny.yaml", overrides)
    decided, line = old_log_probs_source(cfg)
    assert decided == recompute
    assert because in line, line
