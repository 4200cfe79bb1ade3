"""DAPO's dynamic sampling on the driver (``verlite.driver.dynamic_sampling``) over worker
groups that run each call as it is made, as tests/test_step_source.py's do: a step trains on
the first ``data.train_batch_size`` groups whose scores vary, in data order, drawn with the
weights that train on them and renumbered as one batch of the usual size; its log-probs are
computed for those rows alone; the loader a checkpoint saves is past every draw; when the
draws run out, tied groups fill the step and a line says so. (A whole run under several
layouts: tests/e2e/test_whole_run_invariance.py.)"""

import contextlib
import hashlib
import re
from typing import Any

import pytest
import torch
from tensordict import TensorDict

from tests.test_step_source import Group, Groups, loader_state_after, step_source
from verlite.config import Config, ConfigError, load_config
from verlite.data import PromptRecord, row_records
from verlite.driver.dynamic_sampling import DynamicSampling, ScoreFn, merge_draw_metrics
from verlite.driver.step_source import GeneratedStep
from verlite.generation import sample_keys

BATCH, N = 4, 2
SMALL = (
    "data.num_train_samples=24",
    f"data.train_batch_size={BATCH}",
    f"rollout.n={N}",
    f"actor.ppo_mini_batch_size={BATCH * N}",
    "actor.micro_batch_size_per_worker=8",
    "algorithm.dynamic_sampling.enable=true",
)


def ties(record: PromptRecord) -> bool:
    """Whether every response to this prompt scores alike (a third of the prompts)."""
    return int(hashlib.sha256(record["prompt"].encode()).hexdigest(), 16) % 3 == 0


def score(generated: GeneratedStep) -> tuple[torch.Tensor, dict[str, float]]:
    """0 for both responses to a prompt that ties, 0 and 1 otherwise."""
    rows = row_records(generated.records, generated.batch["uid"])
    scores = torch.tensor([0.0 if ties(r) else float(i % N) for i, r in enumerate(rows)])
    return scores, {"reward/fn/mean": float(scores.mean()), "reward/fn/errors": 1.0}


class DrawingGroups(Groups):
    """Test_step_source's groups, whose actor also generates without log-probs and whose
    rollout group also takes calls made synchronously."""

    def actor_call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if method != "generate":
            if method == "compute_log_probs":
                self.log.append(("actor", "log_probs", str(len(args[0]))))
            return super().actor_call(method, *args, **kwargs)
        prompts, _, _, records = args
        assert records is None and kwargs["in_step"]  # its peak memory is the step's
        self.log.append(("actor", "generate", str(self.step_of(prompts))))
        batch = prompts.clone()
        batch["rollout_log_probs"] = torch.zeros(len(batch), 1)
        return batch

    def step_of(self, prompts: TensorDict) -> int:
        """The step whose draw these prompts are, by their first row's sampling key."""
        first = prompts["sample_key"][0]
        return next(
            step
            for step in range(1, 20)
            for draw in range(8)
            if first.equal(sample_keys(self.seed, step, 1, 1, first_prompt=draw * BATCH)[0])
        )


class DrawingGroup(Group):
    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self.role == "rollout":
            return self.groups.rollout_call_async(method, *args, **kwargs).result()
        return self.groups.actor_call(method, *args, **kwargs)


def sampling(cfg: Config, scores: ScoreFn = score) -> tuple[DrawingGroups, DynamicSampling]:
    groups = DrawingGroups(cfg.trainer.seed)
    source = step_source(groups, cfg)
    source.actor = DrawingGroup(groups, "actor")
    if source.rollout is not None:
        source.rollout = DrawingGroup(groups, "rollout")
    return groups, DynamicSampling(cfg, source, scores)


def no_timer(_: str) -> contextlib.nullcontext[None]:
    return contextlib.nullcontext()


