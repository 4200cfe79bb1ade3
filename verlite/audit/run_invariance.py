"""The whole-run audit behind ``verlite check-invariance --run``.

The configured job trains for a few steps under several layouts: actor and critic worker
counts, DDP or FSDP, micro-batches of one row, of the worker's whole share, or cut by a
token budget, and with a reward model its group's worker count and micro-batch. Each is a
real run on Ray, with its own worker groups and output folder. Every run's
``metrics.jsonl`` is compared with the first layout's, step by step, with ``verlite
compare``'s comparison (``verlite.records.compare``).

A run is the same run under every layout because each stage follows the data order, not
the layout: sampling draws from keys that name each response (``verlite.generation.noise``),
the losses are normalized by global counts (``verlite.core.losses``), and rewards,
advantages, statistics and validation run on the driver over the whole step batch.
``negative_control`` samples with one random stream per actor worker instead
(``rollout.randomness=per_rank``): runs with different actor worker counts then differ from
the first step.

In float64 the runs agree to rounding (1e-9 relative). In float32 they agree to 1e-5 for a
while (20-25 steps of the main job), then drift: the layouts sum in different orders, and
AdamW turns the rounding of small gradient entries into parameter differences that grow
step by step; once logits differ, a token whose probability is that close to its uniform
flips, and the runs train on different data. ``RunReport.identical_steps`` says how many
steps stayed within tolerance.
"""

from __future__ import annotations

import contextlib
import io
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from verlite.audit.invariance import MICRO_LAYOUTS, STRATEGIES, micro_settings
from verlite.config import Config, ConfigError, load_config
from verlite.config.fields import MAX_INT
from verlite.errors import UserError, shown
from verlite.records import metrics_log
from verlite.records.compare import compared_metrics, first_difference, relative_difference
from verlite.records.metrics_log import Record
from verlite.user_files import resolved_path

if TYPE_CHECKING:
    from verlite.driver.preflight import RunInputs


@dataclass(frozen=True)
class RoleLayout:
    """How one role runs: its worker count, strategy and micro layout."""

    workers: int
    strategy: str
    micro: str

    def __str__(self) -> str:
        return f"{self.workers} {self.strategy} micro {self.micro}"

    @property
    def spec(self) -> str:
        """As ``--layout`` spells it: ``WORKERS:STRATEGY:MICRO``."""
        return f"{self.workers}:{self.strategy}:{self.micro}"


@dataclass(frozen=True)
class RewardLayout:
    """How a reward model's group runs: its worker count and rows per micro-batch, a number
    or ``full`` (a step's rows, so that each worker scores its share of a step in one
    forward)."""

    workers: int
    micro: str

    def __str__(self) -> str:
        return f"{self.workers} micro {self.micro}"

    @property
    def spec(self) -> str:
        """As ``--layout`` spells it: ``WORKERS:MICRO``."""
        return f"{self.workers}:{self.micro}"

    def overrides(self, cfg: Config) -> list[str]:
        """The config overrides that run ``cfg``'s reward model's group so."""
        micro = cfg.sequences_per_step if self.micro == "full" else int(self.micro)
        return [
            f"reward.model.workers_per_node={self.workers}",
            f"reward.model.micro_batch_size_per_worker={micro}",
        ]


@dataclass(frozen=True)
class RunLayout:
    actor: RoleLayout
    critic: RoleLayout
    reward: RewardLayout | None = None  # a reward model's group; None: the config's

    def describe(self, use_critic: bool) -> str:
        return (
            f"actor {self.actor}"
            + (f", critic {self.critic}" if use_critic else "")
            + ("" if self.reward is None else f", reward {self.reward}")
        )

    @property
    def spec(self) -> str:
        """As ``--layout`` spells it: ``A/C``, then ``/R`` with a reward part."""
        reward = "" if self.reward is None else f"/{self.reward.spec}"
        return f"{self.actor.spec}/{self.critic.spec}{reward}"

    @property
    def workers(self) -> int:
        reward = 0 if self.reward is None else self.reward.workers
        return self.actor.workers + self.critic.workers + reward


# The first is the reference. Together they cover actor workers 1/2/4, critic workers 1/2,
# micro-batches of 1 row, the full share and a token budget, and both strategies.
DEFAULT_LAYOUTS = (
    RunLayout(RoleLayout(1, "ddp", "full"), RoleLayout(1, "ddp", "full")),
    RunLayout(RoleLayout(2, "fsdp", "1"), RoleLayout(2, "ddp", "dynamic")),
    RunLayout(RoleLayout(4, "ddp", "dynamic"), RoleLayout(1, "fsdp", "1")),
    RunLayout(RoleLayout(4, "fsdp", "full"), RoleLayout(2, "fsdp", "full")),
)
# With a reward model, the reward group's: the reference scores a step in one forward on one
# worker, the others on 2 workers in micro-batches of 1 to 3 rows.
DEFAULT_REWARD_LAYOUTS = (
    RewardLayout(1, "full"),
    RewardLayout(2, "1"),
    RewardLayout(2, "3"),
    RewardLayout(2, "2"),
)
LAYOUT_SYNTAX = (
    "WORKERS:STRATEGY:MICRO for the actor, then optionally /WORKERS:STRATEGY:MICRO for the critic "
    "and /WORKERS:MICRO for a reward model's group"
)


