"""Run every benchmark (or those named: ``python -m benchmarks.run_all NAME ...``, which
keeps the other entries of the file), each in a fresh process, and write
``benchmarks/results.json``.

``make bench`` calls this. Each benchmark prints one JSON object as the last line of its
stdout; the results file holds them by name, with the command that produced each, its
wall time, and the machine's load average before it started (other work on the machine
moves absolute times; the figures themselves are side-by-side ratios).
"""

from __future__ import annotations

import argparse
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


def parse_names(argv: list[str]) -> list[str]:
    """The benchmarks to run, all by default; an unknown name (``--help``'s flags aside) is
    refused in one line, exit 2, before any runs."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.run_all",
        description="Run the named benchmarks (default: all), each in a fresh process, and write "
        "their results to benchmarks/results.json (other entries of the file are kept when "
        "names are given).",
    )
    parser.add_argument("names", nargs="*", metavar="NAME", help=", ".join(BENCHMARKS))
    names = parser.parse_args(argv).names
    unknown = [name for name in names if name not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark {unknown[0]!r}; allowed: {', '.join(BENCHMARKS)}")
    return names


def main(argv: list[str] | None = None) -> None:
    given = parse_names(sys.argv[1:] if argv is None else argv)
    names = given or list(BENCHMARKS)
    results = {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "benchmarks": {},
    }
    if given and RESULTS.exists():
        results["benchmarks"] = json.loads(RESULTS.read_text())["benchmarks"]
    for name in names:
        print(f"running benchmarks.{name} ...", flush=True)
        results["benchmarks"][name] = entry = run(name)
        print(json.dumps(entry["result"]), flush=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
