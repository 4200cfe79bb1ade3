"""Where each step's batch comes from (``verlite.driver.step_source``), over worker groups that run
their calls in submission order, as a Ray actor does: no batch is ever trained on by weights
more than ``rollout.max_staleness`` updates newer than the ones that generated it, every
generation runs on weights synced before it, and the run's last steps submit nothing past
its end; the loader state a checkpoint of a step saves is the one once that step's prompts
were drawn, whatever was drawn ahead; the old log-probs come from the actor unless the
sampler's serve. A checkpoint keeps the batches generated ahead whose generation completed
(a failed one is raised by its step), and a resume trains on those its run would have
generated (same generation settings, within its staleness bound) and generates the others
again. (Real Ray workers: tests/e2e/test_split_rollout.py.)"""

from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import TensorDict

from verlite.config import Config, load_config
from verlite.config.derived import old_log_probs_source
from verlite.controller import DpSplit, WorkerGroupError
from verlite.data import PromptLoader, build_datasets, load_tokenizer
from verlite.driver.checkpoint import setting_changes
from verlite.driver.step_source import GENERATED_AHEAD, StepSource
from verlite.driver.trainer import run_record
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


class Failed:
    """A call whose workers failed: each wait for it raises, as ``PendingCall.result`` does."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def result(self) -> Any:
        raise self.error


def generation_error(step: int) -> WorkerGroupError:
    return WorkerGroupError(
        group="rollout",
        rank=0,
        node_id="0" * 56,
        node_ip="127.0.0.1",
        method="generate",
        cause=f"RuntimeError: step {step} failed",
        lost=False,
    )


class Groups:
    """An actor and a rollout group that run each call when it is submitted (the order a
    Ray actor runs them in), and log them; the rollout group's generations of the steps in
    ``failing`` fail."""

    def __init__(self, seed: int, *, actor_version: int = 0, failing: tuple[int, ...] = ()) -> None:
        self.seed = seed
        self.log: list[tuple[str, ...]] = []
        self.actor_version = actor_version
        self.held: int | None = None
        self.failing = failing

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

    def rollout_call_async(self, method: str, *args: Any, **_: Any) -> Done | Failed:
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
        step = self.step_of(prompts)
        self.log.append(("rollout", "generate", str(step), str(version)))
        if step in self.failing:
            return Failed(generation_error(step))
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

    def call_async(self, method: str, *args: Any, **kwargs: Any) -> Done | Failed:
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


def run_to_checkpoint(
    cfg: Config, checkpoint: Path, *, at: int, failing: tuple[int, ...] = ()
) -> StepSource:
    """Train steps 1 to ``at`` as a run does (take, update) and save what a checkpoint of step
    ``at`` keeps ahead into the folder ``checkpoint``; the step source, in flight as left."""
    groups = Groups(cfg.trainer.seed, failing=failing)
    source = step_source(groups, cfg)
    source.start(version=0)
    for step in range(1, at + 1):
        source.take(step)
        groups.actor_version = step
        source.updated(step)
    checkpoint.mkdir()
    source.save_ahead(checkpoint, version=at)
    return source


def resume(cfg: Config, checkpoint: Path, saved: Config, *, at: int) -> tuple[Groups, StepSource]:
    """A run of ``cfg`` resumed from the checkpoint of step ``at`` that a run of ``saved``
    wrote into ``checkpoint``, started as ``Trainer.resume`` and ``fit`` start it."""
    groups = Groups(cfg.trainer.seed, actor_version=at)
    source = step_source(groups, cfg)
    source.load_loader_state(loader_state_after(source, at))
    changes = setting_changes({"config": run_record(saved)}, cfg.model_dump(mode="json"))
    source.load_ahead(checkpoint, changes, version=at)
    source.start(version=at)
    return groups, source


def generated(groups: Groups) -> list[tuple[int, int]]:
    """The rollout group's generations: (step, weight version) each."""
    return [(int(e[2]), int(e[3])) for e in groups.log if e[1] == "generate"]


STALE = ("rollout.placement=split", "rollout.max_staleness=1", "trainer.total_steps=4")


