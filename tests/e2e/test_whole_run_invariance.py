"""A whole run does not depend on its layout: PPO with a critic and GRPO, 10 steps in
float64, under actor and critic worker counts 1, 2 and 4, micro-batches
of one row, of the worker's share and cut by a token budget, padded or packed, DDP and
FSDP, log the same
metrics.jsonl (every non-timing metric) to 1e-9 on the shared embedded Ray; so do GRPO with
DAPO's filters, a multi-turn run with the overlong filter and REINFORCE++ with the KL in the
reward under two layouts, and a run scored by a reward model under two layouts of its group. The negative
control, one sampling stream per actor worker (the old ``seed + rank``), differs at step 1.
"""

import json
from pathlib import Path

import pytest

from tests.e2e.test_e2e_train import CRITIC_KEYS, STEP_KEYS
from tests.reward_model_support import save_tiny_reward_model
from verlite.audit.run_invariance import (
    RoleLayout,
    RunLayout,
    audit_runs,
    compare_runs,
    layout_configs,
    parse_layout,
)
from verlite.audit.tolerances import RUN_ATOL
from verlite.audit.tolerances import TOLERANCE as TOLERANCES
from verlite.config import load_config

# The command's defaults for these float64 runs.
TOLERANCE, ATOL = TOLERANCES["fp64"], RUN_ATOL["fp64"]
# Half a CPU a worker: the 8 workers of the largest layout fit the shared Ray's 4 CPUs.
SMALL = ("model.precision=fp64", "trainer.cpus_per_worker=0.5")


def layout(actor: str, critic: str = "1:ddp:full") -> RunLayout:
    def role(text: str) -> RoleLayout:
        workers, strategy, micro = text.split(":")
        return RoleLayout(int(workers), strategy, micro)

    return RunLayout(role(actor), role(critic))


def audit(config: str, overrides: list[str], layouts: list[RunLayout], tmp: Path, **kw):
    base = load_config(config, [*SMALL, *overrides])
    configs = layout_configs(base, layouts, runs_dir=tmp, **kw)
    return audit_runs(configs, layouts, tolerance=TOLERANCE, atol=ATOL)


@pytest.mark.parametrize(
    ("config", "overrides", "layouts"),
    [
        pytest.param(
            "configs/ppo_tiny.yaml",
            # 16 prompts a step; two actor updates of 8 rows, one critic update of 16
            [
                "data.train_batch_size=16",
                "actor.ppo_mini_batch_size=8",
                "actor.micro_batch_size_per_worker=8",
            ],
            [
                layout("1:ddp:full", "1:ddp:full"),
                layout("2:fsdp:1", "2:ddp:dynamic"),
                layout("4:ddp:dynamic", "4:fsdp:1"),
                layout("2:ddp:packed-dynamic", "2:fsdp:packed"),
            ],
            id="ppo-critic",
            # Two minutes of the 2-core machine: in make test-cluster (CI runs it), as the
            # GRPO case; the negative control runs in every make test.
            marks=pytest.mark.cluster,
        ),
        pytest.param(
            "configs/grpo_tiny.yaml",
            # 4 prompts x 8 samples, one update of 32 rows
            ["data.train_batch_size=4", "actor.ppo_mini_batch_size=32"],
            [
                layout("1:ddp:full"),
                layout("2:fsdp:dynamic"),
                layout("4:ddp:1"),
                layout("2:fsdp:packed-dynamic"),
            ],
            id="grpo",
            marks=pytest.mark.cluster,
        ),
    ],
)
def test_a_run_is_the_same_run_under_every_layout(
    config: str, overrides: list[str], layouts: list[RunLayout], tmp_path: Path, local_ray
) -> None:
    reports = audit(config, overrides, layouts, tmp_path, steps=10)
    for report in reports[1:]:
        assert report.ok, f"{report.layout}: {report.first_difference}"
        assert report.steps == report.identical_steps == 10
    # every step logged what a step logs, the last step validated
    records = [json.loads(line) for line in (tmp_path / "1" / "metrics.jsonl").open()]
    keys = STEP_KEYS | (CRITIC_KEYS if "ppo" in config else set())
    assert all(r.keys() >= keys for r in records), sorted(keys - records[0].keys())
    assert "val/score/mean" in records[-1]
    # the second layout's workers ran where workers.json says, each in its own process
    placement = json.loads((tmp_path / "1" / "workers.json").read_text())
    workers = {"actor": layouts[1].actor.workers, "critic": layouts[1].critic.workers}
    expected = [(role, rank) for role in ("actor", "critic") for rank in range(workers[role])]
    assert sorted((w["role"], w["rank"]) for w in placement) == (
        expected if "ppo" in config else expected[: workers["actor"]]
    )
    assert all(w["node_ip"] == "127.0.0.1" and w["resources"] for w in placement)
    assert len({w["pid"] for w in placement}) == len(placement)


