"""The job commands without a cluster: the job verlite builds (entrypoint, runtime_env), metrics
parsing, address resolution, and errors that cost seconds and one line: no address, an address
that refuses or never answers, a bad config caught before any cluster is contacted."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from jobs_support import REPO, client_env, free_port, run_verlite

from verlite import cli
from verlite.cli import build_parser
from verlite.config import ConfigError, load_config
from verlite.jobs import JobsError, connect, resolve_address
from verlite.jobs import server as jobs_server
from verlite.jobs.entrypoint import job_entrypoint, shown_command
from verlite.jobs.resubmit import driver_died, links, resubmission
from verlite.jobs.submission import (
    DEFAULT_EXCLUDES,
    build_runtime_env,
    prepare_submission,
    read_runtime_env,
)

CONFIG = "configs/ppo_tiny.yaml"
JOB = "raysubmit_0123456789abcdef"
ENDED = "JOB_ENTRYPOINT_COMMAND_ERROR"


@pytest.fixture
def silent_server() -> Iterator[str]:
    """An address that accepts connections and never answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


def train_args(entrypoint: str) -> argparse.Namespace:
    argv = shlex.split(shown_command(entrypoint))
    assert argv[:2] == ["verlite", "train"]
    return build_parser().parse_args(argv[1:])


# A head's PATH without this environment's bin/ (a virtualenv's ray started unactivated).
BARE_PATH = "/usr/bin:/bin"


def run_entrypoint(args: list[str], *, via: list[str]) -> subprocess.CompletedProcess[str]:
    """The job's entrypoint run by ``sh -c`` as Ray's job supervisor runs it, with a bare
    PATH; ``via`` is the parent process that starts the shell (a command ending in ``-c``)."""
    env = {"PATH": BARE_PATH, "HOME": os.environ.get("HOME", "/")}
    return subprocess.run(
        [*via, job_entrypoint(args)], env=env, capture_output=True, text=True, timeout=60
    )


def test_the_entrypoint_finds_verlite_beside_the_python_that_runs_ray_jobs() -> None:
    # The parent is a Python of this environment with ray imported, as Ray's job supervisor is.
    parent = [
        sys.executable,
        "-c",
        "import ray, subprocess, sys; sys.exit(subprocess.call(['/bin/sh', '-c', sys.argv[1]]))",
    ]
    assert shutil.which("verlite", path=BARE_PATH) is None
    proc = run_entrypoint(["--help"], via=parent)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: verlite")


