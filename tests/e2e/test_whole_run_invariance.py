"""A whole run does not depend on its layout: PPO with a critic and GRPO, 10 steps in
float64, under actor worker counts 1, 2 and 4, critic worker counts 1 and 2, micro-batches
of one row, of the worker's share and cut by a token budget, DDP and FSDP, log the same
metrics.jsonl (every non-timing metric) to 1e-9 on the shared embedded Ray. The negative
control, one sampling stream per actor worker (the old ``seed + rank``), differs at step 1.
"""

from pathlib import Path

import pytest

from verlite.run_invariance import (
    ATOL,
    RoleLayout,
    RunLayout,
    audit_runs,
    layout_configs,
)

TOLERANCE = 1e-9
# Half a CPU a worker: the 5 workers of the largest layout fit the shared Ray's 4 CPUs.
SMALL = ("model.dtype=float64", "trainer.cpus_per_worker=0.5")


def layout(actor: str, critic: str = "1:ddp:full") -> RunLayout:
    def role(text: str) -> RoleLayout:
        workers, strategy, micro = text.split(":")
        return RoleLayout(int(workers), strategy, micro)

    return RunLayout(role(actor), role(critic))


def audit(config: str, overrides: list[str], layouts: list[RunLayout], tmp: Path, **kw):
    configs = layout_configs(config, [*SMALL, *overrides], layouts, runs_dir=tmp, **kw)
    return audit_runs(configs, layouts, tolerance=TOLERANCE, atol=ATOL)


@pytest.mark.parametrize(
    ("config", "overrides", "layouts"),
    [
        pytest.param(
            "configs/ppo_tiny.yaml",
            # 16 prompts a step, one update of 16 rows per role
            ["data.train_batch_size=16"],
            [
                layout("1:ddp:full", "1:ddp:full"),
                layout("2:fsdp:1", "2:ddp:dynamic"),
                layout("4:ddp:dynamic", "1:fsdp:1"),
            ],
            id="ppo-critic",
        ),
        pytest.param(
            "configs/grpo_tiny.yaml",
            # 4 prompts x 8 samples, one update of 32 rows
            ["data.train_batch_size=4", "actor.ppo_mini_batch_size=32"],
            [layout("1:ddp:full"), layout("2:fsdp:dynamic"), layout("4:ddp:1")],
            id="grpo",
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
    # every run validated at its last step, and the policy moved: the audit compared training
    records = (tmp_path / "0" / "metrics.jsonl").read_text()
    assert '"val/score/mean"' in records and '"actor/grad_norm"' in records


def test_the_negative_control_one_stream_per_rank_differs_at_the_first_step(
    tmp_path: Path, local_ray
) -> None:
    reports = audit(
        "configs/ppo_tiny.yaml",
        ["data.train_batch_size=16"],
        [layout("1:ddp:full"), layout("2:ddp:full")],
        tmp_path,
        steps=2,
        negative_control=True,
    )
    assert not reports[1].ok and reports[1].identical_steps == 0
    assert reports[1].worst > 1e-3