def parse_layout(text: str) -> RunLayout:
    """``2:fsdp:1/2:ddp:dynamic/2:3``: the actor's layout, then the critic's (default
    1:ddp:full), then a reward model's group's (default: the config's)."""
    parts = text.split("/")
    if len(parts) > 3:
        raise UserError(f"--layout {shown(text)}: expected {LAYOUT_SYNTAX}")
    roles = [
        _parse_role(text, role, part)
        for role, part in zip(("actor", "critic"), parts, strict=False)
    ]
    critic = roles[1] if len(roles) == 2 else RoleLayout(1, "ddp", "full")
    reward = _parse_reward(text, parts[2]) if len(parts) == 3 else None
    return RunLayout(roles[0], critic, reward)


# What a layout's count of workers or rows may be: the config's counts are bounded so.
COUNT = f"an integer from 1 to {MAX_INT}"


def _count(text: str) -> int | None:
    """A layout's count of workers or rows (:data:`COUNT`, in ASCII digits), or None: no
    count (str.isdigit alone takes '²', which int() refuses, and int() refuses more digits
    than Python reads)."""
    if not (text.isascii() and text.isdigit()) or len(text) > len(str(MAX_INT)):
        return None
    return int(text) if 1 <= int(text) <= MAX_INT else None


def _parse_reward(text: str, part: str) -> RewardLayout:
    fields = part.split(":")
    if len(fields) != 2:
        raise UserError(
            f"--layout {shown(text)}: expected {LAYOUT_SYNTAX}, e.g. 2:fsdp:1/1:ddp:full/2:3"
        )
    workers, micro = fields
    count = _count(workers)
    if count is None:
        raise UserError(
            f"--layout {shown(text)}: reward workers {shown(workers)}: expected {COUNT}"
        )
    if micro != "full" and _count(micro) is None:
        raise UserError(
            f"--layout {shown(text)}: reward micro {shown(micro)}: expected a number of rows "
            f"({COUNT}) or full"
        )
    return RewardLayout(count, micro)


def run_layouts(cfg: Config, layouts: Sequence[RunLayout] | None = None) -> list[RunLayout]:
    """The layouts ``cfg``'s job runs under: ``layouts``, or :data:`DEFAULT_LAYOUTS` (with
    :data:`DEFAULT_REWARD_LAYOUTS` when ``cfg`` has a reward model). With a reward model, a
    layout without a reward part is given the config's reward group, so that its report
    names it; without one, a reward part is refused."""
    reward_model = cfg.reward.model
    if layouts is None:
        if reward_model.path is None:
            return list(DEFAULT_LAYOUTS)
        return [
            replace(layout, reward=reward)
            for layout, reward in zip(DEFAULT_LAYOUTS, DEFAULT_REWARD_LAYOUTS, strict=True)
        ]
    if reward_model.path is None:
        for layout in layouts:
            if layout.reward is not None:
                raise UserError(
                    f"--layout {layout.spec}: the reward part {layout.reward.spec} is for a "
                    "reward model's group, and the config has none (reward.model.path is unset); "
                    "give WORKERS:STRATEGY:MICRO[/WORKERS:STRATEGY:MICRO]"
                )
        return list(layouts)
    assert reward_model.workers_per_node is not None  # validation fills it
    configured = RewardLayout(
        reward_model.workers_per_node, str(reward_model.micro_batch_size_per_worker)
    )
    return [
        layout if layout.reward is not None else replace(layout, reward=configured)
        for layout in layouts
    ]


def _parse_role(text: str, role: str, part: str) -> RoleLayout:
    fields = part.split(":")
    if len(fields) != 3:
        raise UserError(
            f"--layout {shown(text)}: expected {LAYOUT_SYNTAX}, e.g. 2:fsdp:1/2:ddp:dynamic"
        )
    workers, strategy, micro = fields
    count = _count(workers)
    if count is None:
        raise UserError(
            f"--layout {shown(text)}: {role} workers {shown(workers)}: expected {COUNT}"
        )
    if strategy not in STRATEGIES:
        raise UserError(
            f"--layout {shown(text)}: {role} strategy {shown(strategy)}: expected one of "
            f"{', '.join(STRATEGIES)}"
        )
    if micro not in MICRO_LAYOUTS and _count(micro) is None:
        raise UserError(
            f"--layout {shown(text)}: {role} micro {shown(micro)}: expected a number of rows "
            f"({COUNT}) or one of {', '.join(m for m in MICRO_LAYOUTS if not m.isdigit())}"
        )
    return RoleLayout(count, strategy, micro)