def test_a_jobs_output_that_is_not_utf8_reaches_its_log_as_utf8(tmp_path: Path) -> None:
    # A run folder whose name is not UTF-8: `verlite compare` prints it as raw bytes, which
    # Ray's job server could not read back from the log.
    runs = []
    for name in ("run-\udcff", "b"):
        (folder := tmp_path / name).mkdir()
        (folder / "metrics.jsonl").write_text('{"step": 1, "a": 1.0}\n')
        runs.append(str(folder))
    parent = [
        sys.executable,
        "-c",
        "import subprocess, sys; sys.exit(subprocess.call(['/bin/sh', '-c', sys.argv[1]]))",
    ]
    env = {
        "PATH": f"{Path(sys.executable).parent}:{BARE_PATH}",
        "HOME": os.environ.get("HOME", "/"),
    }
    proc = subprocess.run(
        [*parent, job_entrypoint(["compare", *runs])], env=env, capture_output=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    log = proc.stdout.decode("utf-8")
    assert "run-\ufffd and " in log and log.endswith("shown as \ufffd\n")


def test_an_entrypoint_that_finds_no_verlite_says_so_in_one_line() -> None:
    # The parent is a shell (not replaced by the inner one: a command follows it), so no
    # Python with ray names an environment.
    proc = run_entrypoint(["--help"], via=["/bin/sh", "-c", 'sh -c "$0"; exit $?'])
    assert proc.returncode == 127 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1
    assert proc.stderr.startswith("verlite: error: the Ray head has no verlite command on its PATH")
    assert f"({BARE_PATH})" in proc.stderr and "activate its virtualenv" in proc.stderr


def test_a_verlite_job_is_shown_as_the_command_it_runs() -> None:
    entrypoint = job_entrypoint(["train", "--config", "a b.yaml"])
    assert shown_command(entrypoint) == "verlite train --config 'a b.yaml'"
    assert shown_command("python x.py") == "python x.py"


def test_the_job_runs_verlite_train_on_the_cluster_with_metrics_in_its_log() -> None:
    job = prepare_submission(
        config=str(REPO / CONFIG),
        overrides=["trainer.total_steps=2"],
        working_dir=REPO,
        job_id=JOB,
    )
    args = train_args(job.entrypoint)
    assert args.config == CONFIG  # relative to the working dir the job runs in
    assert args.overrides == [
        "trainer.total_steps=2",
        f"trainer.output_dir=outputs/ppo_tiny/{JOB}",  # the config's relative folder, this job's
        "trainer.ray_address=auto",
        "trainer.loggers=[console,jsonl,logline]",
    ]
    cfg = load_config(REPO / args.config, args.overrides)
    assert (cfg.trainer.total_steps, cfg.trainer.ray_address) == (2, "auto")
    assert job.runtime_env == {"working_dir": str(REPO), "excludes": list(DEFAULT_EXCLUDES)}


def test_the_job_keeps_the_users_loggers_and_adds_logline() -> None:
    job = prepare_submission(
        config=str(REPO / CONFIG),
        overrides=["trainer.loggers=[jsonl]"],
        working_dir=REPO,
        job_id=JOB,
    )
    assert train_args(job.entrypoint).overrides[-1] == "trainer.loggers=[jsonl,logline]"


def test_a_job_is_checked_as_the_cluster_will_load_it() -> None:
    # auto counts the GPUs of the machine that loads the config: not the cluster's workers
    with pytest.raises(ConfigError, match=r"^trainer.gpus_per_worker=auto .* give the GPUs"):
        prepare_submission(
            config=str(REPO / CONFIG),
            overrides=["trainer.gpus_per_worker=auto"],
            working_dir=REPO,
            job_id=JOB,
        )


def test_an_empty_config_file_submitted_alone_is_refused_as_empty(tmp_path: Path) -> None:
    # The cluster's address the check adds is no override of the user's: an empty file with
    # none was read as the base of overrides ("data: required field is missing").
    (tmp_path / "empty.yaml").write_text("# nothing yet\n")
    with pytest.raises(ConfigError, match=r"^config file .*empty.yaml' is empty"):
        prepare_submission(
            config=str(tmp_path / "empty.yaml"), overrides=[], working_dir=REPO, job_id=JOB
        )


def test_a_working_dir_that_is_a_link_loop_is_one_line(tmp_path: Path) -> None:
    # pathlib's RuntimeError ("Symlink loop from ...") was a traceback
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    loop = re.escape(f"--working-dir {str(tmp_path / 'a')!r} is a symbolic link loop")
    with pytest.raises(JobsError, match=f"^{loop}"):
        prepare_submission(
            config=str(REPO / CONFIG), overrides=[], working_dir=tmp_path / "a", job_id=JOB
        )


def test_max_restarts_is_set_and_a_resubmission_resumes_in_the_same_absolute_folder(
    tmp_path: Path,
) -> None:
    out = tmp_path / "run"
    job = prepare_submission(
        config=str(REPO / CONFIG),
        overrides=[f"trainer.output_dir={out}"],
        working_dir=REPO,
        job_id=JOB,
        max_restarts=2,
        resubmit=True,
    )
    first, again = train_args(job.entrypoint), train_args(job.resume_entrypoint)
    assert "trainer.max_restarts=2" in first.overrides
    assert again.overrides == [*first.overrides, "trainer.resume=auto", "trainer.overwrite=true"]
    cfg = load_config(REPO / again.config, again.overrides)
    assert (cfg.trainer.output_dir, cfg.trainer.max_restarts) == (str(out), 2)
    assert job.output_dir == str(out)


@pytest.mark.parametrize(
    ("overrides", "problem"),
    [
        ([], "'outputs/ppo_tiny' is relative, inside each job's own working directory"),
        (
            ["trainer.output_dir=/tmp/run", "trainer.resume=/tmp/other/checkpoints/step_3"],
            "not trainer.resume='/tmp/other/checkpoints/step_3'",
        ),
    ],
)
def test_a_resubmission_that_could_not_find_the_checkpoints_is_refused(
    overrides: list[str], problem: str
) -> None:
    with pytest.raises(JobsError, match=re.escape(problem)):
        prepare_submission(
            config=str(REPO / CONFIG),
            overrides=overrides,
            working_dir=REPO,
            job_id=JOB,
            max_restarts=1,
            resubmit=True,
        )


@pytest.mark.parametrize("job_id", ["../up", "a/b", "", "-x", "a" * 101, "jöb", "a\nb", ".."])
def test_a_submission_id_that_is_no_folder_name_is_refused(job_id: str) -> None:
    with pytest.raises(JobsError, match="names the job and its output folder"):
        prepare_submission(config=str(REPO / CONFIG), overrides=[], working_dir=REPO, job_id=job_id)


@pytest.fixture
def listening() -> Iterator[tuple[str, socket.socket]]:
    """An address on 127.0.0.1 and its listening socket, to see whether anyone connected."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        sock.setblocking(False)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", sock


@pytest.mark.parametrize(
    ("job_id", "extra", "problem"),
    [
        ("a/b", [], "--submission-id 'a/b': expected letters, digits"),
        ("../up", [], "--submission-id '../up': expected"),
        ("jöb", [], "--submission-id 'jöb': expected"),
        # An absolute output folder does not need the id as a folder name; Ray still does.
        ("x/y", ["trainer.output_dir=/tmp/verlite-abs"], "--submission-id 'x/y': expected"),
        (
            "a" * 99,
            ["--wait", "--max-restarts", "2", "trainer.output_dir=/tmp/verlite-abs"],
            f"its resubmission id '{'a' * 99}-r2' has 102 characters",
        ),
    ],
)
def test_every_id_a_submission_uses_is_checked_before_any_server_is_contacted(
    listening: tuple[str, socket.socket], job_id: str, extra: list[str], problem: str, capsys
) -> None:
    address, sock = listening
    args = [
        "submit",
        "--address",
        address,
        "--config",
        str(REPO / CONFIG),
        "--submission-id",
        job_id,
    ]
    assert cli.main([*args, *extra]) == 2
    said = capsys.readouterr().err
    assert problem in said and said.count("\n") == 1 and "Traceback" not in said
    with pytest.raises(BlockingIOError):
        sock.accept()  # nobody connected


@pytest.mark.parametrize(
    ("info", "died"),
    [
        ({"error_type": ENDED, "driver_exit_code": -9}, True),  # killed by a signal
        ({"error_type": ENDED, "driver_exit_code": 137}, True),  # the same, through a shell
        ({"error_type": "JOB_SUPERVISOR_ACTOR_DIED", "driver_exit_code": None}, True),
        ({"error_type": ENDED, "driver_exit_code": 1}, False),  # a failure verlite named
        ({"error_type": ENDED, "driver_exit_code": 2}, False),  # bad input
        ({"error_type": ENDED, "driver_exit_code": 127}, False),  # no verlite on the head
        ({"error_type": "RUNTIME_ENV_SETUP_FAILURE", "driver_exit_code": None}, False),
        ({"error_type": "JOB_SUPERVISOR_ACTOR_UNSCHEDULABLE"}, False),  # no driver ever ran
        ({}, False),
    ],
)
def test_only_a_driver_that_died_is_resubmitted(info: dict[str, Any], died: bool) -> None:
    assert driver_died(info) is died


def test_status_links_a_job_and_its_resubmissions() -> None:
    job_id, metadata = resubmission("raysubmit_a", "raysubmit_a", 1)
    assert job_id == "raysubmit_a-r1"
    jobs = [
        {"submission_id": "raysubmit_a", "status": "FAILED", "metadata": {}},
        {"submission_id": job_id, "status": "SUCCEEDED", "metadata": metadata},
    ]
    assert links("raysubmit_a", jobs[0], jobs) == ["resubmitted as raysubmit_a-r1: SUCCEEDED"]
    assert links(job_id, jobs[1], jobs) == [
        "resubmission 1 of raysubmit_a, replacing raysubmit_a, whose driver died"
    ]


def test_a_config_outside_the_working_dir_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text((REPO / CONFIG).read_text())
    with pytest.raises(JobsError, match="outside the working directory"):
        prepare_submission(config=str(config), overrides=[], working_dir=REPO, job_id=JOB)


def test_a_credential_on_the_command_line_is_not_put_into_the_job() -> None:
    """The entrypoint is public to whoever lists jobs; the config file travels privately."""
    uri = "trainer.mlflow_tracking_uri=https://alice:s3cret@mlflow.example:5000"
    with pytest.raises(
        JobsError, match=r"override trainer\.mlflow_tracking_uri carries a credential"
    ):
        prepare_submission(config=str(REPO / CONFIG), overrides=[uri], working_dir=REPO, job_id=JOB)
    job = prepare_submission(
        config=str(REPO / CONFIG),
        overrides=["trainer.mlflow_tracking_uri=https://mlflow.example:5000"],
        working_dir=REPO,
        job_id=JOB,
    )
    assert "mlflow.example" in job.entrypoint  # a URL without credentials is fine


@pytest.mark.parametrize(
    "url",
    [
        "https://mlflow.example/?token=0123456789abcdef",
        "https://mlflow.example/api?user=me&api_key=0123456789abcdef",
        "https://store.example/x?X-Amz-Signature=0123456789abcdef",
    ],
)
def test_a_url_with_a_credential_in_its_query_is_not_put_into_the_job(
    tmp_path: Path, url: str
) -> None:
    """A token in a URL's query is as public on the job's command line, or in its runtime
    env, as user:password@ is; reward.remote.url refuses the same parameters."""
    with pytest.raises(JobsError, match=r"^override trainer\.mlflow_tracking_uri carries a"):
        prepare_submission(
            config=str(REPO / CONFIG),
            overrides=[f"trainer.mlflow_tracking_uri={url}"],
            working_dir=REPO,
            job_id=JOB,
        )
    path = tmp_path / "env.yaml"
    path.write_text(f"env_vars: {{MLFLOW_TRACKING_URI: '{url}'}}\n")
    with pytest.raises(JobsError, match=r"env_vars\.MLFLOW_TRACKING_URI carries a credential"):
        prepare_submission(
            config=str(REPO / CONFIG),
            overrides=[],
            working_dir=REPO,
            job_id=JOB,
            runtime_env_file=str(path),
        )


def test_the_value_of_a_credential_variable_on_the_command_line_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A secret pasted where no credential is expected ($WANDB_API_KEY as a run name).
    monkeypatch.setenv("WANDB_API_KEY", "wk-0123456789abcdef")
    with pytest.raises(JobsError) as info:
        prepare_submission(
            config=str(REPO / CONFIG),
            overrides=["trainer.wandb.run_name=run-wk-0123456789abcdef"],
            working_dir=REPO,
            job_id=JOB,
        )
    assert str(info.value).startswith("override trainer.wandb.run_name carries a credential")
    assert "wk-0123" not in str(info.value)


def test_a_runtime_env_file_merges_into_the_shipped_project(tmp_path: Path) -> None:
    path = tmp_path / "env.yaml"
    path.write_text("env_vars: {A: '1'}\nexcludes: [data/]\npip: [pyarrow]\n")
    env = build_runtime_env(REPO, read_runtime_env(str(path)))
    assert env == {
        "env_vars": {"A": "1"},
        "pip": ["pyarrow"],
        "working_dir": str(REPO),
        "excludes": [*DEFAULT_EXCLUDES, "data/"],
    }
    # an empty one adds nothing (an empty config file is refused: it runs nothing)
    for text in ("", "# none yet\n", "null\n"):
        path.write_text(text)
        assert read_runtime_env(str(path)) == {}


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("[1, 2]", "must hold a mapping"),
        ("env_vars: [", "not valid YAML"),
        ("working_dir: /elsewhere", "--working-dir"),
        ("excludes: data/", "must be a list"),
        ("env_vars: {A: 1}", "invalid runtime env"),
    ],
)
def test_a_bad_runtime_env_file_is_a_user_error(tmp_path: Path, text: str, problem: str) -> None:
    path = tmp_path / "env.yaml"
    path.write_text(text)
    with pytest.raises(JobsError, match=problem):
        build_runtime_env(REPO, read_runtime_env(str(path)))


def test_addresses_resolve_to_dashboard_urls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_ADDRESS", "http://head:8265/")
    assert resolve_address(None) == "http://head:8265"
    assert resolve_address("10.0.0.1:8265") == "http://10.0.0.1:8265"
    assert resolve_address("https://ray.example.com") == "https://ray.example.com"
    for wrong in ("auto", "ray://head:10001"):
        with pytest.raises(JobsError, match="expected the Ray dashboard address"):
            resolve_address(wrong)
    monkeypatch.delenv("RAY_ADDRESS")
    with pytest.raises(JobsError, match="no cluster address"):
        resolve_address(None)


def test_a_refused_or_silent_address_fails_on_its_one_request(
    silent_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # It fails in seconds: one request, not retried as a busy server is, and the silent
    # address's cut at the read timeout (the message says so). Counted, not timed.
    answer, asked = jobs_server._answer, []

    def counted(method: str, url: str, *args: Any) -> tuple[int, bytes]:
        asked.append(url)
        return answer(method, url, *args)

    monkeypatch.setattr(jobs_server, "_answer", counted)
    for url, problem in (
        (f"http://127.0.0.1:{free_port()}", r"^cannot connect to .*: connection refused"),
        (silent_server, r"^no answer from .* within 8 s"),
    ):
        asked.clear()
        with pytest.raises(JobsError, match=problem):
            connect(url)
        assert asked == [f"{url}/api/version"]


def test_cli_errors_are_one_line_exit_2() -> None:
    refused = f"http://127.0.0.1:{free_port()}"
    cases = [
        (["status", "raysubmit_x"], client_env(), "no cluster address"),
        (["list"], client_env(RAY_ADDRESS=refused), f"cannot connect to {refused}"),
        # The config is checked first: no address is needed to learn it is wrong.
        (["submit", "--config", CONFIG, "actor.lrr=1"], client_env(), "unknown key 'actor.lrr'"),
    ]
    for args, env, problem in cases:
        result = run_verlite(args, env, timeout=120)
        assert result.returncode == 2, result.stderr
        assert result.stderr.startswith("verlite: error: ") and problem in result.stderr
        assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("env_vars", "overrides", "named"),
    [
        ("{WANDB_API_KEY: wk-0123456789abcdef}", [], "WANDB_API_KEY"),
        ("{MLFLOW_TRACKING_URI: 'https://alice:s3cret@mlflow.example'}", [], "MLFLOW_TRACKING_URI"),
        # Any setting, not only a variable: a private package index's password.
        (
            "{}\npip: {packages: [pyarrow], pip_install_options: [--index-url, "
            "'https://alice:s3cret@pypi.example/simple']}",
            [],
            "pip.pip_install_options[1]",
        ),
        # The verifier's token, in the variable the config names, whatever it is called.
        (
            "{VERIFIER_KEY: vk-0123456789abcdef}",
            [
                "reward.remote.url=https://verifier.example/score",
                "reward.remote.auth_env=VERIFIER_KEY",
            ],
            "VERIFIER_KEY",
        ),
    ],
)
def test_a_credential_in_the_runtime_env_is_not_put_into_the_job(
    tmp_path: Path, env_vars: str, overrides: list[str], named: str
) -> None:
    """A job's runtime_env is public to whoever lists jobs (`ray job list`, the dashboard's
    GET /api/jobs/ return it whole), as its command line is."""
    path = tmp_path / "env.yaml"
    path.write_text(f"env_vars: {env_vars}\n")
    with pytest.raises(JobsError) as info:
        prepare_submission(
            config=str(REPO / CONFIG),
            overrides=overrides,
            working_dir=REPO,
            job_id=JOB,
            runtime_env_file=str(path),
        )
    message = str(info.value)
    where = named if "." in named else f"env_vars.{named}"
    assert message.startswith(f"runtime env file {str(path)!r}: {where} carries a credential")
    assert "0123456789abcdef" not in message and "s3cret" not in message
    assert "\n" not in message


def test_switches_named_like_credentials_go_into_the_job(tmp_path: Path) -> None:
    """A variable named like a credential whose value is shorter than a credential can be
    (redaction.MIN_SECRET_LENGTH) is a switch, as verlite's masking takes it: Hugging Face's
    TOKENIZERS_PARALLELISM=false (its name holds "token") goes into the job's runtime env."""
    path = tmp_path / "env.yaml"
    path.write_text(
        "env_vars: {TOKENIZERS_PARALLELISM: 'false', HF_HUB_DISABLE_IMPLICIT_TOKEN: '1'}\n"
    )
    submission = prepare_submission(
        config=str(REPO / CONFIG),
        overrides=[],
        working_dir=REPO,
        job_id=JOB,
        runtime_env_file=str(path),
    )
    env_vars = submission.runtime_env["env_vars"]
    assert env_vars["TOKENIZERS_PARALLELISM"] == "false"
    assert env_vars["HF_HUB_DISABLE_IMPLICIT_TOKEN"] == "1"


