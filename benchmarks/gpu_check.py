"""`make gpu-check`: what a GPU session measures, in one go, as one table and one summary.

1. ``verlite check-invariance`` of the main config with ``model.device=cuda``: every rank on
   its own GPU, the ranks joined over NCCL, dp 1, 2, 4 and 8 as far as the GPUs go, in
   ``model.precision`` fp32 and bf16-mixed (both must pass at the audit's tolerance for the
   precision) and pure bf16 (expected to fail: bf16 gradients accumulate in bf16; shown as
   "fails as expected" with its worst difference).
2. The main job (``make run``) on cuda, its actor and critic sharing GPU 0.
3. The update of a Qwen2-0.5B-shaped policy (``benchmarks/gpu_update.py``): bf16-mixed, pure
   bf16 and a plain PyTorch loop, tokens/s, MFU against the GPU's bf16 peak, peak memory.
4. Two GRPO steps of a Qwen2.5-7B-shaped policy through ``verlite train``
   (``configs/grpo_7b_shape.yaml``): the actor's peak memory and the step's split.

``make gpu-bench`` (``--parts rollout,grpo_step``: issue 36's measures, 8 minutes of limits,
one device command of its own):

5. ``rollout``: ``benchmarks/rollout.py --device cuda``: a Qwen2-0.5B-shaped policy's
   generation (256 and 64 prompts x 256 new tokens) in ``rollout.decode`` cuda_graphs against
   eager (the sampler before issue 36) and Hugging Face ``generate``: tokens/s, the ratios,
   the share of the roofline, and what bounds a decode step (the GPU's busy share).
6. ``grpo_step``: two GRPO steps of that model through ``verlite train``
   (``configs/grpo_0p5b_shape.yaml``: 64 prompts x 8 responses x 256 tokens, bf16-mixed, EOS
   ignored so every response runs to its length), once with ``rollout.decode=eager`` and once
   with ``cuda_graphs``: each run's second step in seconds, the share of generation
   (``timing_s/gen``) in it, and the speedup.

``--parts recipe`` (issue 37's time per step of ``configs/recipes/gsm8k_ppo.yaml`` on one GPU):

7. ``recipe``: two steps of the PPO GSM8K recipe with its settings (256 prompts, responses of
   512 tokens, actor, critic and reference on one GPU, bf16-mixed; scored by the gsm8k rule,
   as math-verify is not on the GPU machine), but a randomly initialized Qwen2.5-0.5B-shaped
   policy (that of ``configs/grpo_0p5b_shape.yaml`` with Qwen2.5's 151,936-token vocabulary)
   and generated prompts of 200 digits (about a GSM8K question in the chat template) in place
   of the user's model and data, which a GPU session here cannot download. Every response
   runs to 512 tokens (EOS ignored), so the second step's time is an upper bound of the
   recipe's (a trained model stops earlier); with it the peak memory of the actor and the
   critic, and the step's split.

Each part is a process of its own with its own time limit (a part past it is stopped, reported
as such, and the rest still run), its whole output in a log under ``--output-dir`` (default
``outputs/gpu_check``); ``summary.json`` and ``summary.md`` are written there as each part
starts (its row RUNNING) and ends, so a device command cut at its limit keeps what its finished
parts measured; a part whose results cannot be read leaves its traceback in
``<row>.error.log``, its table row's name with spaces as ``_`` (``7B-shaped_GRPO.error.log``),
not its ``--parts`` name. ``--budget-s``: the seconds the command may take in all (a device
command's limit, less what ran before it): each part gets its own limit or what the budget has
left, and one that would get less than ``MIN_PART_S`` is not run. ``--parts`` runs some of them
(default: 1-4, ``make gpu-check``; a session can split the check over two commands, each with
its own ``--output-dir``). On a machine without a GPU it says so and exits 0; ``--cpu`` runs
the parts ``--parts`` names there on tiny shapes (what CI runs, each part, so that a typo
cannot first show on the GPU; there the ``grpo_step`` and ``rollout`` parts' fast decode is
``static``, as CUDA graphs need a GPU). CI does not run it otherwise. Parts 5 to 7 have not
been measured on a GPU yet.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from verlite.arguments import non_negative_float
from verlite.audit.invariance import LayoutReport
from verlite.config import load_config
from verlite.table import format_table

CONFIG = "configs/ppo_tiny.yaml"
CONFIG_7B = "configs/grpo_7b_shape.yaml"
CONFIG_05B = "configs/grpo_0p5b_shape.yaml"
RECIPE = "configs/recipes/gsm8k_ppo.yaml"
OUTPUT_DIR = "outputs/gpu_check"
# Each part's limit in seconds: of one audit's process (each of the three, one per precision,
# for its in-process references and one launch of ranks per dp and strategy on one GPU; more
# GPUs add AUDIT_LAUNCH_S a launch), of the other parts' process (grpo_step: of each of its
# two runs, half of it). `make gpu-check` (CHECK, issue 35's parts): about 10 minutes, a
# device command's most (--budget-s holds them to it); on one H200 they should take about 6
# (not yet measured there). `make gpu-bench` (BENCH, issue 36's): 8 minutes; estimated from
# the eager figure (7.6k tok/s, 34 ms a step): rollout ~2.5 minutes (a warm-up and 3
# repetitions of eager, HF and graphs at both shapes, the profile), grpo_step ~1 minute a run
# (Ray and the model's set-up, two steps of ~13 s with eager). Not yet measured on a GPU.
LIMITS = {
    "audit": 90,
    "main_job": 90,
    "update": 120,
    "grpo_7b": 240,
    "rollout": 210,
    "grpo_step": 270,
    "recipe": 300,
}
# An audit's ranks launched past the two of one GPU (dp 1, ddp and fsdp): seconds each.
AUDIT_LAUNCH_S = 30
# A part the budget leaves fewer seconds than this (after GRACE_S) is not run.
MIN_PART_S = 20
CHECK = ("audit", "main_job", "update", "grpo_7b")
BENCH = ("rollout", "grpo_step")
# The seconds `gpu_check` may take in all by default: a device command's 600 s, less 20 s for
# installing the wheels (/work/shared/device/README.md) and 10 s of margin.
BUDGET_S = 570.0
# Seconds a part past its limit has to stop after SIGTERM before its processes are killed.
GRACE_S = 30
# The main job on cuda: enough steps to see it run and validate, not to learn.
GPU_MAIN_JOB = ["trainer.gpus_per_worker=1", "trainer.total_steps=100", "trainer.val_freq=50"]
# What --cpu changes: tiny shapes and few steps, the same code paths.
CPU_MAIN_JOB = ["trainer.total_steps=2", "trainer.val_freq=1", "data.num_val_samples=8"]
CPU_UPDATE = ["--tiny", "--rows", "8", "--tokens", "72", "--micro", "4", "--repeats", "2"]
# What --cpu changes in a `verlite train` of a GPU-shaped config: a tiny model, 4 prompts of
# 8-token responses, one thread, no GPU.
CPU_TRAIN = [
    "model.hidden_size=32",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.intermediate_size=64",
    "model.vocab_size=1000",
    "rollout.max_response_length=8",
    "data.train_batch_size=4",
    "trainer.torch_threads_per_worker=1",
    "trainer.gpus_per_worker=0",
]
CPU_7B = [*CPU_TRAIN, "actor.ppo_mini_batch_size=16", "actor.micro_batch_size_per_worker=8"]
CPU_05B = [*CPU_TRAIN, "actor.ppo_mini_batch_size=32", "actor.micro_batch_size_per_worker=16"]
# The PPO recipe with generated prompts instead of GSM8K's file and its chat template, and
# every response to the recipe's limit; nothing checkpointed or exported.
RECIPE_DATA = [
    "data.task=copy",
    "data.num_train_samples=512",
    "data.num_val_samples=8",
    "data.chat_template=false",
    "data.prompt_key=prompt",
    "data.answer_rule=as_is",
    "data.prompt_suffix=null",
    "rollout.ignore_eos=true",
    "reward.fn=gsm8k",  # math-verify (the recipe's) is not among the GPU machine's wheels
    "trainer.total_steps=2",
    "trainer.val_freq=0",
    "trainer.save_freq=0",
    "trainer.export=false",
]
GPU_RECIPE = ["data.min_digits=200", "data.max_digits=200", "model.vocab_size=151936"]
CPU_RECIPE = [
    *CPU_TRAIN,
    "data.min_digits=8",
    "data.max_digits=8",
    "actor.ppo_mini_batch_size=4",
    "critic.ppo_mini_batch_size=4",
    "critic.micro_batch_size_per_worker=4",
]
GPU_ROLLOUT = ["--device", "cuda", "--repeats", "3"]
CPU_ROLLOUT = ["--compare", "decode", "--shape", "tiny", "--shapes", "4x8,2x8"]
CPU_ROLLOUT += ["--prompt-len", "8", "--repeats", "2", "--profile-steps", "2,4"]


@dataclass
class Part:
    """One row of the table: what ran, on what, its figure, its time and its verdict."""

    name: str
    what: str
    figure: str = ""
    seconds: float = 0.0
    verdict: str = ""
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.verdict in ("ok", "fails as expected")


@dataclass(frozen=True)
class Target:
    """Where the parts run: cuda (the GPUs there) or CPU on tiny shapes (and the audit on
    one strategy and role)."""

    device: str
    dps: list[int]
    output_dir: Path
    audit_flags: tuple[str, ...] = ()  # what else ``verlite check-invariance`` is given
    gpu_memory_gib: float | None = None  # each GPU's, on cuda

    @property
    def cpu(self) -> bool:
        return self.device == "cpu"


def audit_limit(target: Target) -> float:
    """The limit of one audit's process: :data:`LIMITS` ``audit``, and :data:`AUDIT_LAUNCH_S`
    for each launch of ranks past the two of one GPU."""
    launches = len(target.dps) * 2
    return LIMITS["audit"] + AUDIT_LAUNCH_S * max(0, launches - 2)


def audit(target: Target, precision: str, *, expect_pass: bool, limit: float) -> Part:
    """``verlite check-invariance --json`` of the main config in ``precision`` over
    ``target.dps``, a process of its own (its output in ``check_invariance_<precision>.log``)
    stopped past ``limit`` seconds."""
    part = Part(f"check-invariance {precision}", f"dp {','.join(map(str, target.dps))}")
    command = [sys.executable, "-m", "verlite", "check-invariance", "--config", CONFIG, "--json"]
    command += ["--dp", ",".join(map(str, target.dps)), *target.audit_flags]
    command += [f"model.device={target.device}", f"model.precision={precision}"]
    log = target.output_dir / f"check_invariance_{precision}.log"
    code, part.seconds, lines = _subprocess(command, log=log, limit=limit)
    result = _last_json(lines) if code in (0, 1) else {}
    if not result:  # 1 without a result: it raised
        part.verdict = _exit_verdict(code, limit)
        return part
    reports = [LayoutReport(**layout) for layout in result["layouts"]]
    worst, layouts = max(r.worst() for r in reports), len(reports)
    tolerance = max(r.tolerance for r in reports)  # bf16-mixed's are calibrated per case
    failed = sum(r.verdict() != "ok" for r in reports)
    part.what = f"{layouts} layouts, {part.what}"
    part.figure = f"worst {worst:.1e} (tolerance {tolerance:g}), {failed} over"
    passed = failed == 0
    if expect_pass:
        part.verdict = "ok" if passed else "FAILED"
    else:
        part.verdict = "fails as expected" if not passed else "UNEXPECTEDLY PASSED"
    part.details = {"worst": worst, "tolerance": tolerance, "layouts": layouts, "over": failed}
    return part


def _last_json(lines: list[str]) -> dict[str, Any]:
    """The JSON object a command printed last (``benchmarks.common.emit``'s line), {} if none."""
    for line in reversed(lines):
        if line.startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):
                return dict(json.loads(line))
    return {}