DAPO = [
    # 4 prompts x 2 samples a step, one update of 8 rows: groups of two often tie
    "data.train_batch_size=4",
    "rollout.n=2",
    "actor.ppo_mini_batch_size=8",
    "actor.micro_batch_size_per_worker=8",
    "algorithm.dynamic_sampling.enable=true",
    "algorithm.dynamic_sampling.max_draws=2",
    "algorithm.overlong.buffer=2",
    "algorithm.overlong.filter=true",
]


@pytest.mark.cluster  # half a minute of the 2-core machine; CI runs make test-cluster
def test_a_run_with_dapos_filters_is_the_same_run_under_every_layout(
    tmp_path: Path, local_ray
) -> None:
    """Dynamic sampling drops tied groups, draws more and fills steps, and the overlong
    filter leaves rows out of the loss: the kept rows' counts are the same under any layout,
    so the runs are too."""
    layouts = [layout("1:ddp:full"), layout("2:fsdp:dynamic")]
    reports = audit("configs/grpo_tiny.yaml", DAPO, layouts, tmp_path, steps=5)
    assert reports[1].ok, f"{reports[1].layout}: {reports[1].first_difference}"
    assert reports[1].steps == reports[1].identical_steps == 5
    records = [json.loads(line) for line in (tmp_path / "0" / "metrics.jsonl").open()]
    # the run did what the test is about: steps drew more, tied groups filled one, rows left
    assert max(r["dynamic_sampling/draws"] for r in records) == 2
    assert any(r["dynamic_sampling/filled_groups"] > 0 for r in records)
    assert any(
        r["dynamic_sampling/tied_groups"] > r["dynamic_sampling/filled_groups"] for r in records
    )
    assert any(r["response_length/overlong_filtered"] > 0 for r in records)


MULTI_TURN = [
    # 4 prompts x 8 trajectories a step, two actor updates of 16 rows
    "data.train_batch_size=4",
    "actor.ppo_mini_batch_size=16",
    "actor.micro_batch_size_per_worker=16",
    "trainer.val_freq=0",
    "rollout.multi_turn.max_turns=2",
    # a response area of 6 tokens: a call and its observation fill it
    "rollout.multi_turn.max_total_length=14",
    "algorithm.overlong.filter=true",
]


@pytest.mark.cluster  # 20 s of the 2-core machine; CI runs make test-cluster
def test_a_multi_turn_run_is_the_same_run_under_two_actor_layouts(
    tmp_path: Path, local_ray
) -> None:
    """Multi-turn rows hold observation holes in their loss mask, in a response area wider
    than one turn, and the overlong filter leaves the trajectories cut short (out of turns or
    room) out of the policy loss: 2 actor workers, each generating and stepping the
    environments of its share, updating on packed rows cut by a token budget, log the run of
    one worker updating on its whole share. A trajectory's outcome must not depend on the
    rows it is generated beside: a turn as long as the most room a row has, not one token
    more, left a row's ``truncated`` (so the rows the filter keeps, and every count of the
    update) to its neighbours, and the runs parted at step 1."""
    layouts = [layout("1:ddp:full"), layout("2:ddp:packed-dynamic")]
    reports = audit("configs/tool_tiny.yaml", MULTI_TURN, layouts, tmp_path, steps=2)
    assert reports[1].ok, f"{reports[1].layout}: {reports[1].first_difference}"
    assert reports[1].steps == reports[1].identical_steps == 2
    records = [json.loads(line) for line in (tmp_path / "0" / "metrics.jsonl").open()]
    # the run did what the test is about: observations in the rows, trajectories filtered out
    assert sum(r["multiturn/observation_tokens/mean"] for r in records) > 0
    assert any(r["response_length/overlong_filtered"] > 0 for r in records)


REINFORCE_PLUS_PLUS_KL_IN_REWARD = [
    "data.train_batch_size=4",
    "actor.ppo_mini_batch_size=16",
    "actor.micro_batch_size_per_worker=16",
    "trainer.val_freq=0",
    "algorithm.adv_estimator=reinforce_plus_plus",
    "actor.loss_agg_mode=seq-mean-token-sum",
    "algorithm.use_kl_in_reward=true",
]


@pytest.mark.cluster  # a minute of the 2-core machine; CI runs make test-cluster
def test_reinforce_plus_plus_with_the_kl_in_the_reward_is_the_same_run_under_two_layouts(
    tmp_path: Path, local_ray
) -> None:
    """The float64 log-probs the actor recomputes come out a unit of rounding apart under
    another layout; the sampler-agreement metrics, a difference of log-probs (~1e-7), must
    take that as the same run (it failed at step 2 with an absolute tolerance of 1e-15:
    ``rollout/logprob_max_diff`` 7.5e-9 apart, relative)."""
    layouts = [layout("1:ddp:full"), layout("2:fsdp:dynamic")]
    reports = audit(
        "configs/grpo_tiny.yaml", REINFORCE_PLUS_PLUS_KL_IN_REWARD, layouts, tmp_path, steps=2
    )
    assert reports[1].ok, f"{reports[1].layout}: {reports[1].first_difference}"
    records = [json.loads(line) for line in (tmp_path / "0" / "metrics.jsonl").open()]
    assert all(r["rollout/logprob_max_diff"] > 0 for r in records)