def test_a_working_dir_over_rays_package_limit_is_refused_before_anything_is_sent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ray zips the working dir uncompressed, hashing and reading every byte first, and its
    job server refuses a package at its gRPC limit (512 MiB) only after the upload: a model
    folder inside the project (docs/recipes.md's models/...) must be named here, in one
    line, before any of that. The limit is lowered to keep the test small."""
    from ray._private.runtime_env import packaging

    monkeypatch.setattr(packaging, "GCS_STORAGE_MAX_SIZE", 1 << 20)
    (tmp_path / "configs").mkdir()
    shutil.copy(REPO / CONFIG, tmp_path / "configs" / "run.yaml")
    model = tmp_path / "models" / "tiny"
    model.mkdir(parents=True)
    (model / "model.safetensors").write_bytes(os.urandom(1 << 20))
    (tmp_path / "data.jsonl").write_bytes(b"{}\n" * 1000)

    def submit(runtime_env: str | None = None) -> None:
        prepare_submission(
            config=str(tmp_path / "configs" / "run.yaml"),
            overrides=[],
            working_dir=tmp_path,
            job_id=JOB,
            runtime_env_file=runtime_env,
        )

    with pytest.raises(JobsError) as info:
        submit()
    message = str(info.value)
    assert message.startswith(f"--working-dir {str(tmp_path)!r} holds 1.0 MiB to ship")
    assert "Ray's limit of 1.0 MiB" in message and "models/ (1.0 MiB)" in message
    assert "\n" not in message
    # Left out by the runtime env's excludes, or by a .gitignore as Ray reads them: shipped.
    excludes = tmp_path / "env.yaml"
    excludes.write_text("excludes: [models/]\n")
    submit(str(excludes))
    (tmp_path / ".gitignore").write_text("/models/\n")
    submit()


@pytest.mark.parametrize("token_file", ["RAY_AUTH_TOKEN_PATH", "HOME"])
def test_the_ray_token_file_inside_the_working_dir_is_never_shipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, token_file: str
) -> None:
    """deploy/slurm/verlite.sbatch writes the token to $SLURM_SUBMIT_DIR/.ray-token-JOBID (mode
    600) and submits from there: the package Ray builds from the runtime env, stored in the
    cluster and unpacked on every node, must not hold it."""
    import zipfile

    from ray._private.runtime_env.packaging import create_package

    shutil.copy(REPO / CONFIG, tmp_path / "run.yaml")
    if token_file == "HOME":
        monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
        monkeypatch.setenv("HOME", str(tmp_path))
        token = tmp_path / ".ray" / "auth_token"
        token.parent.mkdir()
    else:
        token = tmp_path / "run [1]" / ".ray-token-77"
        token.parent.mkdir()
        monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
    token.write_text("0123456789abcdef" * 4)
    job = prepare_submission(
        config=str(tmp_path / "run.yaml"), overrides=[], working_dir=tmp_path, job_id=JOB
    )
    package = tmp_path.parent / f"{tmp_path.name}.zip"
    create_package(
        str(tmp_path),
        package,
        include_gitignore=True,
        excludes=job.runtime_env["excludes"],
    )
    names = zipfile.ZipFile(package).namelist()
    assert "run.yaml" in names
    assert not [name for name in names if "token" in name], names


@pytest.fixture
def streaming_dashboard() -> Iterator[tuple[str, dict[str, str]]]:
    """A real aiohttp server on 127.0.0.1 answering as a Ray dashboard's job API does for a
    job that has ended: its record, and its log over the websocket Ray's SDK follows, closed
    normally at its end. The jobs' statuses are the dict handed out."""
    import asyncio

    from aiohttp import web

    statuses: dict[str, str] = {}

    async def version(request: web.Request) -> web.Response:
        return web.json_response({"ray_version": "2.60.0"})

    async def job(request: web.Request) -> web.Response:
        job_id = request.match_info["job_id"]
        return web.json_response(
            {"submission_id": job_id, "status": statuses[job_id], "entrypoint": "true"}
        )

    async def tail(request: web.Request) -> web.WebSocketResponse:
        socket = web.WebSocketResponse()
        await socket.prepare(request)
        await socket.send_str(f"the log of {request.match_info['job_id']}\n")
        await socket.close()
        return socket

    app = web.Application()
    app.router.add_get("/api/version", version)
    app.router.add_get("/api/jobs/{job_id}", job)
    app.router.add_get("/api/jobs/{job_id}/logs/tail", tail)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = runner.addresses[0][1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}", statuses
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)


