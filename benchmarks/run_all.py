"""Run every benchmark (or those named: ``python -m benchmarks.run_all NAME ...``, which
keeps the other entries of the file), each in a fresh process, and write
``benchmarks/results.json``.

``make bench`` calls this. Each benchmark prints one JSON object as the last line of its
stdout; the results file holds them by name, with the command that produced each, its
wall time, and the machine's load average before it started (other work on the machine
moves absolute times; the figures themselves are side-by-side ratios).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

BENCHMARKS = (
    "orchestration",
    "dynamic_batching",
    "rollout",
    "dispatch",
    "scaling",
    "weight_sync",
    "async_training",
    "split_two_nodes",
    "varlen_attention",
    "multi_turn",
    "lora",
)
RESULTS = Path(__file__).with_name("results.json")


def run(name: str) -> dict[str, object]:
    command = [sys.executable, "-m", f"benchmarks.{name}"]
    load = os.getloadavg()[0]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"benchmarks.{name} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    lines = done.stdout.strip().splitlines()
    return {
        "command": " ".join(["python", "-m", f"benchmarks.{name}"]),
        "wall_s": round(seconds, 1),
        "load_average_before": round(load, 2),
        "result": json.loads(lines[-1]),
    }


def main() -> None:
    names = sys.argv[1:] or list(BENCHMARKS)
    results = {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "benchmarks": {},
    }
    if sys.argv[1:] and RESULTS.exists():
        results["benchmarks"] = json.loads(RESULTS.read_text())["benchmarks"]
    for name in names:
        print(f"running benchmarks.{name} ...", flush=True)
        results["benchmarks"][name] = entry = run(name)
        print(json.dumps(entry["result"]), flush=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
