"""`verlite check-invariance` end to end (real ranks): as a user runs it (a subprocess), and
through the same ``main`` in this process where a fresh interpreter would only add seconds of
imports (the user errors)."""

import json
import signal
import subprocess
import sys

import pytest
import torch

from verlite.cli import main

CONFIG = "configs/ppo_tiny.yaml"


def verlite(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "verlite.cli", *args], capture_output=True, text=True, timeout=600
    )


@pytest.fixture
def in_process(capsys: pytest.CaptureFixture[str]):
    """``verlite ARGS`` through ``verlite.cli.main`` here: exit code, stdout and stderr."""

    def run(*args: str) -> subprocess.CompletedProcess:
        previous = signal.getsignal(signal.SIGTERM)  # main installs its own handler
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse's errors
            code = exc.code
        finally:
            signal.signal(signal.SIGTERM, previous)
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(list(args), code, out, err)

    return run


def test_json_report_ok() -> None:
    proc = verlite(
        "check-invariance",
        "--config",
        CONFIG,
        "--dp",
        "1,2",
        "--micro",
        "2,dynamic",
        "--strategy",
        "fsdp",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] is True and report["tolerance"] == 1e-5
    assert len(report["layouts"]) == 2 * 2 * 2  # dp x micro x role
    keys = {
        "dp",
        "micro",
        "strategy",
        "role",
        "max_rel_grad_diff",
        "max_rel_param_diff",
        "loss_diff",
        "grad_norm_diff",
    }
    for layout in report["layouts"]:
        assert keys <= layout.keys()
        assert layout["max_rel_grad_diff"] < 1e-5
    assert {(x["dp"], x["micro"], x["role"]) for x in report["layouts"]} == {
        (dp, micro, role)
        for dp in (1, 2)
        for micro in ("2", "dynamic")
        for role in ("actor", "critic")
    }


def test_the_configured_optimizer_over_three_steps_in_float32(in_process) -> None:
    proc = in_process(
        "check-invariance",
        "--config",
        CONFIG,
        "--dp",
        "2",
        "--micro",
        "1",
        "--strategy",
        "fsdp",
        "--optimizer",
        "configured",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] is True and report["tolerance"] == 1e-3
    assert (report["optimizer"], report["steps"]) == ("configured", 3)  # 3 steps by default
    assert len(report["layouts"]) == 2


def test_table_and_failure_exit_code_with_the_negative_control(in_process) -> None:
    proc = in_process(
        "check-invariance",
        "--config",
        CONFIG,
        "--dp",
        "2",
        "--micro",
        "1",
        "--strategy",
        "ddp",
        "--negative-control",
    )
    assert proc.returncode == 1
    assert "FAIL" in proc.stdout and "FAILED: 2 layouts" in proc.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--micro", "3"], "allowed: 1,2,full,dynamic"),
        (["--dp", "0"], "expected positive integers"),
        (["--dp", "1000"], "--dp 1000: the audit batch has 16 sequences"),
        (["--dp", "2,3"], "--dp 3: the audit batch has 16 sequences"),
        (["--strategy", "zero"], "allowed: ddp,fsdp"),
        (["--steps", "0"], "argument --steps: expected a positive integer, got '0'"),
        (["--steps", "3,"], "argument --steps: expected a positive integer, got '3,'"),
        (["--optimizer", "adam"], "argument --optimizer: invalid choice: 'adam'"),
        (["actor.loss_agg_mode=mean"], "actor.loss_agg_mode='mean'"),
        (["--tolerance", "-1"], "expected a positive finite number, got '-1'"),
        (["--tolerance", "nan"], "expected a positive finite number, got 'nan'"),
    ],
)
def test_user_errors_exit_2_in_one_line(in_process, args: list[str], message: str) -> None:
    proc = in_process("check-invariance", "--config", CONFIG, *args)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr


def test_missing_config_file() -> None:
    proc = verlite("check-invariance", "--config", "nope.yaml")
    assert proc.returncode == 2
    assert (
        proc.stderr.strip()
        == "verlite: error: cannot read config file 'nope.yaml': No such file or directory"
    )


def test_a_gpu_audit_needs_a_gpu_per_rank(in_process) -> None:
    if torch.cuda.device_count() >= 4:
        pytest.skip("this machine has a GPU for every rank of --dp 4")
    proc = in_process("check-invariance", "--config", CONFIG, "model.device=cuda", "--dp", "1,4")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    progress, error = proc.stderr.splitlines()
    assert progress == "checking 4 rank launches ..." and error.startswith(
        "verlite: error: --dp 4 with model.device=cuda: NCCL needs one GPU per rank: 4 ranks"
    )
