"""``timing_s/step`` is what a step costs the run: its training, validation and checkpoint
(``Trainer.run_step``), so that the steps' sum (``verlite metrics``' wall time) is the run's;
a checkpoint is put in place only once its step is logged."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from verlite.config import load_config
from verlite.driver.trainer import Trainer
from verlite.records import metrics_log

# Seconds each part of a step takes here.
TRAIN, VALIDATE, WRITE = 0.05, 0.1, 0.2


class StagedTrainer(Trainer):
    """Trainer.fit over stages that sleep for known times; no workers."""

    def __init__(self, cfg: Any) -> None:
        self.cfg, self.output_dir, self.restarts = cfg, Path(cfg.trainer.output_dir), 0
        self.groups = SimpleNamespace(all=[])
        self.step_source = SimpleNamespace(start=lambda version: None)
        self.old_log_probs_line = ""
        self.placed: list[tuple[str, list[int]]] = []

    def train_step(self, step: int) -> dict[str, float]:
        time.sleep(TRAIN)
        return {"critic/score/mean": 0.5}

    def validate(self) -> dict[str, float]:
        time.sleep(VALIDATE)
        return {"val/score/mean": 1.0}

    def write_checkpoint(self, step: int) -> Path:
        time.sleep(WRITE)
        return Path(f"step_{step}.tmp")

    def place_checkpoint(self, tmp: Path, seconds: float) -> None:
        logged = [int(r["step"]) for r in metrics_log.read(self.output_dir)]
        self.placed.append((tmp.name, logged))


def test_a_steps_time_counts_its_validation_and_checkpoint(tmp_path: Path) -> None:
    cfg = load_config(
        "configs/ppo_tiny.yaml",
        [
            "trainer.total_steps=3",
            "trainer.val_freq=2",
            "trainer.save_freq=2",
            "trainer.loggers=[jsonl]",
            f"trainer.output_dir={tmp_path}",
        ],
    )
    trainer = StagedTrainer(cfg)
    trainer.fit()
    one, two, three = metrics_log.read(tmp_path)
    # Step 1 only trains; step 2 also validates and saves; step 3 (the last) does all three.
    assert one["timing_s/step"] >= TRAIN
    assert "timing_s/validation" not in one and "timing_s/checkpoint" not in one
    for record in (two, three):
        assert record["timing_s/validation"] >= VALIDATE
        assert record["timing_s/checkpoint"] >= WRITE
        parts = record["timing_s/validation"] + record["timing_s/checkpoint"]
        assert parts + TRAIN <= record["timing_s/step"]  # lower bounds only: no timings
    # A checkpoint is put in place only once its step is in the log.
    assert trainer.placed == [("step_2.tmp", [1, 2]), ("step_3.tmp", [1, 2, 3])]
