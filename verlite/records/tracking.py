"""Where metrics go: a compact console line with a progress bar and ETA, metrics.jsonl, a
marked stdout line per step, TensorBoard, MLflow and Weights & Biases.

Every logger receives the same ``(step, metrics)`` pairs from the driver; metrics are plain
floats already reduced over micro-batches, ranks and mini-batches. Once at the start, every
logger also receives the resolved config and the worker placement (:meth:`Tracker.log_run_info`).
TensorBoard, MLflow and W&B are optional extras, imported only when configured.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import netrc
import os
import re
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, Protocol, TextIO
from urllib.parse import urlsplit

from verlite.errors import UserError, import_extra, one_line
from verlite.reachable import connection_problem
from verlite.records import metrics_log
from verlite.redaction import redact_config, redact_text, redact_url
from verlite.table import format_duration
from verlite.user_files import read_text

if TYPE_CHECKING:
    from verlite.config import WandbConfig

# Shown on the console line, in this order, when present.
CONSOLE_KEYS = (
    ("critic/score/mean", "score"),
    ("val/score/mean", "val"),
    ("actor/pg_loss", "pg_loss"),
    ("critic/vf_loss", "vf_loss"),
    ("actor/kl_loss", "kl"),
    ("actor/entropy", "entropy"),
    ("response_length/mean", "resp_len"),
    ("perf/mfu/update", "mfu"),  # on cuda only
)


# Config keys shown on the console's run line, when present.
RUN_LINE_KEYS = (
    "algorithm.adv_estimator",
    "actor.loss_agg_mode",
    "model.path",
    "data.task",
    "data.train_file",
    "data.train_batch_size",
    "rollout.n",
    "trainer.total_steps",
    "trainer.output_dir",
)


# How a run ended, in MLflow's words: it finished, raised, or was interrupted or terminated.
RunOutcome = Literal["FINISHED", "FAILED", "KILLED"]


def run_outcome(error: BaseException | None) -> RunOutcome:
    """The outcome of a run that ended by raising ``error`` (None: it returned)."""
    if error is None:
        return "FINISHED"
    # Ctrl-C, and SIGTERM (``verlite stop``; ``ray.init`` turns it into SystemExit)
    return "KILLED" if isinstance(error, KeyboardInterrupt | SystemExit) else "FAILED"


class Logger(Protocol):
    def log_run_info(
        self, config: Mapping[str, Any], placement: Sequence[Mapping[str, Any]]
    ) -> None: ...

    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self, outcome: RunOutcome = "FINISHED") -> None: ...


class JsonlLogger:
    """One record per step in ``metrics.jsonl`` (:mod:`verlite.records.metrics_log`); the resolved
    config goes to ``config.json`` beside it."""

    def __init__(self, output_dir: Path) -> None:
        self.writer = metrics_log.MetricsWriter(output_dir / metrics_log.FILE_NAME)
        self.config_path = output_dir / "config.json"

    def log_run_info(
        self, config: Mapping[str, Any], placement: Sequence[Mapping[str, Any]]
    ) -> None:
        # The placement is already in workers.json, written by the controller.
        self.config_path.write_text(json.dumps(config, indent=2, default=str) + "\n")

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.writer.write(step, metrics)

    def close(self, outcome: RunOutcome = "FINISHED") -> None:
        self.writer.close()


class LogLineLogger:
    """One marked record per step on stdout (:func:`verlite.records.metrics_log.marked_line`): a job's
    driver log carries its metrics, so they can be read back from a cluster without access
    to its files."""

    def __init__(self, *, start_step: int = 0, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stdout
        # Readers drop what an earlier attempt of the run logged after start_step.
        print(metrics_log.start_line(start_step), file=self.stream, flush=True)

    def log_run_info(
        self, config: Mapping[str, Any], placement: Sequence[Mapping[str, Any]]
    ) -> None:
        pass  # readers of the marked lines expect metrics only

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        print(metrics_log.marked_line(step, metrics), file=self.stream, flush=True)

    def close(self, outcome: RunOutcome = "FINISHED") -> None:
        pass


class ConsoleLogger:
    """A compact line per step: progress bar, ETA and the headline metrics."""

    def __init__(
        self, *, total_steps: int, start_step: int = 0, stream: TextIO | None = None
    ) -> None:
        self.total_steps = total_steps
        self.start_step = start_step
        self.stream = stream or sys.stdout
        self.started = time.monotonic()

    def log_run_info(
        self, config: Mapping[str, Any], placement: Sequence[Mapping[str, Any]]
    ) -> None:
        flat = flatten_config(config)
        parts = [f"{key}={flat[key]}" for key in RUN_LINE_KEYS if flat.get(key, "null") != "null"]
        roles: dict[str, int] = {}
        for record in placement:
            roles[str(record.get("role"))] = roles.get(str(record.get("role")), 0) + 1
        nodes = len({record.get("node_id") for record in placement})
        workers = ", ".join(f"{role} {count}" for role, count in roles.items())
        count = len(placement)
        parts.append(
            f"{count} worker{'s' * (count != 1)} ({workers}) on {nodes} node{'s' * (nodes != 1)}"
        )
        print("run: " + " ".join(parts), file=self.stream, flush=True)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        done = step - self.start_step
        elapsed = time.monotonic() - self.started
        remaining = (self.total_steps - step) * elapsed / max(done, 1)
        parts = [f"{_bar(step, self.total_steps)} step {step}/{self.total_steps}"]
        parts += [f"{label} {metrics[key]:.3g}" for key, label in CONSOLE_KEYS if key in metrics]
        parts.append(f"{elapsed / max(done, 1):.1f}s/step ETA {format_duration(remaining)}")
        print(" | ".join(parts), file=self.stream, flush=True)

    def close(self, outcome: RunOutcome = "FINISHED") -> None:
        pass


def _bar(step: int, total: int, width: int = 20) -> str:
    filled = min(width, round(width * step / max(total, 1)))
    return "[" + "#" * filled + "-" * (width - filled) + "]"


class TensorBoardLogger:
    """Scalars under ``<output_dir>/tensorboard`` (``tensorboard --logdir`` it); the config and
    placement as text summaries."""

    def __init__(self, log_dir: Path, *, start_step: int = 0, continuing: bool = False) -> None:
        import_extra("tensorboard", feature="the tensorboard logger", extra="tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        # A resumed or restarted run re-logs the steps after its checkpoint: purge_step hides
        # the old ones.
        purge = start_step + 1 if continuing or start_step else None
        self.writer = SummaryWriter(str(log_dir), purge_step=purge)
        self.start_step = start_step

    def log_run_info(
        self, config: Mapping[str, Any], placement: Sequence[Mapping[str, Any]]
    ) -> None:
        for tag, value in (("run/config", config), ("run/placement", placement)):
            # Indented four spaces: TensorBoard renders the text as Markdown, this as code.
            text = json.dumps(value, indent=2, default=str).replace("\n", "\n    ")
            self.writer.add_text(tag, "    " + text, global_step=self.start_step)
        self.writer.flush()

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self, outcome: RunOutcome = "FINISHED") -> None:
        self.writer.close()


class MlflowLogger:
    """One MLflow run per training run, in experiment ``verlite``: metrics per step, the config
    as params (dotted keys) and ``config.json``/``placement.json`` artifacts. A resumed run
    (``start_step > 0``) or a restarted one (``continuing``) continues the run recorded in
    ``<output_dir>/mlflow_run_id``."""

    EXPERIMENT = "verlite"
    MAX_PARAMS_PER_BATCH = 100  # MLflow's limit for one log_batch call

    def __init__(
        self,
        output_dir: Path,
        *,
        tracking_uri: str | None = None,
        start_step: int = 0,
        continuing: bool = False,
    ) -> None:
        mlflow = import_extra("mlflow", feature="the mlflow logger", extra="mlflow")
        self.entities = mlflow.entities
        self.mlflow_error: type[Exception] = mlflow.exceptions.MlflowException
        uri = tracking_uri or (output_dir / "mlruns").resolve().as_uri()
        # MLflow retries a request 7 times over ~2 minutes by default; a server that is down
        # should stop the run in seconds (a user's own setting still wins).
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        if urlsplit(uri).scheme in ("", "file"):
            # MLflow 3 refuses its file store unless opted in; a local folder is verlite's
            # default and needs no server. An explicit MLFLOW_ALLOW_FILE_STORE still wins.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        try:
            self.client = mlflow.tracking.MlflowClient(tracking_uri=uri)
            self.run_id, continued = self._open_run(output_dir, resume=continuing or start_step > 0)
            self.held = self._held_points(after=start_step) if continued else {}
        except self.mlflow_error as exc:
            raise UserError(
                f"mlflow logger: cannot open a run at tracking URI {redact_url(uri)!r}: {exc}"
            ) from None

    def _open_run(self, output_dir: Path, *, resume: bool) -> tuple[str, bool]:
        """The run's id, and whether it is the run recorded before (continued)."""
        id_file = output_dir / "mlflow_run_id"
        if resume and id_file.exists():
            run_id = read_text(id_file, what="MLflow run id file").strip()
            try:
                self.client.update_run(run_id, status="RUNNING")
                return run_id, True
            except self.mlflow_error:
                pass  # the run lives in another tracking store: start a new one
        experiment = self.client.get_experiment_by_name(self.EXPERIMENT)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else self.client.create_experiment(self.EXPERIMENT)
        )
        run_id = str(self.client.create_run(experiment_id, run_name=output_dir.name).info.run_id)
        output_dir.mkdir(parents=True, exist_ok=True)
        id_file.write_text(run_id + "\n")
        return run_id, False

    def _held_points(self, *, after: int) -> dict[str, dict[int, float]]:
        """Each metric's points (step: value) in the continued run after step ``after`` (the
        checkpoint resumed): what the attempts before this one logged of the steps this one
        trains again."""
        keys = self.client.get_run(self.run_id).data.metrics
        return {
            key: {
                m.step: m.value
                for m in self.client.get_metric_history(self.run_id, key)
                if m.step > after
            }
            for key in keys
        }

    def _logs_again(self, key: str, step: int, value: float) -> bool:
        """Whether a point goes to the run: not when the run holds it already. A resumed run
        computes the same values for the steps after its checkpoint, and MLflow cannot delete
        a point, so logging them again would chart each step twice; the run's own clocks and
        counters (``metrics_log.is_run_history``) differ by nature, and the held ones stand.
        A value that differs (a resume with changed settings) is logged beside the held one:
        both are what happened."""
        held = self.held.get(key, {}).get(step)
        if held is None:
            return True
        same = held == value or (math.isnan(held) and math.isnan(value))
        return not (same or metrics_log.is_run_history(key))

    def log_run_info(
        self, config: Mapping[str, Any], placement: Sequence[Mapping[str, Any]]
    ) -> None:
        # Params are immutable in MLflow: a resumed run keeps the values it started with
        # (its config.json artifact shows the current ones).
        logged = self.client.get_run(self.run_id).data.params
        params = [
            self.entities.Param(k, v) for k, v in flatten_config(config).items() if k not in logged
        ]
        for start in range(0, len(params), self.MAX_PARAMS_PER_BATCH):
            self.client.log_batch(
                self.run_id, params=params[start : start + self.MAX_PARAMS_PER_BATCH]
            )
        self.client.log_dict(self.run_id, dict(config), "config.json")
        self.client.log_dict(self.run_id, list(placement), "placement.json")

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        now = int(time.time() * 1000)
        points = [
            self.entities.Metric(key, value, now, step)
            for key, value in ((_mlflow_key(k), float(v)) for k, v in metrics.items())
            if self._logs_again(key, step, value)
        ]
        if points:
            self.client.log_batch(self.run_id, metrics=points)

    def close(self, outcome: RunOutcome = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status=outcome)


