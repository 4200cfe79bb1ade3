"""deploy/ holds what it claims: YAML that parses, KubeRay ray.io/v1 objects sized to their run
with token authentication on, a cluster-launcher config Ray accepts, a Slurm script bash
accepts, and ``verlite`` commands (entrypoints and documented ones) that verlite's own parsers
accept with configs that load."""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from jobs_support import REPO

from verlite.cli import build_parser
from verlite.config import load_config
from verlite.jobs import commands as job_commands
from verlite.jobs.submission import build_runtime_env, read_runtime_env

DEPLOY = REPO / "deploy"
KUBERAY = sorted((DEPLOY / "kuberay").glob("*.yaml"))
YAMLS = sorted(DEPLOY.rglob("*.yaml"))
# Values for the shell variables of the Slurm script's commands.
SLURM_VALUES = {
    "SLURM_JOB_NUM_NODES": "1",
    "CONFIG": "configs/ppo_tiny.yaml",
    "dashboard_port": "8265",
}


def load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def job_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="verlite")
    job_commands.add_commands(parser.add_subparsers(dest="command", required=True))
    return parser


def check_verlite_command(command: str) -> None:
    """``verlite train|submit ...`` parses with verlite's parsers and its config loads."""
    argv = shlex.split(command)
    assert argv[0] == "verlite", command
    parser = build_parser() if argv[1] == "train" else job_parser()
    args = parser.parse_args(argv[1:])
    load_config(REPO / args.config, args.overrides)


def commented_commands(path: Path) -> list[str]:
    """The ``verlite ...`` commands shown in a file's comments, continuation lines joined."""
    lines = (line.strip() for line in path.read_text().splitlines())
    text = "\n".join(line.lstrip("# ") for line in lines if line.startswith("#"))
    text = re.sub(r"\\\n\s*", " ", text)
    return [line.strip() for line in text.splitlines() if line.strip().startswith("verlite ")]


def test_deploy_has_each_path() -> None:
    names = {p.relative_to(DEPLOY).as_posix() for p in DEPLOY.rglob("*") if p.is_file()}
    assert {
        "README.md",
        "Dockerfile",
        "runtime_env.yaml",
        "cluster-launcher.yaml",
        "slurm/verlite.sbatch",
        "kuberay/raycluster.cpu.yaml",
        "kuberay/raycluster.gpu.yaml",
        "kuberay/rayjob.cpu.yaml",
        "kuberay/rayjob.gpu.yaml",
    } <= names


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: p.name)
def test_every_yaml_parses(path: Path) -> None:
    assert isinstance(load(path), dict)


def test_the_runtime_env_is_one_verlite_submit_accepts() -> None:
    env = build_runtime_env(REPO, read_runtime_env(str(DEPLOY / "runtime_env.yaml")))
    assert env["working_dir"] == str(REPO)


@pytest.mark.parametrize("path", KUBERAY, ids=lambda p: p.name)
def test_kuberay_objects_run_verlite_with_token_auth(path: Path) -> None:
    doc = load(path)
    assert doc["apiVersion"] == "ray.io/v1"
    assert doc["kind"] == ("RayJob" if path.name.startswith("rayjob") else "RayCluster")
    spec = doc["spec"] if doc["kind"] == "RayCluster" else doc["spec"]["rayClusterSpec"]
    head = spec["headGroupSpec"]["template"]["spec"]
    (workers,) = spec["workerGroupSpecs"]
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"  # training on workers only
    pods = [head, workers["template"]["spec"]]
    if "authOptions" in spec:
        assert spec["authOptions"]["mode"] == "token"
    else:  # the Secret mounted as a file named by RAY_AUTH_TOKEN_PATH
        for pod in pods:
            (container,) = pod["containers"]
            env = {e["name"]: e["value"] for e in container["env"]}
            assert env["RAY_AUTH_MODE"] == "token"
            (mount,) = container["volumeMounts"]
            assert env["RAY_AUTH_TOKEN_PATH"].startswith(mount["mountPath"] + "/")
            (volume,) = pod["volumes"]
            assert volume["secret"]["secretName"] == "verlite-ray-token"

    commands = commented_commands(path)
    if doc["kind"] == "RayJob":
        commands.append(doc["spec"]["entrypoint"])
    assert commands
    gpu = path.name.endswith(".gpu.yaml")
    for command in commands:
        check_verlite_command(command)
        overrides = dict(o.split("=", 1) for o in shlex.split(command) if "=" in o)
        assert int(overrides["trainer.nnodes"]) == workers["replicas"] == workers["maxReplicas"]
        assert ("trainer.gpus_per_worker" in overrides) == gpu
    worker_resources = workers["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert ("nvidia.com/gpu" in worker_resources) == gpu


def test_the_cluster_launcher_config_is_valid_for_ray() -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = load(DEPLOY / "cluster-launcher.yaml")
    validate_config(prepare_config(config))
    assert config["provider"]["type"] == "local"
    assert "~/.ray/auth_token" in config["file_mounts"]
    starts = config["head_start_ray_commands"] + config["worker_start_ray_commands"]
    assert all("RAY_AUTH_MODE=token" in c for c in starts if " start " in c)
    for command in commented_commands(DEPLOY / "cluster-launcher.yaml"):
        check_verlite_command(command)


def test_the_slurm_script_is_bash_that_submits_a_valid_run() -> None:
    script = DEPLOY / "slurm" / "verlite.sbatch"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = re.sub(r"\\\n\s*", " ", script.read_text())
    (submit,) = [line.strip() for line in text.splitlines() if line.strip().startswith("verlite ")]
    submit = re.sub(r"\$\{?(\w+)\}?", lambda m: SLURM_VALUES.get(m[1], m[0]), submit)
    check_verlite_command(submit.replace('"$@"', ""))
    assert "export RAY_AUTH_MODE=token" in text


def test_the_dockerfile_installs_pinned_torch_before_the_project() -> None:
    lines = (DEPLOY / "Dockerfile").read_text().splitlines()
    assert "ARG VARIANT=cpu" in lines and "FROM base-${VARIANT}" in lines
    assert any(line.startswith("FROM python:3.11-slim AS base-cpu") for line in lines)
    assert any(line.startswith("FROM nvidia/cuda:") and "AS base-cuda" in line for line in lines)
    torch = next(i for i, line in enumerate(lines) if '"torch==${TORCH_VERSION}"' in line)
    project = next(i for i, line in enumerate(lines) if "pip install --no-cache-dir ." in line)
    assert torch < project
