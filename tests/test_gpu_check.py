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
    assert proc.stdout == (
        "gpu-check: no GPU visible here (torch.cuda.device_count() is 0): nothing to check\n"
    )
