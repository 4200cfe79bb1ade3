"""`make gpu-check` on a machine without a GPU: one line saying so, exit 0."""

import subprocess
import sys

import pytest
import torch


def test_without_a_gpu_the_check_says_so_and_passes() -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: `make gpu-check` runs the whole check")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("gpu-check: no GPU visible here")
    assert proc.stdout.endswith("nothing to check\n") and proc.stdout.count("\n") == 1
    if torch.version.cuda is None:  # this machine's torch: say why it cannot see a GPU
        assert f"torch {torch.__version__} is a CPU build" in proc.stdout