@pytest.mark.parametrize(("status", "code"), [("SUCCEEDED", 0), ("FAILED", 1), ("STOPPED", 1)])
def test_following_a_log_exits_as_the_job_ended(
    streaming_dashboard: tuple[str, dict[str, str]],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    status: str,
    code: int,
) -> None:
    """`verlite logs ID --follow` (what `verlite submit` without --wait says to run) ends as
    `submit --wait` does: 0 when the job SUCCEEDED, 1 otherwise, its end on stderr."""
    url, statuses = streaming_dashboard
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    statuses["raysubmit_end"] = status
    assert cli.main(["logs", "raysubmit_end", "--follow", "--address", url]) == code
    out, err = capsys.readouterr()
    assert out == "the log of raysubmit_end\n"
    assert err.splitlines()[-1] == f"job raysubmit_end {status}"


def test_an_input_in_the_working_dir_that_the_job_would_not_get_is_refused(
    tmp_path: Path,
) -> None:
    """Ray leaves out what .gitignore lists (data/ and models/ often are): a relative input
    there exists here, but not in the job's copy of the project, where it is read."""
    shutil.copy(REPO / CONFIG, tmp_path / "run.yaml")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    (tmp_path / ".gitignore").write_text("data/\n")
    overrides = ["data.task=null", "data.train_file=data/train.jsonl"]

    def submit(runtime_env: str | None = None) -> None:
        prepare_submission(
            config=str(tmp_path / "run.yaml"),
            overrides=overrides,
            working_dir=tmp_path,
            job_id=JOB,
            runtime_env_file=runtime_env,
        )

    with pytest.raises(JobsError) as info:
        submit()
    assert str(info.value).startswith(
        "data.train_file='data/train.jsonl' is in the working directory but left out of what "
        "the job ships"
    )
    (tmp_path / ".gitignore").write_text("")
    submit()
    env = tmp_path / "env.yaml"
    env.write_text("excludes: ['*.jsonl']\n")
    with pytest.raises(JobsError, match=r"^data\.train_file='data/train\.jsonl' is in the"):
        submit(str(env))


