"""Where each step's batch comes from (``verlite.driver.step_source``), over worker groups that run
their calls in submission order, as a Ray actor does: no batch is ever trained on by weights
more than ``rollout.max_staleness`` updates newer than the ones that generated it, every
generation runs on weights synced before it, and the run's last steps submit nothing past
its end; the loader state a checkpoint of a step saves is the one once that step's prompts
were drawn, whatever was drawn ahead; the old log-probs come from the actor unless the
sampler's serve. (Real Ray workers: tests/e2e/test_split_rollout.py.)"""

from typing import Any

import pytest
import torch
from tensordict import TensorDict

from verlite.config import Config, load_config
from verlite.config.derived import old_log_probs_source
from verlite.controller import DpSplit
from verlite.data import PromptLoader, build_datasets, load_tokenizer
from verlite.driver.step_source import StepSource
from verlite.generation import SamplingParams, SyncLayout, sample_keys
from verlite.generation.weights import TensorSpec
from verlite.workers.peak_memory import PEAK_COLUMN

# 3 batches of 4 prompts an epoch: the runs below cross epochs.
SMALL = ("data.num_train_samples=12", "data.train_batch_size=4", "actor.ppo_mini_batch_size=32")


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

    def __init__(self, seed: int) -> None:
        self.seed = seed
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
                out["old_log_probs"] = torch.full((len(batch), 1), float(self.actor_version))
            return out
        assert method == "generate_with_log_probs"
        prompts, _, _, with_old, records = args
        assert records is None  # prompt records travel to the workers for environments only
        batch = prompts.clone()
        batch["rollout_log_probs"] = torch.zeros(len(batch), 1)
        if with_old:
            batch["old_log_probs"] = torch.zeros(len(batch), 1)
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
        self.log.append(("rollout", "generate", str(self.step_of(prompts)), str(version)))
        batch = prompts.clone()
        batch["rollout_log_probs"] = torch.zeros(len(batch), 1)
        batch[PEAK_COLUMN] = torch.full((len(batch),), 1.5)  # the rank's peak memory, in GB
        return Done(batch)

    def step_of(self, prompts: TensorDict) -> int:
        """The step whose prompts these are, by their first row's sampling key."""
        first = prompts["sample_key"][0]
        return next(s for s in range(1, 100) if first.equal(sample_keys(self.seed, s, 1, 1)[0]))


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


def small_config(*overrides: str) -> Config:
    return load_config("configs/grpo_tiny.yaml", [*SMALL, *overrides])


def step_source(groups: Groups, cfg: Config, *, with_old: bool = True) -> StepSource:
    tokenizer = load_tokenizer(cfg.model.path, task=cfg.data.task)
    return StepSource(
        cfg,
        actor=Group(groups, "actor"),
        rollout=Group(groups, "rollout") if cfg.rollout.placement == "split" else None,
        tokenizer=tokenizer,
        train_set=build_datasets(cfg, tokenizer)[0],
        sampling=SamplingParams(max_new_tokens=4),
        actor_split=DpSplit(),
        with_old=with_old,
        with_reference=False,
    )


def loader_state_after(source: StepSource, steps: int) -> dict[str, int]:
    """The state of a loader over the same prompts once ``steps`` batches were drawn."""
    loader = PromptLoader(
        source.loader.dataset,
        source.loader.batch_size,
        seed=source.cfg.trainer.seed,
        shuffle=source.loader.shuffle,
    )
    for _ in range(steps):
        next(loader)
    return loader.state_dict()


@pytest.mark.parametrize("staleness", [0, 1, 2, 3])
@pytest.mark.parametrize("total", [1, 2, 6])
@pytest.mark.parametrize("resumed_at", [0, 1])
def test_no_batch_is_staler_than_the_bound_and_nothing_runs_past_the_end(
    staleness: int, total: int, resumed_at: int
) -> None:
    if resumed_at >= total:
        return
    cfg = small_config(
        "rollout.placement=split",
        f"rollout.max_staleness={staleness}",
        f"trainer.total_steps={total}",
    )
    groups = Groups(cfg.trainer.seed)
    groups.actor_version = resumed_at
    source = step_source(groups, cfg)
    source.load_loader_state(loader_state_after(source, resumed_at))  # as a resume does
    source.start(version=resumed_at)
    seen = []
    for step in range(resumed_at + 1, total + 1):
        taken = source.take(step)  # (it refuses another step's batch)
        assert len(taken.records) == len(taken.batch) // cfg.rollout.n
        # what a checkpoint of this step saves: not the loader moved on by the steps ahead
        assert source.loader_state == loader_state_after(source, step)
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
    cfg = small_config()
    groups = Groups(cfg.trainer.seed)
    source = step_source(groups, cfg)
    source.start(version=0)
    taken = source.take(1)
    assert source.loader_state == loader_state_after(source, 1)
    assert "old_log_probs" in set(taken.batch.keys())
    assert taken.metrics == {
        "rollout/weight_version": 0.0,
        "rollout/staleness/mean": 0.0,
        "rollout/staleness/max": 0.0,
    }
    assert source.updated(1) == {}
    assert groups.log == [("actor", "generate_with_log_probs")]


def test_with_the_samplers_log_probs_serving_no_actor_pass_runs() -> None:
    cfg = small_config("rollout.placement=split")
    groups = Groups(cfg.trainer.seed)
    source = step_source(groups, cfg, with_old=False)
    source.start(version=0)
    taken = source.take(1)
    assert "old_log_probs" not in set(taken.batch.keys())
    assert ("actor", "compute_log_probs") not in groups.log
    assert taken.metrics["perf/weight_sync_bytes"] == 16.0  # the first sync, reported
    # The rollout ranks' peak memory, taken out of the batch.
    assert taken.metrics["perf/max_memory_allocated_gb/rollout"] == 1.5
    assert PEAK_COLUMN not in set(taken.batch.keys())


@pytest.mark.parametrize(
    ("overrides", "recompute", "because"),
    [
        ([], True, "algorithm.recompute_old_log_probs=always"),
        (["algorithm.recompute_old_log_probs=auto"], False, "the sampler's own"),
        (
            ["algorithm.recompute_old_log_probs=auto", "model.precision=fp64"],
            True,
            "model.precision=fp64",
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