def _subprocess(
    command: list[str], *, log: Path, limit: float
) -> tuple[int | None, float, list[str]]:
    """Run ``command`` in a session of its own with its output in ``log``; its exit code
    (None when it ran past ``limit`` seconds), seconds and output lines. One past its limit
    is stopped as a user's Ctrl-C would (SIGTERM: ``verlite train`` then stops its Ray and
    frees the GPU for the next part), its whole process group killed if still there after
    :data:`GRACE_S`."""
    started = time.monotonic()
    with log.open("w") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code: int | None = process.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            code = None
            os.killpg(process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=GRACE_S)
            with contextlib.suppress(ProcessLookupError):  # every process of it has exited
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return code, time.monotonic() - started, log.read_text().splitlines()


def _exit_verdict(code: int | None, limit: float) -> str:
    if code is None:
        return f"TIMED OUT ({limit:.0f} s)"
    return "ok" if code == 0 else f"FAILED (exit {code})"


def _train(
    target: Target, config: str, name: str, overrides: list[str], limit: float
) -> tuple[int | None, float, list[dict[str, Any]]]:
    """``verlite train`` of ``config`` into ``<output dir>/<name>``: its exit code (None when
    stopped past ``limit``), seconds and the records of its metrics.jsonl."""
    out = target.output_dir / name
    command = [sys.executable, "-m", "verlite", "train", "--config", config]
    command += [f"trainer.output_dir={out}", "trainer.overwrite=true", *overrides]
    code, seconds, _ = _subprocess(command, log=target.output_dir / f"{name}.log", limit=limit)
    metrics = out / "metrics.jsonl"
    records = (
        [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    )
    return code, seconds, records


def main_job(target: Target, limit: float) -> Part:
    """The main config trained on ``target``'s device, actor and critic sharing one GPU."""
    overrides = [f"model.device={target.device}"]
    overrides += CPU_MAIN_JOB if target.cpu else GPU_MAIN_JOB
    code, seconds, records = _train(target, CONFIG, "main_job", overrides, limit)
    vals = [r["val/score/mean"] for r in records if "val/score/mean" in r]
    return Part(
        "main job",
        f"{len(records)} steps, {len(vals)} validations",
        f"final validation {vals[-1]:.3f}" if vals else "no validation",
        seconds,
        _exit_verdict(code, limit),
        {"final_validation": vals[-1] if vals else None},
    )


def update_benchmark(target: Target, limit: float) -> Part:
    """``benchmarks/gpu_update.py``: its JSON (the log's last line) in the summary."""
    command = [sys.executable, "-m", "benchmarks.gpu_update", *(CPU_UPDATE if target.cpu else [])]
    log = target.output_dir / "gpu_update.log"
    code, seconds, lines = _subprocess(command, log=log, limit=limit)
    result = _last_json(lines) if code == 0 else {}
    part = Part("update benchmark", result.get("shape", "qwen2-0.5b"), seconds=seconds)
    part.verdict, part.details = _exit_verdict(code, limit), result
    if result:
        rates = result["tokens_per_s"]
        part.figure = ", ".join(f"{k} {v:.0f} tok/s" for k, v in rates.items())
        if result["mfu"] is not None:
            part.figure += "; MFU " + ", ".join(f"{k} {v:.2f}" for k, v in result["mfu"].items())
        if result["max_memory_allocated_gb"] is not None:
            memory = result["max_memory_allocated_gb"]
            part.figure += "; peak GB " + ", ".join(f"{k} {v:.1f}" for k, v in memory.items())
    return part


# The 7B-shaped run as configured keeps its fp32 weights and gradients on the GPU: by count
# (docs/gpu.md), 87 GiB before activations, past an H100's 80 GB. On a GPU with less memory
# than this, it runs with FSDP2's CPU offload of parameters, gradients and optimizer state.
FIT_7B_GIB = 100
OFFLOAD_7B = ["actor.strategy=fsdp", "actor.offload=all"]
# The split of a step a 7B-shaped run reports, from its metrics.jsonl.
SPLIT = ("timing_s/gen", "timing_s/log_probs", "timing_s/update_actor", "timing_s/step")
MFU = "perf/mfu/update"  # on cuda only


def grpo_7b(target: Target, limit: float) -> Part:
    """Two GRPO steps of ``configs/grpo_7b_shape.yaml``: each step's actor peak memory and
    the split of its time; on a GPU under :data:`FIT_7B_GIB`, with :data:`OFFLOAD_7B`."""
    overrides = [f"model.device={target.device}"]
    overrides += CPU_7B if target.cpu else []
    offload = target.gpu_memory_gib is not None and target.gpu_memory_gib < FIT_7B_GIB
    overrides += OFFLOAD_7B if offload else []
    code, seconds, records = _train(target, CONFIG_7B, "grpo_7b_shape", overrides, limit)
    steps = [
        {k: r.get(k) for k in ("step", "perf/max_memory_allocated_gb/actor", MFU, *SPLIT)}
        for r in records
    ]
    shape = f"{len(records)} of 2 steps" + (f", {' '.join(OFFLOAD_7B)}" if offload else "")
    part = Part("7B-shaped GRPO", shape, seconds=seconds)
    part.verdict, part.details = _exit_verdict(code, limit), {"steps": steps}
    if steps:
        last = steps[-1]
        memory = last["perf/max_memory_allocated_gb/actor"]
        split = ", ".join(
            f"{k.split('/')[1]} {last[k]:.3g} s" for k in SPLIT if last[k] is not None
        )
        mfu = "" if last[MFU] is None else f", update MFU {last[MFU]:.2f}"
        part.figure = f"peak {memory:.1f} GB{mfu}; last step: {split}"
    return part


def rollout_benchmark(target: Target, limit: float) -> Part:
    """``benchmarks/rollout.py --device cuda``: its JSON (the log's last line) in the summary;
    a variant it reports under ``errors`` (graphs that failed to capture) fails the part."""
    args = CPU_ROLLOUT if target.cpu else GPU_ROLLOUT
    command = [sys.executable, "-m", "benchmarks.rollout", *args]
    code, seconds, lines = _subprocess(command, log=target.output_dir / "rollout.log", limit=limit)
    result = _last_json(lines) if code == 0 else {}
    shape = "tiny" if target.cpu else "qwen2-0.5b"
    part = Part("rollout benchmark", f"{shape}, decode modes vs HF", seconds=seconds)
    part.verdict, part.details = _exit_verdict(code, limit), result
    if not result:
        return part
    native, figures = result["native"], []
    for size, r in result["results"].items():
        rates = r["tokens_per_s"]
        words = [f"{size}: " + ", ".join(f"{k} {v:.0f}" for k, v in rates.items()) + " tok/s"]
        words += [
            f"{r[k]:.2f}x {k.removeprefix('native_over_')}"
            for k in ("native_over_eager", "native_over_hf")
            if k in r
        ]
        if r["roofline_share"] is not None and native in r["roofline_share"]:
            words.append(f"{r['roofline_share'][native]:.1%} of roofline")
        figures.append(", ".join(words))
    busy = {
        mode: p["gpu_busy_share"]
        for mode, p in result["profile"].items()
        if isinstance(p, dict) and p["gpu_busy_share"] is not None
    }
    if busy:
        figures.append("GPU busy " + ", ".join(f"{k} {v:.0%}" for k, v in busy.items()))
    diff = result["logprob_abs_diff"]
    if diff:
        figures.append(f"logprob diff median {diff['median']:.1e} max {diff['max']:.1e}")
    part.figure = "; ".join(figures)
    if result["errors"]:
        part.verdict = f"FAILED ({', '.join(result['errors'])})"
    return part


def grpo_step(target: Target, limit: float) -> Part:
    """Two GRPO steps of ``configs/grpo_0p5b_shape.yaml`` with the sampler before issue 36
    (``rollout.decode=eager``) and after (cuda_graphs; static on CPU): each run's second step,
    its ``timing_s/*`` and generation's share of it, and the speedup."""
    after = "static" if target.cpu else "cuda_graphs"
    limit /= 2
    part = Part("0.5B-shaped GRPO step", f"rollout.decode eager vs {after}")
    runs, verdicts = {}, []
    for decode in ("eager", after):
        overrides = [f"model.device={target.device}", f"rollout.decode={decode}"]
        overrides += CPU_05B if target.cpu else []
        code, seconds, records = _train(target, CONFIG_05B, f"grpo_step_{decode}", overrides, limit)
        part.seconds += seconds
        verdict = _exit_verdict(code, limit)
        if verdict == "ok" and len(records) < 2:
            verdict = f"FAILED ({len(records)} of 2 steps)"
        verdicts.append((decode, verdict))
        if verdict == "ok":
            timing = {k: v for k, v in records[1].items() if k.startswith("timing_s/")}
            runs[decode] = {
                "step_s": timing["timing_s/step"],
                "gen_share": timing["timing_s/gen"] / timing["timing_s/step"],
                "timing_s": timing,
                # the sampler's log-probs against the actor's recomputed ones (token mean, max)
                "logprob_abs_diff": records[1].get("rollout/logprob_abs_diff"),
                "logprob_max_diff": records[1].get("rollout/logprob_max_diff"),
            }
    failed = [f"{decode}: {verdict}" for decode, verdict in verdicts if verdict != "ok"]
    part.verdict = "; ".join(failed) if failed else "ok"
    part.details = {"runs": runs}
    part.figure = ", ".join(
        f"{decode} step {r['step_s']:.3g} s (gen {r['gen_share']:.0%})"
        for decode, r in runs.items()
    )
    if len(runs) == 2:
        speedup = runs["eager"]["step_s"] / runs[after]["step_s"]
        part.details["speedup"] = speedup
        part.figure += f"; speedup {speedup:.2f}x"
    return part


# The fields of a model's shape the recipe part takes from CONFIG_05B.
SHAPE_FIELDS = (
    "arch",
    "hidden_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "intermediate_size",
)
# What the recipe part reports of its second step.
RECIPE_KEYS = (
    "timing_s/step",
    "timing_s/gen",
    "timing_s/log_probs",
    "timing_s/values",
    "timing_s/reward",
    "timing_s/update_critic",
    "timing_s/update_actor",
    "perf/max_memory_allocated_gb/actor",
    "perf/max_memory_allocated_gb/critic",
    MFU,
)


def recipe_step(target: Target, limit: float) -> Part:
    """Two steps of the PPO GSM8K recipe (``configs/recipes/gsm8k_ppo.yaml``) with a random
    policy of the 0.5B shape and generated prompts (module docstring, 7): the second step's
    time, an upper bound of the recipe's, its split and the peak memory."""
    shape = load_config(CONFIG_05B).model
    overrides = [f"model.{name}={getattr(shape, name)}" for name in SHAPE_FIELDS]
    overrides += [f"model.device={target.device}", *RECIPE_DATA]
    overrides += CPU_RECIPE if target.cpu else GPU_RECIPE
    code, seconds, records = _train(target, RECIPE, "recipe_ppo", overrides, limit)
    shape_name = "tiny shape" if target.cpu else "random 0.5B shape"
    part = Part("PPO recipe step", f"gsm8k_ppo.yaml, {shape_name}", seconds=seconds)
    part.verdict = _exit_verdict(code, limit)
    if part.verdict == "ok" and len(records) < 2:
        part.verdict = f"FAILED ({len(records)} of 2 steps)"
    if part.verdict == "ok":
        second = {k: records[1][k] for k in RECIPE_KEYS if k in records[1]}
        part.details = {"second_step": second}
        step = second["timing_s/step"]
        part.figure = (
            f"step <= {step:.3g} s (gen {second['timing_s/gen'] / step:.0%}); peak GB actor "
            f"{second['perf/max_memory_allocated_gb/actor']:.1f}, critic "
            f"{second['perf/max_memory_allocated_gb/critic']:.1f}"
        )
    return part


def write_summary(target: Target, parts: list[Part], header: str) -> list[tuple[str, ...]]:
    """``summary.json`` and ``summary.md`` of ``parts`` under the output dir; the table's rows."""
    rows = [(p.name, p.what, p.figure, f"{p.seconds:.0f} s", p.verdict) for p in parts]
    target.output_dir.mkdir(parents=True, exist_ok=True)
    summary = {"header": header, "parts": [asdict(p) for p in parts]}
    (target.output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    lines = ["| part | what | figure | time | verdict |", "|---|---|---|---|---|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    (target.output_dir / "summary.md").write_text(f"{header}\n\n" + "\n".join(lines) + "\n")
    return rows


PartFn = Callable[[Target, float], Part]


def _parts(target: Target) -> dict[str, tuple[str, float, PartFn]]:
    """Every part by its row's name, in the order of the module docstring: its group (a key
    of :data:`LIMITS`, what ``--parts`` names), its limit and what runs it."""

    def audit_in(precision: str, *, expect_pass: bool) -> PartFn:
        return lambda t, limit: audit(t, precision, expect_pass=expect_pass, limit=limit)

    return {
        "check-invariance fp32": ("audit", audit_limit(target), audit_in("fp32", expect_pass=True)),
        "check-invariance bf16-mixed": (
            "audit",
            audit_limit(target),
            audit_in("bf16-mixed", expect_pass=True),
        ),
        "check-invariance bf16": (
            "audit",
            audit_limit(target),
            audit_in("bf16", expect_pass=False),
        ),
        "main job": ("main_job", LIMITS["main_job"], main_job),
        "update benchmark": ("update", LIMITS["update"], update_benchmark),
        "7B-shaped GRPO": ("grpo_7b", LIMITS["grpo_7b"], grpo_7b),
        "rollout benchmark": ("rollout", LIMITS["rollout"], rollout_benchmark),
        "0.5B-shaped GRPO step": ("grpo_step", LIMITS["grpo_step"], grpo_step),
        "PPO recipe step": ("recipe", LIMITS["recipe"], recipe_step),
    }


def run_parts(
    target: Target, groups: list[str], *, header: str, budget_s: float | None = None
) -> list[Part]:
    """The parts of ``groups`` (keys of :data:`LIMITS`) in turn, each within its limit or what
    ``budget_s`` has left; the summary written as each starts and ends. One that raises is
    reported as failed, its traceback in ``<name>.error.log``, and the rest still run."""
    started_all = time.monotonic()
    done: list[Part] = []
    for name, (group, own_limit, run) in _parts(target).items():
        if group not in groups:
            continue
        limit = float(own_limit)
        if budget_s is not None:
            left = budget_s - (time.monotonic() - started_all) - GRACE_S
            if left < MIN_PART_S:
                verdict = f"NOT RUN (budget: {max(left, 0):.0f} s left, its limit {limit:.0f} s)"
                done.append(Part(name, "", "", 0.0, verdict))
                _report(target, done, header)
                continue
            limit = min(limit, left)
        write_summary(target, [*done, Part(name, "", "", 0.0, "RUNNING")], header)
        started = time.monotonic()
        try:
            part = run(target, limit)
        except Exception as exc:  # a broken part is a row of the table, not the end of the check
            log = target.output_dir / f"{name.replace(' ', '_')}.error.log"
            log.write_text(traceback.format_exc())
            error = " ".join(f"{type(exc).__name__}: {exc}".split())[:200]
            part = Part(name, "", f"{error} (traceback in {log})", 0.0, "FAILED")
        part.seconds = part.seconds or time.monotonic() - started
        done.append(part)
        _report(target, done, header)
    return done


def _report(target: Target, done: list[Part], header: str) -> None:
    """The summary of the parts ``done`` so far, and the last one's line."""
    write_summary(target, done, header)
    last = done[-1]
    figure = f": {last.figure}" if last.figure else ""
    print(f"gpu-check: {last.name}: {last.verdict} ({last.seconds:.0f} s){figure}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--output-dir", default=OUTPUT_DIR)
    parser.add_argument("--cpu", action="store_true", help="the --parts on CPU, tiny shapes")
    parser.add_argument(
        "--parts",
        default=",".join(CHECK),
        help=f"the parts to run, comma-separated, of {','.join(LIMITS)} (default: "
        f"{','.join(CHECK)}, make gpu-check; make gpu-bench runs {','.join(BENCH)})",
    )
    parser.add_argument(
        "--budget-s",
        type=non_negative_float,
        default=BUDGET_S,
        help="seconds the check may take in all, a device command's limit (default "
        f"{BUDGET_S:.0f}: one of 600 s after a 20 s install); each part gets its own limit or "
        f"what is left, one left under {MIN_PART_S} s is not run; 0: no budget",
    )
    args = parser.parse_args([] if argv is None else argv)
    groups = args.parts.split(",")
    if unknown := set(groups) - set(LIMITS):
        parser.error(f"--parts: unknown {sorted(unknown)}; choose from {','.join(LIMITS)}")
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    if args.cpu:
        target = Target("cpu", [2], output_dir, ("--strategy", "ddp"))
        header = f"gpu-check --cpu: tiny shapes, torch {torch.__version__}"
    else:
        if torch.version.cuda is None:
            print(
                f"gpu-check: no GPU visible here: torch {torch.__version__} is a CPU build, which "
                "sees none even on a machine with GPUs (install a CUDA build of the same version "
                "there); nothing to check"
            )
            return 0
        gpus = torch.cuda.device_count()
        if gpus == 0:
            print(
                "gpu-check: no GPU visible here (torch.cuda.device_count() is 0): nothing to check"
            )
            return 0
        name, memory_gib = _gpu()
        target = Target(
            "cuda", [dp for dp in (1, 2, 4, 8) if dp <= gpus], output_dir, (), memory_gib
        )
        header = f"gpu-check: {gpus} x {name} ({memory_gib:.0f} GiB), torch {torch.__version__}"
    print(header, flush=True)
    parts = run_parts(target, groups, header=header, budget_s=args.budget_s or None)
    print(format_table(write_summary(target, parts, header)), flush=True)
    return 0 if all(p.ok for p in parts) else 1


def _gpu() -> tuple[str, float]:
    """The first GPU's name and memory in GiB, read by a child process, so that this one,
    which only starts the parts, never initializes CUDA (what GPU memory that would hold
    while the parts run is not measured)."""
    read = "import torch; p = torch.cuda.get_device_properties(0); print(p.total_memory, p.name)"
    output = subprocess.run(
        [sys.executable, "-c", read], capture_output=True, text=True, check=True
    ).stdout
    memory, name = output.strip().split(" ", 1)
    return name, int(memory) / 2**30


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
