"""End-to-end runs: whole training runs in this process on the shared embedded Ray (a run
places and removes its own worker groups), and the command line as a user runs it."""

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from verlite.config import Config, load_config
from verlite.driver.preflight import RunInputs
from verlite.driver.run import run
from verlite.records.metrics_log import is_run_history

CONFIG = "configs/ppo_tiny.yaml"
# The main job's critic warm-up would leave the actor untrained in runs of a few steps.
SHORT_RUN = ("critic.warmup_steps=0",)


def verlite(*args: str, timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "verlite.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        **kwargs,
    )


def train_run(out: Path, *overrides: str) -> Config:
    """A whole run of the main config into ``out``, as `verlite train` does after Ray starts;
    the actor trains from the first step unless ``overrides`` say otherwise."""
    cfg = load_config(CONFIG, [f"trainer.output_dir={out}", *SHORT_RUN, *overrides])
    run(cfg, RunInputs.load(cfg))
    return cfg


def read_metrics(out: Path, *, stable_only: bool = False) -> list[dict]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    if stable_only:
        return [{k: v for k, v in r.items() if not is_run_history(k)} for r in records]
    return records


@pytest.fixture
def cli() -> Callable[..., subprocess.CompletedProcess]:
    return verlite


@pytest.fixture
def train(local_ray) -> Callable[..., Config]:
    return train_run


@pytest.fixture(scope="module")
def train_for_module(shared_ray) -> Callable[..., Config]:
    """:func:`train_run` for a module-scoped fixture (a run several tests compare with)."""
    shared_ray.ensure()
    return train_run


@pytest.fixture
def metrics() -> Callable[..., list[dict]]:
    return read_metrics