def test_a_named_pipe_in_the_working_dir_is_refused_not_waited_on(tmp_path: Path) -> None:
    """Ray's SDK hashes every file it ships by reading it: opening a named pipe blocks until
    something writes to it, so `verlite submit` would hang without a word."""
    shutil.copy(REPO / CONFIG, tmp_path / "run.yaml")
    (tmp_path / "tools").mkdir()
    os.mkfifo(tmp_path / "tools" / "events")
    with pytest.raises(JobsError) as info:
        prepare_submission(
            config=str(tmp_path / "run.yaml"), overrides=[], working_dir=tmp_path, job_id=JOB
        )
    assert str(info.value).startswith(
        f"--working-dir {str(tmp_path)!r} holds a named pipe, tools/events, "
    )
    # The command says only that, in one line (Ray's walk logs nothing of it).
    args = ["submit", "--config", str(tmp_path / "run.yaml"), "--working-dir", str(tmp_path)]
    result = run_verlite(
        args, client_env(RAY_ADDRESS=f"http://127.0.0.1:{free_port()}"), timeout=120
    )
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "named pipe" in result.stderr
    (tmp_path / ".gitignore").write_text("/tools/events\n")
    prepare_submission(
        config=str(tmp_path / "run.yaml"), overrides=[], working_dir=tmp_path, job_id=JOB
    )