def layout_overrides(cfg: Config, layout: RunLayout) -> list[str]:
    """The config overrides that run ``cfg``'s job under ``layout`` on one node."""
    overrides = []
    for role in cfg.roles:
        role_layout: RoleLayout = getattr(layout, role)
        micro = micro_settings(
            role_layout.micro,
            rows_per_worker=getattr(cfg, role).ppo_mini_batch_size // role_layout.workers,
            longest=cfg.max_sequence_length,
        )
        settings = {
            "workers_per_node": role_layout.workers,
            "strategy": role_layout.strategy,
            **micro,
        }
        overrides += [f"{role}.{key}={str(value).lower()}" for key, value in settings.items()]
    if layout.reward is not None:
        overrides += layout.reward.overrides(cfg)
    return overrides


@dataclass(frozen=True)
class RunReport:
    """One layout's run against the reference's."""

    layout: str
    steps: int
    identical_steps: int  # leading steps within tolerance
    worst: float  # largest relative difference of any metric beyond the absolute tolerance
    first_difference: str | None
    seconds: float

    @property
    def ok(self) -> bool:
        return self.first_difference is None


def compare_runs(
    run: list[Record],
    reference: list[Record],
    *,
    layout: str,
    tolerance: float,
    atol: float,
    seconds: float,
) -> RunReport:
    difference = first_difference(run, reference, tolerance=tolerance, atol=atol)
    worst = 0.0
    references = {r["step"]: compared_metrics(r) for r in reference}
    for record in run:
        expected = references.get(record["step"], {})
        for key, value in compared_metrics(record).items():
            if key in expected and abs(value - expected[key]) > atol:
                worst = max(worst, relative_difference(value, expected[key]))
    return RunReport(
        layout=layout,
        steps=len(run),
        identical_steps=len(run) if difference is None else difference.step - 1,
        worst=worst,
        first_difference=None
        if difference is None
        else difference.describe("this run", "the reference"),
        seconds=seconds,
    )


def _make_runs_dir(runs_dir: Path) -> None:
    """Make ``runs_dir``, a new or empty folder, now: a path that cannot be one fails in one
    line before Ray starts."""
    named = f"--runs-dir {shown(str(runs_dir))}"
    resolved_path(runs_dir, named)  # a link loop: one line that says so
    if runs_dir.exists() and not runs_dir.is_dir():
        raise UserError(f"{named}: not a folder; give a new or empty one")
    try:
        runs_dir.mkdir(parents=True, exist_ok=True)
        empty = not any(runs_dir.iterdir())
    except OSError as exc:
        raise UserError(f"{named}: cannot make the folder: {exc.strerror}") from None
    if not empty:
        raise UserError(f"{named}: the folder is not empty; give a new or empty one")


def layout_configs(
    base: Config,
    layouts: Sequence[RunLayout],
    *,
    steps: int,
    runs_dir: Path,
    negative_control: bool = False,
) -> list[Config]:
    """The config of each layout's run of ``base`` (the user's config and overrides, loaded
    once): ``steps`` steps into ``runs_dir/<index>``, each checked as ``verlite train`` would
    check it."""
    if len(layouts) < 2:
        raise UserError(
            f"--run compares layouts with the first: give at least 2, got {len(layouts)}"
        )
    _make_runs_dir(runs_dir)
    fixed = [
        f"trainer.total_steps={steps}",
        "trainer.nnodes=1",
        "trainer.save_freq=0",
        "trainer.resume=disable",
        "trainer.loggers=[jsonl]",
        f"rollout.randomness={'per_rank' if negative_control else 'per_sample'}",
    ]
    if base.use_critic:
        # the actor trains from the first step, so that a few steps audit its updates too
        # (set only where a critic warms up: a run names a setting without effect)
        fixed.append("critic.warmup_steps=0")
    configs = []
    for index, layout in enumerate(layouts):
        layout_keys = layout_overrides(base, layout)
        try:
            configs.append(
                load_config(
                    base, [*fixed, *layout_keys, f"trainer.output_dir={runs_dir / str(index)}"]
                )
            )
        except ConfigError as exc:  # it names the keys the layout set: say which layout
            raise ConfigError(f"--layout {layout.spec} ({' '.join(layout_keys)}): {exc}") from None
    return configs


@dataclass(frozen=True)
class PreparedRun:
    """A layout's run checked and its inputs read (``driver.run.prepare_run``), and what
    that printed, which goes first into the run's ``console.log``."""

    inputs: RunInputs
    printed: str


