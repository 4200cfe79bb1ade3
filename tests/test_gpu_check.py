"""`make gpu-check` on a machine without a GPU: one line saying so, exit 0."""

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
