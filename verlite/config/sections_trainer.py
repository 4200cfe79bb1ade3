"""The ``trainer`` section: steps, the cluster layout, validation, checkpoints and the
metric sinks (W&B's settings among them)."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AfterValidator, Field

from verlite.config.fields import (
    AsList,
    Distinct,
    GpusPerWorker,
    Needs,
    NonEmptyStr,
    NonNegativeInt,
    PathStr,
    PositiveInt,
    Seconds,
    Section,
)

# What ray.init connects to: host:port (the head's GCS), Ray Client's ray://host[:port]; an
# IPv6 host in brackets, a link-local one with its zone (``[fe80::1%eth0]``), as Ray parses it.
_RAY_ADDRESS = re.compile(
    r"(?P<client>ray://)?(\[[0-9A-Fa-f:.]+(%[A-Za-z0-9_.-]+)?\]|[A-Za-z0-9._-]+)"
    r"(:(?P<port>\d+))?"
)


def _ray_address(value: str | None) -> str | None:
    """``auto``, ``host:port`` or ``ray://host[:port]``: anything else Ray refuses only when
    the run connects, after the inputs were read, in a traceback ("Invalid address
    format")."""
    if value is None or value == "auto":
        return value
    form = _RAY_ADDRESS.fullmatch(value)
    port = None if form is None or form["port"] is None else int(form["port"])
    if form is None or (port is None and not form["client"]) or port == 0 or (port or 0) > 65535:
        raise ValueError(
            "expected host:port (the head's GCS port, 6379 unless set), ray://host:port (Ray "
            "Client) or auto; leave it unset for an embedded Ray"
        )
    return value


class WandbConfig(Section):
    """Weights & Biases (``trainer.loggers: [wandb]``): where the run is recorded."""

    project: NonEmptyStr = Field("verlite", description="W&B project of the run.")
    entity: NonEmptyStr | None = Field(
        None, description="W&B team or user; None uses the account's default entity."
    )
    run_name: NonEmptyStr | None = Field(
        None, description="Display name of the run; None uses the output folder's name."
    )
    mode: Literal["offline", "online"] = Field(
        "offline",
        description="offline writes the run under <output_dir>/wandb, for `wandb sync` later; "
        "online sends it as it goes (needs WANDB_API_KEY or `wandb login`).",
    )


class TrainerConfig(Section):
    """The run: steps, cluster layout, validation, checkpoints, logging."""

    total_steps: PositiveInt = Field(20, description="Training steps (one batch of prompts each).")
    output_dir: PathStr = Field(
        "outputs/run",
        description="Folder for metrics, checkpoints, workers.json and the exported model.",
    )
    seed: NonNegativeInt = Field(0, description="Seed of data, sampling and initialization.")
    nnodes: PositiveInt = Field(1, description="Nodes each worker group spans.")
    workers_per_node: PositiveInt = Field(
        1, description="Workers per node for every role without its own setting."
    )
    placement: Literal["colocate", "split"] = Field(
        "colocate",
        description="How the actor, critic and reward-model groups take Ray bundles (the CPUs "
        "and GPUs reserved for one worker): colocate: they share bundles, each group a fraction of "
        "each; split: a pool of bundles per group. Unlike rollout.placement (colocated|split), "
        "which says who generates.",
    )
    cpus_per_worker: float = Field(1.0, gt=0.0, description="CPUs of one worker bundle.")
    gpus_per_worker: GpusPerWorker = Field(
        0.0,
        description="GPUs of one worker bundle. auto: 1 when the machine that loads the config "
        "has a CUDA GPU (the workers of an embedded Ray run there), 0 otherwise; resolved at load, "
        "so the logged config holds the number (refused with ray_address: give a number). "
        "Below 1 on cuda only with one actor and one critic worker per node: NCCL needs a GPU "
        "per rank of a group.",
    )
    ray_address: Annotated[NonEmptyStr | None, AfterValidator(_ray_address)] = Field(
        None,
        description="Ray cluster to connect to: host:port (its head's GCS port), "
        "ray://host:port (Ray Client) or auto; None starts an embedded local Ray.",
    )
    resource_timeout_s: Seconds = Field(
        60.0,
        description="Fail if the workers cannot be placed within this many seconds, at the start "
        "and after each restart (the wait for a replacement node).",
    )
    max_restarts: int = Field(
        0,
        ge=0,
        le=1000,
        description="How many times a run whose worker process or node was lost starts its "
        "groups again and resumes from its latest checkpoint (the first step without one); "
        "0 stops the run at the first loss. What a worker raises, and the driver's own "
        "errors, never restart.",
    )
    torch_threads_per_worker: PositiveInt = Field(
        1, description="torch threads of each CPU worker."
    )
    export: bool = Field(
        True,
        description="Write the trained policy to <output_dir>/hf_actor at the end (Hugging Face format). false for runs that only measure: a 7B-shaped policy's export gathers and writes some 30 GB.",
    )
    peak_tflops: float | None = Field(
        None,
        gt=0.0,
        description="On cuda: the GPU's dense bf16 peak in TFLOP/s that perf/mfu/* divide by. None: from verlite's table by torch.cuda.get_device_name() (no MFU for a GPU it does not know).",
    )
    val_freq: NonNegativeInt = Field(
        5, description="Validate every this many steps (and at the end); 0 never."
    )
    save_freq: NonNegativeInt = Field(
        0, description="Checkpoint every this many steps (and at the end); 0 never."
    )
    max_checkpoints: PositiveInt = Field(3, description="Checkpoints kept; older ones are deleted.")
    overwrite: bool = Field(
        False,
        description="A non-empty output_dir that this run does not continue is refused; true moves "
        "its contents aside (to <output_dir>.replaced-<UTC time>) and starts a fresh run there.",
    )
    resume: PathStr = Field(
        "auto",
        description="'auto' (latest complete checkpoint), 'disable', or a checkpoint path (a "
        "relative one is the current folder's; the run records it absolute, in config.json and "
        "its checkpoints, so that `verlite export` run elsewhere names the same checkpoint).",
    )
    loggers: Annotated[
        tuple[Literal["console", "jsonl", "logline", "tensorboard", "mlflow", "wandb"], ...],
        AsList,
        Distinct,
    ] = Field(
        ("console", "jsonl"),
        description="Metric sinks, each named once: console (progress line), jsonl (<output_dir>/metrics.jsonl), "
        "logline (one marked JSON line per step on stdout, read back by `verlite metrics --job`), "
        "tensorboard, mlflow, wandb (see trainer.wandb).",
    )
    mlflow_tracking_uri: NonEmptyStr | None = Field(
        None, description="MLflow tracking URI; None uses a file store in output_dir."
    )
    wandb: WandbConfig = Field(
        default_factory=WandbConfig, description="Weights & Biases, with 'wandb' in loggers."
    )
    max_consecutive_skips: PositiveInt = Field(
        3,
        description="Stop after this many consecutive updates skipped for a non-finite global gradient norm (what a non-finite loss gives).",
    )


# Settings of this section that only a feature makes count (verlite.config.inert).
NEEDS = (
    Needs(
        ("trainer.wandb",),
        unless="trainer.loggers names wandb",
        active=lambda cfg: "wandb" in cfg.trainer.loggers,
        example={"trainer.loggers": ["console", "wandb"]},
    ),
    Needs(
        ("trainer.mlflow_tracking_uri",),
        unless="trainer.loggers names mlflow",
        active=lambda cfg: "mlflow" in cfg.trainer.loggers,
        example={"trainer.loggers": ["console", "mlflow"]},
    ),
    Needs(
        ("trainer.max_checkpoints",),
        unless="trainer.save_freq > 0",
        active=lambda cfg: cfg.trainer.save_freq > 0,
        example={"trainer.save_freq": 5},
    ),
    Needs(
        ("trainer.peak_tflops",),
        unless="the training workers run on cuda (perf/mfu/*)",
        active=lambda cfg: cfg.on_gpu,
        example={"model.device": "cuda"},
    ),
)