def prepare_runs(
    configs: Sequence[Config],
    layouts: Sequence[RunLayout],
    *,
    in_session: bool,
    cpus: int | None = None,
) -> list[PreparedRun]:
    """Each layout's run checked as ``verlite train`` checks it before its workers start
    (``driver.run.prepare_run``; ``in_session`` and ``cpus`` as there), its output folder
    made and held. A refusal of a later layout's run is that layout's (the first passed the
    checks they share) and names it; the folders held so far are let go."""
    from verlite.driver.run import prepare_run

    prepared: list[PreparedRun] = []
    try:
        for index, (layout, cfg) in enumerate(zip(layouts, configs, strict=True)):
            printed = io.StringIO()  # the command's own output is the table or the JSON
            try:
                with contextlib.redirect_stdout(printed):
                    inputs = prepare_run(cfg, in_session=in_session, cpus=cpus)
            except UserError as exc:
                if index == 0:
                    raise
                raise UserError(f"--layout {layout.spec}: {exc}") from None
            inputs.set_aside()  # every layout's are held until its run
            prepared.append(PreparedRun(inputs, printed.getvalue()))
    except BaseException:
        release(prepared)
        raise
    return prepared


def release(prepared: Sequence[PreparedRun]) -> None:
    """Let go of the output folders of ``prepared`` runs (those that ran already have)."""
    for run in prepared:
        run.inputs.folder.release()


def audit_runs(
    configs: Sequence[Config],
    layouts: Sequence[RunLayout],
    *,
    tolerance: float,
    atol: float,
    progress: Callable[[str], None] = lambda line: None,
    prepared: Sequence[PreparedRun] | None = None,
) -> list[RunReport]:
    """Train each config in the open Ray session (its console output into ``console.log``
    in its folder) and compare each run's metrics with the first's. ``prepared``: the runs
    :func:`prepare_runs` checked before the session opened; None: each is checked in it,
    before it starts."""
    from verlite.driver.run import run

    records: list[list[Record]] = []
    reports: list[RunReport] = []
    for index, (layout, cfg) in enumerate(zip(layouts, configs, strict=True)):
        name = layout.describe(cfg.use_critic)
        progress(f"run {index + 1}/{len(layouts)}: {name} ...")
        started = time.monotonic()
        if prepared is None:
            (this,) = prepare_runs([cfg], [layout], in_session=True)
        else:
            this = prepared[index]
        folder = Path(cfg.trainer.output_dir)
        with (folder / "console.log").open("w") as log, contextlib.redirect_stdout(log):
            log.write(this.printed)
            run(cfg, this.inputs)
        records.append(metrics_log.read(folder))
        reports.append(
            compare_runs(
                records[-1],
                records[0],
                layout=name,
                tolerance=tolerance,
                atol=atol,
                seconds=time.monotonic() - started,
            )
        )
    return reports


def _ray_cpus(cfg: Config, layout: RunLayout) -> int:
    """The CPUs an embedded Ray needs for ``layout``'s run: one a worker, or what its workers
    ask for where that is more (``trainer.cpus_per_worker`` above 1, a rollout or reward
    model group beside the actor and critic)."""
    from verlite.controller import resources_asked

    return max(layout.workers, math.ceil(round(resources_asked(cfg, "CPU"), 4)))


def check_run_invariance(
    base: Config,
    layouts: Sequence[RunLayout] | None = None,
    *,
    steps: int,
    tolerance: float,
    atol: float,
    runs_dir: Path,
    negative_control: bool = False,
    progress: Callable[[str], None] = lambda line: None,
) -> list[RunReport]:
    """:func:`layout_configs` of ``base`` (the user's config, loaded once) for
    :func:`run_layouts` (``layouts``, or the defaults when None), every run checked (:func:`prepare_runs`) before Ray starts, then
    :func:`audit_runs` in a Ray session of its own: an embedded one with the CPUs the
    largest layout's workers ask for, at least one a worker (:func:`_ray_cpus`), or
    ``trainer.ray_address``."""
    from verlite.controller import ray_session

    layouts = run_layouts(base, layouts)
    configs = layout_configs(
        base,
        layouts,
        steps=steps,
        runs_dir=runs_dir,
        negative_control=negative_control,
    )
    address = configs[0].trainer.ray_address
    cpus = None if address else max(map(_ray_cpus, configs, layouts))
    prepared = prepare_runs(configs, layouts, in_session=False, cpus=cpus)
    try:
        with ray_session(address, num_cpus=cpus):
            return audit_runs(
                configs,
                layouts,
                tolerance=tolerance,
                atol=atol,
                progress=progress,
                prepared=prepared,
            )
    finally:
        release(prepared)  # the runs a failure left unrun
