"""`make gpu-check`: CUDA, NCCL and bfloat16 on every visible GPU, as one table.

1. ``verlite check-invariance`` of the main config with ``model.device=cuda``: every rank on
   its own GPU, the ranks joined over NCCL, dp 1, 2, 4 and 8 as far as the GPUs go, in
   float32 and in bfloat16 (parameters and compute; verlite has no mixed-precision mode with
   float32 master weights yet).
2. The main job (``make run``) on cuda, its actor and critic sharing GPU 0.

On a machine without a GPU it says so and exits 0. CI does not run it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from verlite.audit.invariance import check_invariance, tolerance_for
from verlite.config import load_config
from verlite.table import format_table

CONFIG = "configs/ppo_tiny.yaml"
OUTPUT_DIR = "outputs/gpu_check"


def audit(dtype: str, dps: list[int]) -> tuple[str, ...]:
    cfg = load_config(CONFIG, ["model.device=cuda", f"model.precision={dtype}"])
    started = time.monotonic()
    reports = check_invariance(cfg, dps=dps)
    worst, tolerance = max(r.worst() for r in reports), tolerance_for(cfg)
    return (
        f"check-invariance {dtype}",
        f"{len(reports)} layouts, NCCL dp {','.join(map(str, dps))}",
        f"worst {worst:.1e} (tolerance {tolerance:g})",
        f"{time.monotonic() - started:.0f} s",
        "ok" if worst <= tolerance else "FAILED",
    )


def main_job() -> tuple[str, ...]:
    overrides = [
        "model.device=cuda",
        "trainer.gpus_per_worker=1",  # colocated: actor and critic take half of it each
        f"trainer.output_dir={OUTPUT_DIR}",
        "trainer.overwrite=true",
    ]
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "verlite", "train", "--config", CONFIG, *overrides], check=False
    )
    seconds = time.monotonic() - started
    metrics = Path(OUTPUT_DIR, "metrics.jsonl")
    vals = [
        record["val/score/mean"]
        for record in map(json.loads, metrics.read_text().splitlines() if metrics.exists() else [])
        if "val/score/mean" in record
    ]
    last = f"final validation {vals[-1]:.3f}" if vals else "no validation"
    return (
        "main job on cuda",
        f"{len(vals)} validations",
        last,
        f"{seconds:.0f} s",
        "ok" if done.returncode == 0 else f"FAILED (exit {done.returncode})",
    )


def main() -> int:
    if torch.version.cuda is None:
        print(
            f"gpu-check: no GPU visible here: torch {torch.__version__} is a CPU build, which "
            "sees none even on a machine with GPUs (install a CUDA build of the same version "
            "there); nothing to check"
        )
        return 0
    gpus = torch.cuda.device_count()
    if gpus == 0:
        print("gpu-check: no GPU visible here (torch.cuda.device_count() is 0): nothing to check")
        return 0
    dps = [dp for dp in (1, 2, 4, 8) if dp <= gpus]
    print(f"gpu-check: {gpus} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    rows = [audit("fp32", dps), audit("bf16", dps), main_job()]
    print(format_table(rows))
    return 0 if all(row[-1] == "ok" for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
