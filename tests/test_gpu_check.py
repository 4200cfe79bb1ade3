"""`make gpu-check` on a machine without a GPU: one line saying so, exit 0; every part runs
on CPU with tiny shapes (``--cpu``), issue 35's (`make gpu-check`) and issue 36's
(`make gpu-bench`: the rollout benchmark and the 0.5B-shaped GRPO step)."""

import json
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
        assert result["profile"][mode]["step_ms"] > 0
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
