"""Run the verlite command line as a user would: a subprocess, its metrics read back."""

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

CONFIG = "configs/ppo_tiny.yaml"
VOLATILE = ("timing_s/", "perf/")  # wall-clock figures differ between otherwise equal runs


def verlite(*args: str, timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "verlite.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        **kwargs,
    )


def train_run(out: Path, *overrides: str, **kwargs) -> subprocess.CompletedProcess:
    """`verlite train` of the main config into ``out``; asserts it succeeded."""
    proc = verlite("train", "--config", CONFIG, f"trainer.output_dir={out}", *overrides, **kwargs)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def read_metrics(out: Path, *, stable_only: bool = False) -> list[dict]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    if stable_only:
        return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in records]
    return records


@pytest.fixture
def cli() -> Callable[..., subprocess.CompletedProcess]:
    return verlite


@pytest.fixture
def train() -> Callable[..., subprocess.CompletedProcess]:
    return train_run


@pytest.fixture
def metrics() -> Callable[..., list[dict]]:
    return read_metrics