def expected_steps(cfg: Config, steps: int) -> list[tuple[list[str], int, int]]:
    """Each step's kept prompts, draws and filled groups, from the data order alone."""
    loader = step_source(DrawingGroups(0), cfg).loader
    out = []
    for _ in range(steps):
        drawn: list[PromptRecord] = []
        while len(drawn) < cfg.algorithm.dynamic_sampling.max_draws * BATCH:
            drawn += next(loader)
            if sum(not ties(r) for r in drawn) >= BATCH:
                break
        varied = [r for r in drawn if not ties(r)]
        kept = varied[:BATCH]
        filled = [r for r in drawn if ties(r)][: BATCH - len(kept)]
        kept = [r for r in drawn if r in kept or r in filled]
        out.append(([r["prompt"] for r in kept], len(drawn) // BATCH, len(filled)))
    return out


@pytest.mark.parametrize("placement", ["colocated", "split"])
def test_a_step_trains_on_the_first_groups_whose_scores_vary(placement: str) -> None:
    cfg = load_config("configs/grpo_tiny.yaml", [*SMALL, f"rollout.placement={placement}"])
    groups, dynamic = sampling(cfg)
    source = dynamic.step_source
    source.start(version=0)
    expected = expected_steps(cfg, 4)
    assert max(draws for _, draws, _ in expected) > 1  # the data makes steps draw more
    draws_so_far = 0
    for step, (prompts, draws, filled) in enumerate(expected, start=1):
        start = len(groups.log)
        generated, scores, reward = dynamic.take(step, no_timer)
        draws_so_far += draws
        batch = generated.batch
        # one step batch of the usual size and layout, of the kept groups alone
        assert [r["prompt"] for r in generated.records] == prompts
        assert batch["uid"].tolist() == [g for g in range(BATCH) for _ in range(N)]
        assert [r["prompt"] for r in row_records(generated.records, batch["uid"])] == [
            p for p in prompts for _ in range(N)
        ]
        assert scores.tolist() == score(generated)[0].tolist()
        # every row keeps the sampling key it was drawn with: no two rows of a step share one
        assert len({tuple(k) for k in batch["sample_key"].tolist()}) == BATCH * N
        assert generated.metrics["dynamic_sampling/draws"] == draws
        assert generated.metrics["dynamic_sampling/drawn_groups"] == draws * BATCH
        assert generated.metrics["dynamic_sampling/dropped_groups"] == (draws - 1) * BATCH
        assert generated.metrics["dynamic_sampling/filled_groups"] == filled == 0
        assert reward["reward/fn/errors"] == draws  # a count from each draw's scoring
        # the colocated actor's generation, timed over every draw
        assert ("timing_s/gen" in generated.metrics) == (placement == "colocated")
        # generated by the weights that train on them, log-probs of the kept rows only
        generator = "actor" if placement == "colocated" else "rollout"
        generations = [e for e in groups.log if e[1] == "generate" and int(e[2]) == step]
        assert [e[0] for e in generations] == [generator] * draws
        if placement == "split":  # every draw on the weights of version step - 1
            assert {e[3] for e in generations} == {str(step - 1)}
        assert [e for e in groups.log[start:] if e[1] == "log_probs"] == [
            ("actor", "log_probs", str(BATCH * N))
        ]
        assert generated.batch["old_log_probs"].shape == (BATCH * N, 1)
        # a checkpoint of this step resumes past every draw it made
        assert source.loader_state == loader_state_after(source, draws_so_far)
        groups.actor_version = step
        source.updated(step)


def test_when_the_draws_run_out_tied_groups_fill_the_step(capsys) -> None:
    cfg = load_config("configs/grpo_tiny.yaml", [*SMALL, "algorithm.dynamic_sampling.max_draws=1"])
    expected = expected_steps(cfg, 6)
    step = next(i for i, (_, _, filled) in enumerate(expected, start=1) if filled)
    _, dynamic = sampling(cfg)
    for earlier in range(1, step):
        dynamic.take(earlier, no_timer)
    generated, _, _ = dynamic.take(step, no_timer)
    prompts, _, filled = expected[step - 1]
    assert [r["prompt"] for r in generated.records] == prompts  # all of the one draw
    assert generated.metrics["dynamic_sampling/filled_groups"] == filled
    assert generated.metrics["dynamic_sampling/tied_groups"] == filled
    assert generated.metrics["dynamic_sampling/dropped_groups"] == 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert line == (
        f"step {step}: dynamic sampling found {BATCH - filled} groups whose scores vary in 1 "
        f"draw (algorithm.dynamic_sampling.max_draws=1); {filled} tied groups fill the step"
    )


def test_a_step_where_every_group_ties_draws_up_to_the_bound_and_says_so(capsys) -> None:
    def all_tie(generated: GeneratedStep) -> tuple[torch.Tensor, dict[str, float]]:
        return torch.ones(len(generated.batch)), {}

    cfg = load_config("configs/grpo_tiny.yaml", [*SMALL, "algorithm.dynamic_sampling.max_draws=3"])
    groups, dynamic = sampling(cfg, all_tie)
    generated, scores, _ = dynamic.take(1, no_timer)
    assert len([e for e in groups.log if e[1] == "generate"]) == 3  # the bound, no more
    metrics = generated.metrics
    assert metrics["dynamic_sampling/draws"] == 3
    assert metrics["dynamic_sampling/tied_groups"] == metrics["dynamic_sampling/drawn_groups"] == 12
    assert metrics["dynamic_sampling/filled_groups"] == BATCH  # the first draw's, in order
    assert metrics["dynamic_sampling/dropped_groups"] == 2 * BATCH
    first = step_source(DrawingGroups(0), cfg).loader
    assert [r["prompt"] for r in generated.records] == [r["prompt"] for r in next(first)]
    assert scores.tolist() == [1.0] * BATCH * N
    assert "0 groups whose scores vary in 3 draws" in capsys.readouterr().out


def test_the_draws_reward_metrics_read_as_one_scoring() -> None:
    merged = merge_draw_metrics(
        [
            (8, {"reward/fn/mean": 0.5, "reward/model/truncated": 1.0, "perf/max_x": 2.0}),
            (24, {"reward/fn/mean": 1.0, "reward/model/truncated": 2.0, "perf/max_x": 1.0}),
        ]
    )
    assert merged == {"reward/fn/mean": 0.875, "reward/model/truncated": 3.0, "perf/max_x": 2.0}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=8"],
            "algorithm.dynamic_sampling.enable=true needs algorithm.adv_estimator in grpo, rloo, "
            "reinforce_plus_plus_baseline (a baseline over each prompt's group, which gives a "
            "group whose scores tie no advantage), got gae",
        ),
        (
            ["rollout.placement=split", "rollout.max_staleness=1"],
            "needs rollout.max_staleness = 0 (the extra prompts are drawn and generated once "
            "the step's scores are known), got 1",
        ),
        (["rollout.randomness=per_rank"], "needs rollout.randomness = per_sample"),
        (
            ["algorithm.dynamic_sampling.enable=false", "algorithm.overlong.buffer=5"],
            "algorithm.overlong.buffer=5 is longer than the response limit of 4 tokens; use "
            "at most 4",
        ),
    ],
)
def test_settings_dynamic_sampling_cannot_run_with_are_refused(
    overrides: list[str], message: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config("configs/grpo_tiny.yaml", [*SMALL, *overrides])