class WandbLogger:
    """One W&B run per training run, its files under ``<output_dir>/wandb`` (offline mode:
    ``wandb sync`` uploads them later). The config and placement go to the run's config;
    metrics are charted against ``step``, verlite's training step, so the steps a resumed
    run trains again are shown at their step (W&B's own ``_step`` only counts calls and
    would drop them). A resumed or restarted run continues the run whose id is in
    ``<output_dir>/wandb_run_id``, and does not log again the steps that run holds
    (:meth:`log`)."""

    def __init__(
        self, output_dir: Path, cfg: WandbConfig, *, start_step: int = 0, continuing: bool = False
    ) -> None:
        wandb = import_extra("wandb", feature="the wandb logger", extra="wandb")
        id_file = output_dir / "wandb_run_id"
        resume = (continuing or start_step > 0) and id_file.exists()
        run_id = (
            read_text(id_file, what="W&B run id file").strip() if resume else uuid.uuid4().hex[:12]
        )
        # What every attempt so far sent to this run (run, project and entity alike).
        self.sent_file = output_dir / "wandb_sent.jsonl"
        self.run_key = {"run": run_id, "project": cfg.project, "entity": cfg.entity}
        self.held = self._held_steps() if resume else {}
        output_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.run = wandb.init(
                project=cfg.project,
                entity=cfg.entity,
                name=cfg.run_name or output_dir.name,
                id=run_id,
                resume="allow",
                dir=str(output_dir),
                mode=cfg.mode,
                # verlite prints its own console; system metrics would sample in a thread of
                # the driver, whose CPUs the workers use.
                settings=wandb.Settings(
                    console="off", silent=True, x_disable_stats=True, disable_git=True
                ),
            )
        except Exception as exc:  # wandb raises its own errors, and plain ones, on a bad login
            reason = redact_text(one_line(exc))[:300]  # masked, then cut
            raise UserError(
                f"wandb logger: cannot open run {run_id} in project {cfg.project!r} "
                f"(mode {cfg.mode}): {reason}"
            ) from None
        id_file.write_text(run_id + "\n")
        if not self.held:  # a new run, or one whose record is of another run: started over
            tmp = self.sent_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.run_key) + "\n")
            os.replace(tmp, self.sent_file)
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def _held_steps(self) -> dict[int, str]:
        """The steps the run holds, each with the digest of what was sent
        (:func:`_sent_digest`); none when the record is of another run (a resume into another
        project or entity opens a new run under the same id). A line a crash cut short is
        not counted: that step is sent again."""
        if not self.sent_file.is_file():
            return {}
        header, *lines = read_text(self.sent_file, what="W&B record").splitlines() or [""]
        with contextlib.suppress(json.JSONDecodeError):
            if json.loads(header) == self.run_key:
                held = {}
                for line in lines:
                    with contextlib.suppress(json.JSONDecodeError, KeyError, TypeError):
                        record = json.loads(line)
                        held[int(record["step"])] = str(record["digest"])
                return held
        return {}

    def log_run_info(
        self, config: Mapping[str, Any], placement: Sequence[Mapping[str, Any]]
    ) -> None:
        self.run.config.update({**config, "placement": list(placement)}, allow_val_change=True)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Log a step, unless the run holds it already with the same values: a resumed run
        computes the same values for the steps after its checkpoint, and W&B keeps every
        point it was sent (a point of a lower ``step`` is charted beside the held one; only
        ``_step``, which verlite does not chart by, drops lower ones), whether online or
        synced later from offline files, which know nothing of the attempts before. A step
        whose values differ (a resume with changed settings) is sent: both are what
        happened, as MLflow keeps them. What the run holds is recorded beside it
        (``<output_dir>/wandb_sent.jsonl``: the run, then a digest per step sent)."""
        digest = _sent_digest(metrics)
        if self.held.get(step) == digest:
            return
        self.run.log({**metrics, "step": step})
        with self.sent_file.open("a") as record:
            record.write(json.dumps({"step": step, "digest": digest}) + "\n")

    def close(self, outcome: RunOutcome = "FINISHED") -> None:
        self.run.finish(exit_code=0 if outcome == "FINISHED" else 1)


def _sent_digest(metrics: Mapping[str, float]) -> str:
    """What identifies a step's values: its metrics but the run's clocks and counters
    (``metrics_log.is_run_history``: they differ by nature), each value's exact float."""
    compared = sorted(
        (key, float(value).hex())
        for key, value in metrics.items()
        if not metrics_log.is_run_history(key)
    )
    return hashlib.sha256(json.dumps(compared).encode()).hexdigest()[:32]


