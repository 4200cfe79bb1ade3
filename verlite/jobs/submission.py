"""What ``verlite submit`` sends: the ``verlite train`` entrypoint and the runtime_env that ships
the project, built and validated on this machine before any cluster is contacted."""

from __future__ import annotations

import logging
import os
import re
import secrets
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verlite.config import input_paths, load_config
from verlite.errors import shown
from verlite.jobs.entrypoint import job_entrypoint
from verlite.jobs.resubmit import resubmission
from verlite.jobs.server import JobsError, token_files
from verlite.redaction import carries_secret
from verlite.user_files import resolved_path
from verlite.yaml_files import field_path, read_mapping

# Inside the job, Ray's RAY_ADDRESS names the cluster; without an address the trainer would
# start a private Ray on the head node instead of joining the cluster.
IN_CLUSTER = "trainer.ray_address=auto"
# Never shipped: version control, environments, run outputs, caches and build metadata.
DEFAULT_EXCLUDES = (
    ".git",
    ".venv",
    "outputs",
    "__pycache__",
    ".pytest_cache",
    ".ruff_cache",
    ".mypy_cache",
    "*.egg-info",
)
# The job's metrics travel in its driver log, where `verlite metrics --job` reads them.
JOB_LOGGER = "logline"
# A submission id names the job's own output folder, so it must be a plain folder name, and
# Ray's job server takes it into paths and URLs: one with '/', '..' or non-ASCII characters
# is refused with an HTTP 500 after the job was registered, leaving it PENDING for good.
JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")
# What a resubmitted job adds: the failed job's latest checkpoint, or (when it made none) its
# files moved aside and a fresh start.
RESUME_OVERRIDES = ("trainer.resume=auto", "trainer.overwrite=true")


@dataclass(frozen=True)
class Submission:
    """A job ready to submit: its entrypoint, the entrypoint of a resubmission that resumes
    it (``verlite submit --max-restarts N --wait``), and the runtime_env that ships the
    project."""

    entrypoint: str
    resume_entrypoint: str
    runtime_env: dict[str, Any]
    output_dir: str


def new_submission_id() -> str:
    return f"raysubmit_{secrets.token_hex(8)}"


def check_job_ids(job_id: str, resubmissions: int) -> None:
    """Every id a submission will use, its own and its resubmissions' (``ID-r1`` to
    ``ID-rN``), is one :data:`JOB_ID` allows; else a one-line user error naming the id,
    raised before any server is contacted."""
    allowed = "letters, digits, '_', '.' and '-', starting with a letter or digit, up to 100"
    if not JOB_ID.fullmatch(job_id):
        raise JobsError(
            f"--submission-id {shown(job_id)}: expected {allowed}; it names the job and its "
            "output folder"
        )
    if resubmissions:
        # The longest of the derived ids; they differ only in their count's digits.
        last, _ = resubmission(job_id, job_id, resubmissions)
        if not JOB_ID.fullmatch(last):
            raise JobsError(
                f"--submission-id {shown(job_id)} with --max-restarts {resubmissions}: its "
                f"resubmission id {shown(last)} has {len(last)} characters; expected {allowed} "
                "(shorten the id)"
            )


def default_working_dir() -> Path:
    """The verlite checkout this command runs from, or the current directory for an installed
    wheel (whose code the cluster's image must then carry)."""
    root = Path(__file__).resolve().parents[2]  # verlite/jobs/submission.py -> the checkout
    return root if (root / "pyproject.toml").is_file() else Path.cwd()