REWARD_MODEL = [
    # 4 prompts x 8 samples a step, one update of 32 rows; half of each score the reward model's
    "data.train_batch_size=4",
    "actor.ppo_mini_batch_size=32",
    "reward.combine={fn: 0.5, model: 0.5}",
    "reward.model.max_length=8",  # most texts keep their last 8 tokens
    "data.num_val_samples=8",  # the last step validates, scored by the reward model too
]


@pytest.mark.cluster  # 20 s of the 2-core machine; CI runs make test-cluster
def test_a_reward_model_run_is_the_same_run_under_one_and_two_reward_workers(
    tmp_path: Path, local_ray
) -> None:
    """The reward group's layouts as ``--run`` spells them: one worker scoring a step's 32
    rows in one forward (``full``), and two scoring 16 each in micro-batches of 3, log the
    same run (the audit's default layouts vary the actor with it: twice as long). A row's
    score must not depend on how many rows it is scored with: a float32 sigmoid, whose CPU
    kernel rounds a tensor of 32 otherwise than a tensor of 3 (in the last unit), parted the
    runs at step 1 by 1e-7."""
    rm = save_tiny_reward_model(tmp_path / "rm")
    overrides = [*SMALL, *REWARD_MODEL, f"reward.model.path={rm}"]
    layouts = [
        parse_layout("1:ddp:full/1:ddp:full/1:full"),
        parse_layout("1:ddp:full/1:ddp:full/2:3"),
    ]
    reports = audit("configs/grpo_tiny.yaml", overrides, layouts, tmp_path / "runs", steps=2)
    assert reports[1].ok, f"{reports[1].layout}: {reports[1].first_difference}"
    assert reports[1].steps == reports[1].identical_steps == 2
    records = [json.loads(line) for line in (tmp_path / "runs" / "0" / "metrics.jsonl").open()]
    # the run did what the test is about: the reward model scored, texts were cut, validated
    assert all(0 < r["reward/model/mean"] < 1 for r in records)
    assert all(0 < r["reward/model/truncated"] < 32 for r in records)
    assert "val/reward/model/mean" in records[-1]
    placement = json.loads((tmp_path / "runs" / "1" / "workers.json").read_text())
    assert sorted(w["role"] for w in placement) == ["actor", "reward", "reward"]
    assert reports[1].layout == "actor 1 ddp micro full, reward 2 micro 3"


def test_a_unit_of_rounding_of_a_log_prob_is_the_same_run() -> None:
    """The step-2 records of the run above under 1 and 2 actor workers: their
    ``rollout/logprob_max_diff`` (the trainer's float64 log-probs less the sampler's float32
    ones) differ by 2^-49, one unit of rounding of a log-prob between 8 and 16, 7.5e-9 of the
    metric; their ``actor/pg_loss`` by 7.9e-13. The absolute tolerance takes the first as
    rounding; a loss 1e-8 off, relative, is still a difference."""
    reference = {"step": 2, "rollout/logprob_max_diff": 2.3680897642819332e-07}
    reference["actor/pg_loss"] = -0.0005610705042644604
    other = {"step": 2, "rollout/logprob_max_diff": 2.3680897820455016e-07}
    other["actor/pg_loss"] = -0.0005610705042649045

    def same(run: dict, ref: dict) -> bool:
        report = compare_runs([run], [ref], layout="2", tolerance=TOLERANCE, atol=ATOL, seconds=0)
        return report.ok

    assert same(other, reference)
    assert not same(
        {**reference, "actor/pg_loss": reference["actor/pg_loss"] * (1 + 1e-8)}, reference
    )


def test_the_negative_control_one_stream_per_rank_differs_at_the_first_step(cli) -> None:
    """As a user runs it: `verlite check-invariance --run --negative-control` in a process of
    its own (an embedded Ray of its own), one JSON object, exit 1."""
    proc = cli(
        "check-invariance",
        "--run",
        "--config",
        "configs/grpo_tiny.yaml",
        *SMALL,
        "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=32",
        "--layout",
        "1:ddp:full",
        "--layout",
        "2:ddp:full",
        "--steps",
        "1",
        "--negative-control",
        "--json",
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    report = json.loads(proc.stdout.splitlines()[-1])
    assert report["ok"] is False and (report["tolerance"], report["atol"]) == (TOLERANCE, ATOL)
    reference, other = report["runs"]
    assert reference["identical_steps"] == 1 and other["identical_steps"] == 0
    assert other["layout"] == "actor 2 ddp micro full" and other["worst"] > 1e-3
    assert other["first_difference"].startswith("step 1: ")