@pytest.mark.parametrize(
    ("override", "kept"),
    [
        ((), True),
        # how generations are placed or decoded: the kept batch is the one they generate
        (("rollout.decode=static", "rollout.workers_per_node=2"), True),
        # greedy both times: top_k takes no effect in either
        (("rollout.temperature=0", "rollout.top_k=5"), True),
        (("rollout.temperature=0.7",), False),
        (("rollout.top_p=0.9",), False),
        (("rollout.top_k=5",), False),
        (("rollout.max_response_length=8",), False),
        (
            ("rollout.n=4", "actor.ppo_mini_batch_size=16", "actor.micro_batch_size_per_worker=16"),
            False,
        ),
        # the precision the rollout samples in (a resume may convert it: model.*, not rollout.*)
        (("model.precision=fp64",), False),
    ],
)
def test_a_kept_batch_is_generated_again_under_other_generation_settings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], override: tuple[str, ...], kept: bool
) -> None:
    """The checkpoint of step 2 keeps step 3's batch, generated by version 1 (real files). A
    resume under the same generation settings trains on it; under other sampling settings
    it generates it again by the checkpoint's weights (version 2), in one line naming the
    setting. Mutation: settings changes not read (only staleness drops a kept batch): the
    batches of another temperature, top_p, top_k, length, n or precision are trained on."""
    greedy = ("rollout.temperature=0",) if "rollout.temperature=0" in override else ()
    saved = small_config(*STALE, *greedy)
    checkpoint = tmp_path / "step_2"
    run_to_checkpoint(saved, checkpoint, at=2)
    assert (checkpoint / GENERATED_AHEAD).is_file()
    capsys.readouterr()

    groups, source = resume(small_config(*STALE, *override), checkpoint, saved, at=2)
    line = capsys.readouterr().out
    taken = source.take(3)
    if kept:
        assert line == ""
        assert generated(groups) == [(4, 2)]  # step 3's batch is the kept one, of version 1
        assert taken.metrics["rollout/weight_version"] == 1
    else:
        assert generated(groups) == [(3, 2), (4, 2)]
        assert taken.metrics["rollout/weight_version"] == 2
        changed = override[0].split("=")[0]
        assert line.count("\n") == 1
        assert f"{checkpoint}: generating the batches it kept of step(s) 3 again" in line
        assert f"{changed}=" in line and "(now " in line, line


@pytest.mark.parametrize(
    "override",
    [("rollout.max_staleness=0",), ("rollout.placement=colocated", "rollout.max_staleness=0")],
)
def test_a_kept_batch_staler_than_the_resumed_run_allows_is_generated_again_in_a_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], override: tuple[str, ...]
) -> None:
    """A split run's checkpoint resumed with a lower ``rollout.max_staleness``, or by
    colocated actors (which generate each batch with the weights that train on it): the
    kept batch of step 3 (version 1, staleness 1) is staler than the run allows, so the
    checkpoint's weights generate it again, and a line says so (it was dropped without a
    word: a colocated resume loaded it and never used it). Mutation: the line not printed."""
    saved = small_config(*STALE)
    checkpoint = tmp_path / "step_2"
    run_to_checkpoint(saved, checkpoint, at=2)
    capsys.readouterr()

    _, source = resume(small_config(*STALE, *override), checkpoint, saved, at=2)
    line = capsys.readouterr().out
    assert line == (
        f"{checkpoint}: generating the batches it kept of step(s) 3 again, by its weights: "
        "generated by older weights than rollout.max_staleness=0 allows\n"
    )
    assert source.take(3).metrics["rollout/weight_version"] == 2


