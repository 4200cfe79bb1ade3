"""`make gpu-check` on a machine without a GPU: one line saying so, exit 0."""

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


def test_an_unknown_part_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.main(["--parts", "update,rollout"])
    assert exit_info.value.code == 2
    assert (
        capsys.readouterr()
        .err.splitlines()[-1]
        .endswith("--parts: unknown ['rollout']; choose from audit,main_job,update,grpo_7b")
    )