def prepare_submission(
    *,
    config: str,
    overrides: Sequence[str],
    working_dir: Path,
    job_id: str,
    runtime_env_file: str | None = None,
    max_restarts: int | None = None,
    resubmit: bool = False,
) -> Submission:
    """Validate the run config and build job ``job_id``; config problems raise before any
    network call.

    A relative ``trainer.output_dir`` becomes ``<output_dir>/<job_id>``: it lies in the job's
    working directory, which Ray unpacks once per node for every job of the same project,
    so jobs submitted alike would otherwise share one folder. ``max_restarts`` sets
    ``trainer.max_restarts``; ``resubmit`` (the caller resubmits a job whose driver died)
    needs an absolute output folder, the one place both jobs see.
    """
    check_job_ids(job_id, (max_restarts or 0) if resubmit else 0)
    # Checked as the job will load it, in the cluster (trainer.gpus_per_worker=auto is
    # refused): the user's config and overrides, then the cluster's address, which is not the
    # user's override (an empty config file given alone is refused as empty, not filled).
    cfg = load_config(load_config(config, overrides), [IN_CLUSTER])
    for item in overrides:
        key, _, value = item.partition("=")
        if carries_secret(key.strip(), value.strip()):
            raise JobsError(
                f"override {key.strip()} carries a credential, and a job's command line is shown "
                "to anyone who can list the cluster's jobs (verlite list, the Ray dashboard); set it "
                "in the config file, which travels inside the job's working directory"
            )
    root = resolved_path(working_dir, f"--working-dir {shown(str(working_dir))}", error=JobsError)
    if not root.is_dir():
        raise JobsError(f"--working-dir {shown(str(working_dir))} is not a directory")
    try:
        config_in_job = Path(config).resolve().relative_to(root).as_posix()
    except ValueError:
        raise JobsError(
            f"--config {shown(config)} is outside the working directory {shown(str(root))} that the job "
            "ships; move it there or pass --working-dir"
        ) from None
    output_dir = Path(cfg.trainer.output_dir)
    if resubmit:
        _check_resumable_by_resubmission(cfg.trainer.output_dir, cfg.trainer.resume)
    elif not output_dir.is_absolute():
        output_dir = output_dir / job_id
    loggers = [*cfg.trainer.loggers, *([] if JOB_LOGGER in cfg.trainer.loggers else [JOB_LOGGER])]
    job_overrides = [
        *overrides,
        *([f"trainer.max_restarts={max_restarts}"] if max_restarts is not None else []),
        *(
            [f"trainer.output_dir={output_dir}"]
            if output_dir != Path(cfg.trainer.output_dir)
            else []
        ),
        IN_CLUSTER,
        f"trainer.loggers=[{','.join(loggers)}]",
    ]
    extra = read_runtime_env(runtime_env_file) if runtime_env_file else {}
    if runtime_env_file:
        _check_no_credentials(runtime_env_file, extra, cfg.reward.remote.auth_env)
    runtime_env = build_runtime_env(root, extra)
    shipped = shipped_files(root, runtime_env["excludes"])
    _check_package_size(root, shipped)
    _check_inputs_shipped(root, shipped, input_paths(cfg))
    command = ["train", "--config", config_in_job, *job_overrides]
    return Submission(
        entrypoint=job_entrypoint(command),
        resume_entrypoint=job_entrypoint([*command, *RESUME_OVERRIDES]),
        runtime_env=runtime_env,
        output_dir=str(output_dir),
    )


def _check_resumable_by_resubmission(output_dir: str, resume: str) -> None:
    """A resubmitted job resumes from the failed job's latest checkpoint: both must see the
    same folder, and the run must not be bound to a checkpoint elsewhere."""
    if not Path(output_dir).is_absolute():
        raise JobsError(
            f"--max-restarts with --wait resubmits a job whose driver died, and the new job "
            f"resumes from the checkpoints in trainer.output_dir; {shown(output_dir)} is relative, "
            "inside each job's own working directory: give an absolute path the head can "
            "write (shared storage on a cluster of several nodes)"
        )
    if resume not in ("auto", "disable"):
        raise JobsError(
            f"--max-restarts with --wait resubmits with trainer.resume=auto (the output "
            f"folder's latest checkpoint), not trainer.resume={shown(resume)}; start from that "
            "checkpoint in a job of its own first"
        )


def read_runtime_env(path: str) -> dict[str, Any]:
    """A runtime_env mapping from YAML (``yaml.safe_load``); the project is shipped separately."""
    data = read_mapping(
        path,
        what="runtime env file",
        example="(env_vars:, pip:, ...)",
        error=JobsError,
        empty_ok=True,
    )
    if "working_dir" in data:
        raise JobsError(
            f"runtime env file {shown(path)} sets working_dir; verlite ships the project itself "
            "(choose it with --working-dir)"
        )
    return data


def _check_no_credentials(path: str, runtime_env: Mapping[str, Any], auth_env: str | None) -> None:
    """A runtime env holds no credential: Ray keeps a job's runtime_env with the job and shows
    it whole to anyone who can list the cluster's jobs (``ray job list``, the dashboard), as it
    does the command line. A credential is a setting :func:`carries_secret` finds (a
    secret-named variable, a value with ``user:pass@`` such as a pip index URL, a known
    secret's value), or the variable ``reward.remote.auth_env`` names."""
    for where, key, value in _settings(runtime_env):
        if (where.startswith("env_vars.") and key == auth_env) or carries_secret(key, value):
            raise JobsError(
                f"runtime env file {shown(path)}: {where} carries a credential, and a job's runtime "
                "env is shown to anyone who can list the cluster's jobs (ray job list, the Ray "
                "dashboard); give it to the cluster's nodes instead (their environment where "
                "`ray start` runs, e.g. from a Kubernetes secret, which the job inherits; a pip "
                "index in their pip.conf)"
            )


def _settings(
    value: object, where: tuple[str | int, ...] = (), key: str = ""
) -> Iterator[tuple[str, str, str]]:
    """Each text setting of a runtime env: where it is (``pip.packages[1]``), the name of the
    mapping key it is under, and its text."""
    if isinstance(value, Mapping):
        for name, item in value.items():
            yield from _settings(item, (*where, str(name)), str(name))
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            yield from _settings(item, (*where, index), key)
    elif value is not None:
        yield field_path(where), key, str(value)