def test_a_kept_batch_past_a_lowered_total_steps_is_left_out_in_a_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With ``max_staleness=2`` the checkpoint of step 2 keeps steps 3 and 4 (versions 0 and
    1). Resumed with ``trainer.total_steps=3``, the run trains step 3 on its kept batch and
    ends there: step 4's batch is left out, in a line (it was ignored without a word), and
    nothing generates it. Resumed at its last step (``total_steps=2``), both are; under
    another temperature, only step 3's is generated again. Mutations: the line not printed;
    the batches past the end kept (the other line names step 4 too)."""
    saved = small_config(
        "rollout.placement=split", "rollout.max_staleness=2", "trainer.total_steps=5"
    )
    checkpoint = tmp_path / "step_2"
    run_to_checkpoint(saved, checkpoint, at=2)
    capsys.readouterr()

    for total, past in ((3, "4"), (2, "3, 4")):
        cfg = small_config(
            "rollout.placement=split", "rollout.max_staleness=2", f"trainer.total_steps={total}"
        )
        groups, source = resume(cfg, checkpoint, saved, at=2)
        assert capsys.readouterr().out == (
            f"{checkpoint}: leaving out the batches it kept of step(s) {past}: past "
            f"trainer.total_steps={total}, where this run ends\n"
        )
        assert generated(groups) == []  # the steps up to the end are kept, none past it
        if total == 3:
            assert source.take(3).metrics["rollout/weight_version"] == 0
    # Under another temperature too: step 3's is generated again, and only it.
    cfg = small_config(
        "rollout.placement=split",
        "rollout.max_staleness=2",
        "trainer.total_steps=3",
        "rollout.temperature=0.7",
    )
    groups, _ = resume(cfg, checkpoint, saved, at=2)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith(
        "leaving out the batches it kept of step(s) 4: past "
        "trainer.total_steps=3, where this run ends"
    )
    assert "generating the batches it kept of step(s) 3 again" in lines[1] and len(lines) == 2
    assert generated(groups) == [(3, 2)]


@pytest.mark.parametrize(
    ("saved_total", "at", "k", "late", "versions"),
    [
        (4, 4, 1, [5], [3]),  # its last checkpoint: nothing was in flight
        (4, 4, 2, [5, 6], [2, 3]),
        (3, 2, 2, [4], [1]),  # before its end: step 3's batch kept (version 0), 4's never made
        # a run shorter than its staleness: the uninterrupted run's first batches are all the
        # initial weights' (version 0), none of a version below it
        (1, 1, 2, [2, 3], [0, 0]),
    ],
)
def test_a_raised_total_steps_generates_the_steps_past_the_old_end_in_a_line(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    saved_total: int,
    at: int,
    k: int,
    late: list[int],
    versions: list[int],
) -> None:
    """A run of ``max_staleness=k`` generates the batches up to its ``trainer.total_steps``,
    none past it. Resumed with ``total_steps=6``, the steps past the old end that a run of 6
    never stopped generates by older weights than the checkpoint's (``versions``) are
    generated by the checkpoint's, less stale: that run is not the longer uninterrupted run,
    and one line says so (it was silent); the rest is as uninterrupted (a kept batch trained
    on, the next steps generated by the checkpoint's weights). Mutation: the line not
    printed."""
    stale = ("rollout.placement=split", f"rollout.max_staleness={k}")
    saved = small_config(*stale, f"trainer.total_steps={saved_total}")
    checkpoint = tmp_path / f"step_{at}"
    run_to_checkpoint(saved, checkpoint, at=at)
    capsys.readouterr()

    groups, source = resume(small_config(*stale, "trainer.total_steps=6"), checkpoint, saved, at=at)
    assert capsys.readouterr().out == (
        f"{checkpoint}: the batches of step(s) {', '.join(map(str, late))} are generated by "
        f"its weights (version {at}), not by version(s) {', '.join(map(str, versions))} as in "
        f"a run of trainer.total_steps=6 never stopped (rollout.max_staleness={k}): the run "
        f"that saved it ended at trainer.total_steps={saved_total} and generated nothing past "
        "it, and a checkpoint holds no older weights\n"
    )
    assert generated(groups) == [
        (step, at) for step in range(at + 1, min(at + 1 + k, 6) + 1) if step > saved_total
    ]
    trained = {step: source.take(step).metrics for step in range(at + 1, late[-1] + 1)}
    assert [trained[step]["rollout/weight_version"] for step in late] == [at] * len(late)
    # the same total: nothing past the old end, nothing said
    resume(saved, checkpoint, saved, at=at)
    assert capsys.readouterr().out == ""


def test_a_failed_generation_ahead_leaves_the_checkpoint_with_the_batches_that_completed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With ``max_staleness=2`` the checkpoint of step 2 keeps steps 3 and 4 (versions 0 and
    1). Step 3's generation failed: the checkpoint is written all the same, with step 4's
    batch, in a line; the run's step 3 then raises the generation's error; a resume
    generates step 3's batch again (version 2) and trains step 4 on the kept one. Mutations:
    save_ahead not catching the failure (the checkpoint raises); the failure replaced by a
    batch of its prompts (step 3 trains on it instead of raising)."""
    saved = small_config(
        "rollout.placement=split", "rollout.max_staleness=2", "trainer.total_steps=5"
    )
    checkpoint = tmp_path / "step_2"
    source = run_to_checkpoint(saved, checkpoint, at=2, failing=(3,))
    line = capsys.readouterr().out
    assert line == (
        "step_2: not keeping step 3's batch, whose generation by the weights of version 0 "
        "failed (WorkerGroupError; the step raises it): a resume from it generates that "
        "batch again\n"
    )
    assert sorted(torch.load(checkpoint / GENERATED_AHEAD, weights_only=True)) == [4]
    with pytest.raises(WorkerGroupError, match="step 3 failed"):
        source.take(3)

    groups, resumed = resume(saved, checkpoint, saved, at=2)
    assert capsys.readouterr().out == ""
    assert generated(groups) == [(3, 2), (5, 2)]
    assert [resumed.take(step).metrics["rollout/weight_version"] for step in (3, 4)] == [2, 1]


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
        # tis with a truncated sampler weighs each token by the mass kept: said, whichever
        # source. Mutation: the tail left out -> both fail
        (
            [
                "algorithm.recompute_old_log_probs=auto",
                "algorithm.rollout_correction=tis",
                "rollout.top_k=5",
            ],
            True,
            "rollout.top_k=5); with rollout.top_k=5 the sampler draws from the truncated "
            "distribution, so algorithm.rollout_correction=tis weighs each token by the "
            "probability mass the truncation kept (at most 1",
        ),
        (
            ["algorithm.rollout_correction=tis", "rollout.top_k=5", "rollout.top_p=0.9"],
            True,
            "=always); with rollout.top_k=5 and rollout.top_p=0.9 the sampler draws",
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