def check_wandb(cfg: WandbConfig) -> None:
    """Before a run starts: the wandb package is installed and, for online mode, a key is
    known (``WANDB_API_KEY`` or ``wandb login``'s entry in ``~/.netrc``)."""
    import_extra("wandb", feature="the wandb logger", extra="wandb")
    if cfg.mode != "online" or os.environ.get("WANDB_API_KEY"):
        return
    host = urlsplit(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or ""
    with contextlib.suppress(OSError, netrc.NetrcParseError):
        if netrc.netrc().authenticators(host):
            return
    raise UserError(
        "trainer.wandb.mode='online' needs a W&B API key: set WANDB_API_KEY or run `wandb login`, "
        "or use mode 'offline' and `wandb sync` the run later"
    )


def _mlflow_key(key: str) -> str:
    """MLflow accepts letters, digits, ``_-. /``; anything else would fail the whole batch."""
    return re.sub(r"[^\w\-. /]", "_", key)


def flatten_config(config: Mapping[str, Any]) -> dict[str, str]:
    """The config by dotted key, as a checkpoint records it (``config.flatten``: a
    mapping-valued field such as ``data.chat_template_kwargs`` one value), each value
    JSON-formatted (strings as they are)."""
    from verlite.config import flatten

    return {
        key: value if isinstance(value, str) else json.dumps(value, default=str)
        for key, value in flatten(config).items()
    }


def check_tracking_server(uri: str | None, *, timeout_s: float = 5.0) -> None:
    """Before a run starts: an MLflow server named by an http(s) URI accepts connections, so
    a closed port stops the run in seconds (``trainer.mlflow_tracking_uri``)."""
    if uri is None:
        return
    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return
    port = parts.port or (443 if parts.scheme == "https" else 80)
    reason = connection_problem(parts.hostname, port, timeout_s)
    if reason is not None:
        raise UserError(
            f"trainer.mlflow_tracking_uri={redact_url(uri)!r}: nothing accepts connections at "
            f"{parts.hostname}:{port} ({reason} within {timeout_s:g} s); start the MLflow server "
            "or leave the URI unset for a file store in the output folder"
        )


class Tracker:
    """Fans metrics out to the configured loggers. ``start_step``: the step the run resumed
    from; ``continuing``: the run logged here before even so (a restart from the first step),
    so its earlier records are superseded rather than a new run begun."""

    def __init__(
        self,
        names: Sequence[str],
        *,
        output_dir: Path,
        total_steps: int,
        start_step: int = 0,
        continuing: bool = False,
        mlflow_tracking_uri: str | None = None,
        wandb: WandbConfig | None = None,
    ) -> None:
        self.loggers: list[Logger] = []
        try:
            for name in names:
                if name == "console":
                    self.loggers.append(
                        ConsoleLogger(total_steps=total_steps, start_step=start_step)
                    )
                elif name == "jsonl":
                    self.loggers.append(JsonlLogger(output_dir))
                elif name == "logline":
                    self.loggers.append(LogLineLogger(start_step=start_step))
                elif name == "tensorboard":
                    self.loggers.append(
                        TensorBoardLogger(
                            output_dir / "tensorboard",
                            start_step=start_step,
                            continuing=continuing,
                        )
                    )
                elif name == "mlflow":
                    self.loggers.append(
                        MlflowLogger(
                            output_dir,
                            tracking_uri=mlflow_tracking_uri,
                            start_step=start_step,
                            continuing=continuing,
                        )
                    )
                elif name == "wandb":
                    from verlite.config import WandbConfig

                    self.loggers.append(
                        WandbLogger(
                            output_dir,
                            wandb or WandbConfig(),
                            start_step=start_step,
                            continuing=continuing,
                        )
                    )
                else:
                    raise ValueError(
                        f"unknown logger {name!r}; use console, jsonl, logline, tensorboard, "
                        "mlflow or wandb"
                    )
        except BaseException as exc:
            # the loggers already open (files, an MLflow run) are not leaked
            self.close(run_outcome(exc))
            raise

    def log_run_info(
        self, config: Mapping[str, Any], placement: Sequence[Mapping[str, Any]]
    ) -> None:
        """Record the resolved config and where every worker runs, once, at the start."""
        clean = redact_config(config)
        for logger in self.loggers:
            logger.log_run_info(clean, placement)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        # A metric's name may be a user's (a reward component's): no logger records a secret.
        clean = {redact_text(name): value for name, value in metrics.items()}
        for logger in self.loggers:
            logger.log(step, clean)

    def close(self, outcome: RunOutcome = "FINISHED") -> None:
        """Close every logger, each even when one before it fails (an MLflow server gone at
        the end must not cost the other sinks their last records); the first failure is
        raised once all are closed."""
        failure: Exception | None = None
        for logger in self.loggers:
            try:
                logger.close(outcome)
            except Exception as exc:
                failure = failure or exc
        if failure is not None:
            raise failure

    def __enter__(self) -> Tracker:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close(run_outcome(exc))