def build_runtime_env(working_dir: Path, extra: Mapping[str, Any]) -> dict[str, Any]:
    """``working_dir`` as the job's working directory, merged with ``extra``, whose excludes
    add to the defaults."""
    from ray.runtime_env import RuntimeEnv

    excludes = extra.get("excludes", [])
    if not isinstance(excludes, list):
        raise JobsError(f"runtime env excludes must be a list of patterns, got {shown(excludes)}")
    runtime_env = {
        **extra,
        "working_dir": str(working_dir),
        "excludes": [*DEFAULT_EXCLUDES, *_token_excludes(working_dir), *excludes],
    }
    try:
        RuntimeEnv(**runtime_env)
    except (TypeError, ValueError) as exc:
        raise JobsError(f"invalid runtime env: {exc}") from None
    return runtime_env


def _token_excludes(working_dir: Path) -> list[str]:
    """Patterns leaving out the Ray token files inside ``working_dir`` (a token written beside
    the project, as deploy/slurm/verlite.sbatch does): a shipped package is stored in the
    cluster and unpacked on every node, readable there by others than the token's owner."""
    root = working_dir.resolve()
    patterns = []
    for path in token_files():
        try:
            inside = path.resolve().relative_to(root).as_posix()
        except ValueError:
            continue
        # Anchored at the working dir, the wildcard characters of a gitignore pattern escaped.
        patterns.append("/" + re.sub(r"([\\*?\[\]!#])", r"\\\1", inside))
    return patterns


def shipped_files(working_dir: Path, excludes: list[str]) -> dict[Path, int]:
    """The files Ray ships from ``working_dir`` (relative to it) and their sizes, found with
    Ray's own walk and rules: the excludes, and ``.gitignore``/``.rayignore`` unless Ray is
    told to ignore them. A named pipe among them is refused."""
    from ray._private import ray_constants
    from ray._private.runtime_env import packaging

    include_gitignore = os.environ.get(ray_constants.RAY_RUNTIME_ENV_IGNORE_GITIGNORE, "0") != "1"
    files: dict[Path, int] = {}
    pipes: list[str] = []

    def count(path: Path) -> None:
        if path.is_file():
            files[path.relative_to(working_dir)] = path.stat().st_size
        elif path.is_fifo():
            pipes.append(path.relative_to(working_dir).as_posix())

    # (Its notes of the ignore files it reads go to this module's logger, not the console.)
    packaging._dir_travel(
        working_dir,
        [packaging._get_excludes(working_dir, excludes)],
        count,
        include_gitignore=include_gitignore,
        logger=logging.getLogger(__name__),
    )
    if pipes:
        # Ray hashes what it ships by reading each file that is not a folder: a named pipe's
        # open() blocks until something writes to it, and the submission with it.
        raise JobsError(
            f"--working-dir {shown(str(working_dir))} holds a named pipe, {pipes[0]}, which Ray "
            "would wait on forever while it reads the project to ship it; remove it, or leave "
            "it out with the --runtime-env file's excludes, .gitignore or .rayignore"
        )
    return files


def _check_package_size(working_dir: Path, shipped: dict[Path, int]) -> None:
    """The ``shipped`` files fit Ray's package limit. Ray's SDK hashes every byte of them,
    zips them uncompressed and uploads the zip, and only then does the job server refuse one
    at its gRPC message limit: counted here from the files' sizes, before any of that."""
    from ray._private.runtime_env import packaging

    sizes: dict[str, int] = {}
    for path, size in shipped.items():
        top = path.parts[0] + ("/" if len(path.parts) > 1 else "")
        sizes[top] = sizes.get(top, 0) + size
    total, limit = sum(sizes.values()), packaging.GCS_STORAGE_MAX_SIZE
    if total >= limit:
        largest = sorted(sizes.items(), key=lambda item: -item[1])[:3]
        listed = ", ".join(f"{name} ({_mib(size)})" for name, size in largest)
        raise JobsError(
            f"--working-dir {shown(str(working_dir))} holds {_mib(total)} to ship, at or over Ray's "
            f"limit of {_mib(limit)} for a job's working directory; the largest: {listed}. Keep "
            "models and data outside it (an absolute path the nodes see), or leave them out "
            "with the --runtime-env file's excludes, .gitignore or .rayignore"
        )


def _check_inputs_shipped(
    working_dir: Path, shipped: dict[Path, int], inputs: Mapping[str, str | None]
) -> None:
    """Each relative input, read in the job's copy of the working dir, is shipped when it is
    in the working dir here: Ray leaves out what .gitignore lists (often data/ and models/)."""
    for dotted, value in inputs.items():
        if value is None or Path(value).is_absolute():
            continue
        inside = Path(os.path.normpath(value))  # as Ray's walk names it: links not followed
        if inside.parts[:1] in ((), ("..",)) or not (working_dir / inside).exists():
            continue  # not in this project: the job says so if it cannot read it
        if any(path == inside or path.is_relative_to(inside) for path in shipped):
            continue
        raise JobsError(
            f"{dotted}={shown(value)} is in the working directory but left out of what the job "
            "ships (by .gitignore, .rayignore, the default excludes or the --runtime-env "
            "file's excludes), so the job would not find it; give it as an absolute path the "
            "nodes see, or stop excluding it"
        )


def _mib(size: int) -> str:
    return f"{size / (1 << 20):.1f} MiB"
