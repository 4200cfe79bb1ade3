"""`make gpu-check` on a machine without a GPU: one line saying so, exit 0; every part runs
on CPU with tiny shapes (``--cpu``), issue 35's (`make gpu-check`) and issue 36's
(`make gpu-bench`: the rollout benchmark and the 0.5B-shaped GRPO step)."""

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_check


def test_without_a_gpu_the_check_says_so_and_passes(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: `make gpu-check` runs the whole check")
    assert gpu_check.main() == 0
    out = capsys.readouterr().out
    assert out.startswith("gpu-check: no GPU visible here")
    assert out.endswith("nothing to check\n") and out.count("\n") == 1
    if torch.version.cuda is None:  # this machine's torch: say why it cannot see a GPU
        assert f"torch {torch.__version__} is a CPU build" in out


@pytest.mark.cluster  # two `verlite train` runs, each with an embedded Ray of its own
def test_every_part_runs_on_cpu_with_tiny_shapes(tmp_path: Path) -> None:
    """What a GPU session runs, on tiny shapes: the audits, the main job, the update benchmark
    and the 7B-shaped config's two GRPO steps, with the figures each reports, in summary.json
    and summary.md. Pure bf16's audit on these few layouts lands near its tolerance on CPU
    (worst 9.7e-3 against 1e-2 here): whichever way it goes, it is reported as such."""
    code = gpu_check.main(["--cpu", "--output-dir", str(tmp_path)])
    summary = json.loads((tmp_path / "summary.json").read_text())
    parts = {part["name"]: part for part in summary["parts"]}
    verdicts = {name: part["verdict"] for name, part in parts.items()}
    pure = verdicts.pop("check-invariance bf16")
    assert set(verdicts.values()) == {"ok"} and len(verdicts) == 5, parts
    assert pure in ("fails as expected", "UNEXPECTEDLY PASSED")
    assert parts["check-invariance bf16"]["details"]["worst"] > 0
    assert code == (0 if pure == "fails as expected" else 1)
    update = parts["update benchmark"]["details"]
    assert set(update["tokens_per_s"]) == {"bf16-mixed", "bf16", "plain_loop"}
    steps = parts["7B-shaped GRPO"]["details"]["steps"]
    assert [step["step"] for step in steps] == [1, 2]
    for step in steps:
        assert step["perf/max_memory_allocated_gb/actor"] > 0
        assert all(step[key] > 0 for key in gpu_check.SPLIT)
    assert (tmp_path / "summary.md").read_text().count("\n| ") == 7  # the head and 6 parts
    # The 7B-shaped run measures and keeps nothing (trainer.export=false); the main job exports.
    assert not (tmp_path / "grpo_7b_shape" / "hf_actor").exists()
    assert (tmp_path / "main_job" / "hf_actor" / "config.json").is_file()


def test_the_rollout_benchmark_runs_on_cpu_with_tiny_shapes(tmp_path: Path) -> None:
    """``benchmarks/rollout.py``'s decode comparison: static (the fast mode on CPU) against
    eager and HF at both shapes, every variant generating every token (EOS ignored), the
    profile of each native mode, no roofline (no GPU bandwidth on CPU), no error."""
    assert gpu_check.main(["--cpu", "--parts", "rollout", "--output-dir", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    [part] = summary["parts"]
    assert part["name"] == "rollout benchmark" and part["verdict"] == "ok", part
    result = part["details"]
    assert result["native"] == "static" and result["errors"] == {}
    assert set(result["results"]) == {"4x8", "2x8"}
    for shape, figures in result["results"].items():
        rows, new = (int(n) for n in shape.split("x"))
        assert figures["tokens_per_call"] == {
            "static": rows * new,
            "eager": rows * new,
            "hf": rows * new,
        }
        assert all(rate > 0 for rate in figures["tokens_per_s"].values())
        assert figures["native_over_eager"] > 0 and figures["native_over_hf"] > 0
        assert figures["roofline"] is None and figures["roofline_share"] is None
    for mode in ("static", "eager"):
        # A difference of two medians: its sign is the machine's load's on CPU, not checked.
        assert math.isfinite(result["profile"][mode]["step_ms"])
        assert result["profile"][mode]["gpu_busy_share"] is None
    assert "4x8: static" in part["figure"] and "x eager" in part["figure"]
    # The sampler's log-probs against a forward pass over its responses (bf16 autocast).
    diff = result["logprob_abs_diff"]
    assert diff["tokens"] == 4 * 8 and 0 <= diff["median"] <= diff["max"] < 0.1, diff
    assert "logprob diff median" in part["figure"]


@pytest.mark.cluster  # two `verlite train` runs, each with an embedded Ray of its own
def test_the_grpo_step_part_runs_eager_and_static_on_cpu(tmp_path: Path) -> None:
    """Two GRPO steps of configs/grpo_0p5b_shape.yaml on tiny shapes, with rollout.decode
    eager and static: each run's second step and its timing_s/*, generation's share of it
    and the speedup."""
    code = gpu_check.main(["--cpu", "--parts", "grpo_step", "--output-dir", str(tmp_path)])
    summary = json.loads((tmp_path / "summary.json").read_text())
    [part] = summary["parts"]
    assert code == 0 and part["verdict"] == "ok", part
    runs = part["details"]["runs"]
    assert set(runs) == {"eager", "static"}
    for decode, run in runs.items():
        lines = (tmp_path / f"grpo_step_{decode}" / "metrics.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        assert [r["step"] for r in records] == [1, 2]
        second = {k: v for k, v in records[1].items() if k.startswith("timing_s/")}
        assert run["timing_s"] == second and run["step_s"] == second["timing_s/step"]
        assert 0 < run["gen_share"] < 1
    speedup = part["details"]["speedup"]
    assert speedup == runs["eager"]["step_s"] / runs["static"]["step_s"]
    assert f"speedup {speedup:.2f}x" in part["figure"]


@pytest.mark.cluster  # a `verlite train` run with an embedded Ray of its own
def test_the_recipe_part_runs_the_ppo_recipe_on_cpu(tmp_path: Path) -> None:
    """Two steps of configs/recipes/gsm8k_ppo.yaml with generated prompts and a tiny random
    policy: the second step's time, its split and both roles' peak memory."""
    code = gpu_check.main(["--cpu", "--parts", "recipe", "--output-dir", str(tmp_path)])
    summary = json.loads((tmp_path / "summary.json").read_text())
    [part] = summary["parts"]
    assert code == 0 and part["verdict"] == "ok", part
    lines = (tmp_path / "recipe_ppo" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [1, 2]
    second = part["details"]["second_step"]
    assert second == {k: records[1][k] for k in gpu_check.RECIPE_KEYS if k in records[1]}
    assert second["timing_s/update_critic"] > 0 and second["timing_s/update_actor"] > 0
    config = json.loads((tmp_path / "recipe_ppo" / "config.json").read_text())
    assert config["reward"]["fn"] == "gsm8k" and config["rollout"]["ignore_eos"] is True
    assert config["algorithm"]["adv_estimator"] == "gae"
    assert f"step <= {second['timing_s/step']:.3g} s" in part["figure"]


def test_an_unknown_part_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.main(["--parts", "update,decode"])
    assert exit_info.value.code == 2
    assert (
        capsys.readouterr()
        .err.splitlines()[-1]
        .endswith(
            "--parts: unknown ['decode']; choose from "
            "audit,main_job,update,grpo_7b,rollout,grpo_step,recipe"
        )
    )


def test_each_part_leaves_its_row_in_the_summary_before_the_next_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A device command cut at its limit (the whole process killed) keeps what its parts
    measured: summary.json and summary.md hold every finished part, and the part under way
    as RUNNING, from the moment it starts; each part ends with one line of its own."""
    seen: list[dict] = []

    def first(target: gpu_check.Target, limit: float) -> gpu_check.Part:
        return gpu_check.Part("main job", "2 steps", "final validation 0.5", 3.0, "ok")

    def second(target: gpu_check.Target, limit: float) -> gpu_check.Part:
        seen.append(json.loads((tmp_path / "summary.json").read_text()))
        return gpu_check.Part("update benchmark", "tiny", "1 tok/s", 2.0, "ok")

    monkeypatch.setattr(gpu_check, "main_job", first)
    monkeypatch.setattr(gpu_check, "update_benchmark", second)
    assert (
        gpu_check.main(["--cpu", "--parts", "main_job,update", "--output-dir", str(tmp_path)]) == 0
    )
    [during] = seen
    rows = [(p["name"], p["verdict"]) for p in during["parts"]]
    assert rows == [("main job", "ok"), ("update benchmark", "RUNNING")]
    assert "| update benchmark |" in (tmp_path / "summary.md").read_text()
    lines = capsys.readouterr().out.splitlines()
    assert "gpu-check: main job: ok (3 s): final validation 0.5" in lines
    assert "gpu-check: update benchmark: ok (2 s): 1 tok/s" in lines


def test_a_part_that_raises_leaves_its_traceback_under_the_output_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A part whose reading of its results raises is a FAILED row naming the error's last
    line and the file that holds its whole traceback; the parts after it still run."""

    def broken(target: gpu_check.Target, limit: float) -> gpu_check.Part:
        records: list[dict] = [{"step": 1}]
        return gpu_check.Part("main job", "", f"{records[0]['perf/mfu/update']:.2f}")

    def fine(target: gpu_check.Target, limit: float) -> gpu_check.Part:
        return gpu_check.Part("update benchmark", "tiny", "", 1.0, "ok")

    monkeypatch.setattr(gpu_check, "main_job", broken)
    monkeypatch.setattr(gpu_check, "update_benchmark", fine)
    assert (
        gpu_check.main(["--cpu", "--parts", "main_job,update", "--output-dir", str(tmp_path)]) == 1
    )
    parts = json.loads((tmp_path / "summary.json").read_text())["parts"]
    assert [(p["name"], p["verdict"]) for p in parts] == [
        ("main job", "FAILED"),
        ("update benchmark", "ok"),
    ]
    log = tmp_path / "main_job.error.log"
    assert parts[0]["figure"] == f"KeyError: 'perf/mfu/update' (traceback in {log})"
    text = log.read_text()
    assert text.startswith("Traceback") and "in broken" in text


def test_the_parts_run_within_the_budget_and_those_it_cannot_hold_are_not_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--budget-s``: the device command's time; each part gets its own limit or what the
    budget has left (less the grace a part past its limit has to stop), and a part that
    would get too little is reported as not run, not started and cut."""
    limits: list[float] = []

    def part(target: gpu_check.Target, limit: float) -> gpu_check.Part:
        limits.append(limit)
        return gpu_check.Part("main job", "", "", 0.0, "ok")

    monkeypatch.setattr(gpu_check, "main_job", part)
    monkeypatch.setattr(gpu_check, "update_benchmark", part)
    out = str(tmp_path)
    assert gpu_check.main(["--cpu", "--parts", "main_job", "--output-dir", out]) == 0
    assert limits == [gpu_check.LIMITS["main_job"]]
    budget = gpu_check.GRACE_S + 100
    assert (
        gpu_check.main(
            ["--cpu", "--parts", "update", "--budget-s", str(budget), "--output-dir", out]
        )
        == 0
    )
    assert limits[1] <= 100 and limits[1] > 90  # the budget's, below the part's own 120 s
    small = gpu_check.GRACE_S + gpu_check.MIN_PART_S - 1
    assert (
        gpu_check.main(
            ["--cpu", "--parts", "main_job", "--budget-s", str(small), "--output-dir", out]
        )
        == 1
    )
    assert len(limits) == 2
    [row] = json.loads((tmp_path / "summary.json").read_text())["parts"]
    assert row["name"] == "main job" and row["verdict"].startswith("NOT RUN (budget: ")


@pytest.mark.cluster  # a `verlite check-invariance` process of its own (8 s): the whole-suite budget
def test_an_audit_runs_as_a_command_of_its_own_with_its_log(tmp_path: Path) -> None:
    """Each audit is a ``verlite check-invariance --json`` process with its own limit and its
    whole output in ``<output dir>/check_invariance_<precision>.log``: a hang or a crash
    of its ranks (NCCL's, on a GPU) is stopped at the limit and leaves its traceback there."""
    flags = ("--strategy", "ddp", "--micro", "full")
    target = gpu_check.Target("cpu", [1], tmp_path, flags)
    part = gpu_check.audit(target, "fp32", expect_pass=True, limit=120)
    assert part.verdict == "ok", part
    assert part.details["layouts"] == 2 and part.details["over"] == 0  # actor and critic
    log = (tmp_path / "check_invariance_fp32.log").read_text()
    assert json.loads(log.splitlines()[-1])["ok"] is True


def test_every_run_a_gpu_part_starts_loads_and_fits_one_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU's own overrides (the main job's steps, the recipe's prompts and vocabulary,
    rollout.decode=cuda_graphs), which ``--cpu`` never gives: each ``verlite train`` a GPU
    part starts loads as a config (``auto`` resolved as on a machine with a GPU), fits the
    device machine (one 80 GB GPU, 16 CPUs) and generates there, so that a typo or a
    refusal shows here and not in a GPU session's minutes."""
    from types import SimpleNamespace

    from verlite.config import load_config
    from verlite.controller import resource_pool
    from verlite.data.tokenizer import load_tokenizer
    from verlite.driver import preflight

    commands: list[list[str]] = []

    def record(command: list[str], *, log: Path, limit: float) -> tuple[int, float, list[str]]:
        commands.append(command)
        return 0, 0.0, []

    monkeypatch.setattr(gpu_check, "_subprocess", record)
    target = gpu_check.Target("cuda", [1], tmp_path, gpu_memory_gib=79.2)  # an H100's
    for part in (gpu_check.main_job, gpu_check.grpo_7b, gpu_check.grpo_step, gpu_check.recipe_step):
        part(target, 60.0)
    # The 7B-shaped run as configured on an H200 (141 GB); on an H100, with FSDP2's offload.
    gpu_check.grpo_7b(dataclasses.replace(target, gpu_memory_gib=139.8), 60.0)
    offloaded = [c[-2:] == gpu_check.OFFLOAD_7B for c in commands]
    assert offloaded == [False, True, False, False, False, False]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100")
    gpu = SimpleNamespace(total_memory=80 * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: gpu)
    monkeypatch.setattr(resource_pool, "get_num_cpus", lambda: 16)
    decodes = []
    for command in commands:
        at = command.index("--config")
        cfg = load_config(command[at + 1], command[at + 2 :])
        assert cfg.model.device == "cuda" and cfg.on_gpu and cfg.generates_on_gpu, command
        resource_pool.check_fits_machine(cfg)
        vocab = len(load_tokenizer(cfg.model.path, task=cfg.data.task))
        preflight.check_generation(cfg, vocab)
        preflight.check_generation_fits(cfg, vocab)
        decodes.append(cfg.rollout.decode)
    assert decodes == ["auto", "auto", "eager", "cuda_graphs", "auto", "auto"]
