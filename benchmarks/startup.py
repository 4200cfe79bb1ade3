"""Start-up of ``verlite train --config configs/ppo_tiny.yaml`` (one step, no export): the
seconds from the process's start to its first step's, split by phase, and the CPU seconds
the run's processes used by then; each run a fresh process with an embedded Ray of its own
(what a user's ``verlite train`` pays).

``--revs A,B`` runs git revisions of this repository side by side (each exported with ``git
archive`` into a temporary folder and run with this interpreter, the folder on the
PYTHONPATH): the revisions take turns within a repetition, in an order that reverses every
repetition. The figures: each phase's median and quartiles per revision, and the median of
the paired differences from the first revision (B - A, C - A, ...) with their quartiles. The phases come from timestamps the
driver's functions take when wrapped (``--probe``, the child's mode); workers are untouched.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TRAIN = [
    "train",
    "--config",
    "configs/ppo_tiny.yaml",
    "trainer.total_steps=1",
    "trainer.export=false",
    "trainer.overwrite=true",
]
PROBE = "STARTUP "


def probe(argv: list[str]) -> int:
    """``verlite ARGV`` in this process with the driver's start-up functions wrapped; prints
    the seconds since this process started at which each phase began or ended."""
    t0 = time.perf_counter()
    marks: dict[str, float] = {}

    def mark(name: str) -> None:
        marks.setdefault(name, time.perf_counter() - t0)

    def tree_cpu_seconds() -> str:
        marks["cpu_s"] = cpu_seconds_of_tree(os.getpid())
        return "fit"

    def wrap(owner: Any, attr: str, before: Any, after: Any) -> None:
        original = getattr(owner, attr)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if before is not None:
                mark(before(*args))
            result = original(*args, **kwargs)
            if after is not None:
                mark(after(*args))
            return result

        setattr(owner, attr, wrapped)

    import ray

    from verlite import cli

    mark("imported")
    from verlite.controller import worker_group
    from verlite.driver import run, trainer

    wrap(ray, "init", lambda *a: "ray_init", lambda *a: "ray_ready")
    wrap(worker_group.WorkerGroup, "join", None, lambda g: f"joined {g.name}")
    wrap(run, "write_placement_report", lambda *a: "groups_ready", None)
    wrap(trainer.Trainer, "run_step", lambda t, step, *a: f"step {step}", None)
    wrap(trainer.Trainer, "fit", lambda *a: tree_cpu_seconds(), None)
    code = cli.main(argv)
    print(PROBE + json.dumps(marks), flush=True)
    return code


def cpu_seconds_of_tree(root: int) -> float:
    """CPU seconds (user + system) that ``root`` and its live descendants (here: the Ray
    node's processes and the workers) have used: less moved by other work on the machine
    than wall time. Processes already gone are not counted."""
    ticks, parent = {}, {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # exited meanwhile
                continue
            parent[int(entry.name)] = int(fields[1])
            ticks[int(entry.name)] = int(fields[11]) + int(fields[12])

    def in_tree(pid: int) -> bool:
        while pid > 1:
            if pid == root:
                return True
            pid = parent.get(pid, 0)
        return False

    return sum(t for pid, t in ticks.items() if in_tree(pid)) / os.sysconf("SC_CLK_TCK")


def phases(marks: dict[str, float]) -> dict[str, float]:
    """Seconds of each phase of one run (``to_first_step`` their sum)."""
    joined = max(v for k, v in marks.items() if k.startswith("joined "))
    return {
        "to_first_step": marks["step 1"],
        "imports": marks["imported"],
        "inputs": marks["ray_init"] - marks["imported"],
        "ray_init": marks["ray_ready"] - marks["ray_init"],
        "start_workers": joined - marks["ray_ready"],
        "init_models": marks["groups_ready"] - joined,
        "trainer_setup": marks["step 1"] - marks["groups_ready"],
        "cpu_s_to_first_step": marks["cpu_s"],
    }


def run_once(tree: Path, output_dir: Path) -> dict[str, float]:
    command = [sys.executable, __file__, "--probe", *TRAIN, f"trainer.output_dir={output_dir}"]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith(PROBE)]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"verlite train in {tree} failed:\n{done.stderr[-4000:]}")
    return phases(json.loads(lines[-1][len(PROBE) :]))


def summary(values: list[float]) -> dict[str, float]:
    q1, _, q3 = statistics.quantiles(values, n=4)
    return {"median": round(statistics.median(values), 3), "q1": round(q1, 3), "q3": round(q3, 3)}


def main() -> None:
    # Here, not at the top: the child (``--probe``) measures its own imports from its start.
    from benchmarks.common import add_repeats

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--revs", default="HEAD", help="git revisions, comma-separated")
    add_repeats(parser, 5)
    args = parser.parse_args()
    revs = args.revs.split(",")
    if "" in revs or len(set(revs)) < len(revs):
        parser.error(f"--revs {args.revs!r}: distinct git revisions, comma-separated")
    runs: dict[str, list[dict[str, float]]] = {rev: [] for rev in revs}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {}
        for rev in revs:
            trees[rev] = Path(tmp, f"tree{len(trees)}")
            trees[rev].mkdir()
            archive = subprocess.run(
                ["git", "-C", str(ROOT), "archive", rev], capture_output=True, check=True
            )
            subprocess.run(["tar", "-x", "-C", str(trees[rev])], input=archive.stdout, check=True)
        for rep in range(args.repeats):
            for rev in revs if rep % 2 == 0 else revs[::-1]:
                runs[rev].append(run_once(trees[rev], Path(tmp, "out", rev)))
                print(rep, rev, runs[rev][-1]["to_first_step"], file=sys.stderr, flush=True)
    result: dict[str, Any] = {
        "command": "python -m benchmarks.startup " + " ".join(sys.argv[1:]),
        "load_average": round(os.getloadavg()[0], 2),
        "seconds": {
            rev: {k: summary([r[k] for r in runs[rev]]) for k in runs[rev][0]} for rev in revs
        },
    }
    first = runs[revs[0]]
    result["paired_difference"] = {
        rev: {
            k: summary([y[k] - x[k] for x, y in zip(first, runs[rev], strict=True)])
            for k in first[0]
        }
        for rev in revs[1:]
    }
    print(json.dumps(result))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--probe"]:
        sys.exit(probe(sys.argv[2:]))
    main()
