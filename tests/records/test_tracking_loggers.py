"""The Tracker's loggers: TensorBoard event files, an MLflow run on a local file store,
config.json and the console run line, missing optional packages, torn jsonl lines."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from wandb_support import wandb_records, wandb_steps

from verlite import redaction
from verlite.errors import MissingExtraError, UserError
from verlite.records.tracking import Tracker, flatten_config

CONFIG: dict[str, Any] = {
    "algorithm": {"adv_estimator": "gae"},
    "actor": {"loss_agg_mode": "token-mean", "optim": {"lr": 0.001, "betas": [0.9, 0.999]}},
    "model": {"path": None},
    "trainer": {
        "total_steps": 3,
        "loggers": ["console", "jsonl"],
        "ray_address": "http://alice:s3cret@head:8265",
        "api_token": "tok-123",
    },
}
PLACEMENT = [
    {"role": "actor", "rank": 0, "node_id": "n1", "pid": 11, "gpu_ids": []},
    {"role": "critic", "rank": 0, "node_id": "n1", "pid": 12, "gpu_ids": []},
]
STEPS = [
    {"critic/score/mean": 0.1, "actor/pg_loss": 0.5},
    {"critic/score/mean": 0.3, "actor/pg_loss": 0.25},
    {"critic/score/mean": 0.2, "actor/pg_loss": -0.5, "val/score/mean": 0.4},
]


def _run(names: list[str], out: Path, **kwargs: Any) -> None:
    tracker = Tracker(names, output_dir=out, total_steps=len(STEPS), **kwargs)
    tracker.log_run_info(CONFIG, PLACEMENT)
    for step, metrics in enumerate(STEPS, 1):
        tracker.log(step, metrics)
    tracker.close()


def test_jsonl_writes_config_json_without_credentials(tmp_path: Path) -> None:
    _run(["jsonl"], tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["algorithm"] == CONFIG["algorithm"]
    assert config["trainer"]["ray_address"] == "http://***@head:8265"
    assert config["trainer"]["api_token"] == "***"
    assert "s3cret" not in (tmp_path / "config.json").read_text()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"step": i, **m} for i, m in enumerate(STEPS, 1)
    ]


def test_no_logger_records_a_registered_secret(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A secret verlite read (a remote verifier's token) in a metric's name and in a config
    # value that is no credential field (a URL's path, a run name).
    monkeypatch.setattr(redaction, "_registered", set())
    secret = "vt-9f8e7d6c5b"
    redaction.register_secret(secret)
    config = {**CONFIG, "reward": {"remote": {"url": f"http://scorer/{secret}/score"}}}
    tracker = Tracker(["jsonl", "logline", "console"], output_dir=tmp_path, total_steps=1)
    tracker.log_run_info(config, PLACEMENT)
    tracker.log(1, {f"reward/{secret}/mean": 0.5, "critic/score/mean": 0.5})
    tracker.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records == [{"step": 1, "reward/***/mean": 0.5, "critic/score/mean": 0.5}]
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["reward"]["remote"]["url"] == "http://scorer/***/score"
    assert secret not in capsys.readouterr().out


def test_jsonl_drops_a_torn_last_line_before_appending(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "a": 1.0}\n{"step": 2, "a"')  # a run killed mid-write
    tracker = Tracker(["jsonl"], output_dir=tmp_path, total_steps=3, start_step=1)
    tracker.log(2, {"a": 2.0})
    tracker.close()
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"step": 1, "a": 1.0},
        {"step": 2, "a": 2.0},
    ]


def test_console_prints_one_run_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    Tracker(["console"], output_dir=tmp_path, total_steps=3).log_run_info(CONFIG, PLACEMENT)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("run: algorithm.adv_estimator=gae actor.loss_agg_mode=token-mean")
    assert "model.path" not in lines[0]  # unset values are left out
    assert lines[0].endswith("2 workers (actor 1, critic 1) on 1 node")
    assert "s3cret" not in lines[0]


def test_tensorboard_event_files_hold_scalars_and_run_info(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _run(["tensorboard"], tmp_path)
    log_dir = tmp_path / "tensorboard"
    assert any(p.name.startswith("events.out.tfevents") for p in log_dir.iterdir())
    events = EventAccumulator(str(log_dir))
    events.Reload()
    score = events.Scalars("critic/score/mean")
    assert [e.step for e in score] == [1, 2, 3]
    assert [e.value for e in score] == pytest.approx([0.1, 0.3, 0.2])
    assert [e.step for e in events.Scalars("val/score/mean")] == [3]
    assert {"run/config/text_summary", "run/placement/text_summary"} <= set(
        events.Tags()["tensors"]
    )
    text = events.Tensors("run/config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert '"adv_estimator": "gae"' in text
    assert "s3cret" not in text


def test_a_logger_that_fails_to_close_costs_the_others_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from verlite.records.tracking import ConsoleLogger

    def server_gone(self: ConsoleLogger, outcome: str = "FINISHED") -> None:
        raise ConnectionError("the tracking server is gone")

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.setattr(ConsoleLogger, "close", server_gone)
    tracker = Tracker(["console", "mlflow"], output_dir=tmp_path, total_steps=2)
    tracker.log(1, STEPS[0])
    with pytest.raises(ConnectionError, match="the tracking server is gone"):
        tracker.close()
    # the sink after it was still closed: its run ended, not left running
    run = _only_run(_mlflow_client((tmp_path / "mlruns").as_uri()))
    assert run.info.status == "FINISHED"


def test_tensorboard_of_a_run_restarted_from_its_first_step_keeps_one_record_a_step(
    tmp_path: Path,
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _run(["tensorboard"], tmp_path)
    tracker = Tracker(["tensorboard"], output_dir=tmp_path, total_steps=3, continuing=True)
    tracker.log(1, {"critic/score/mean": 0.9})
    tracker.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    score = events.Scalars("critic/score/mean")
    assert [(e.step, e.value) for e in score] == [(1, pytest.approx(0.9))]


def _mlflow_client(uri: str) -> Any:
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _only_run(client: Any) -> Any:
    experiment = client.get_experiment_by_name("verlite")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1
    return runs[0]


def test_mlflow_run_in_the_output_dir_file_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # restored after the test
    out = tmp_path / "ppo-run"
    _run(["mlflow"], out)
    client = _mlflow_client((out / "mlruns").as_uri())
    run = _only_run(client)
    assert run.info.run_name == "ppo-run"
    assert run.info.status == "FINISHED"
    assert (out / "mlflow_run_id").read_text().strip() == run.info.run_id
    history = client.get_metric_history(run.info.run_id, "critic/score/mean")
    assert [m.step for m in history] == [1, 2, 3]
    assert [m.value for m in history] == pytest.approx([0.1, 0.3, 0.2])
    assert run.data.metrics["actor/pg_loss"] == -0.5  # the latest value
    params = run.data.params
    assert params["algorithm.adv_estimator"] == "gae"
    assert params["actor.optim.lr"] == "0.001"
    assert params["actor.optim.betas"] == "[0.9, 0.999]"
    assert params["trainer.ray_address"] == "http://***@head:8265"
    assert params["trainer.api_token"] == "***"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert artifacts == {"config.json", "placement.json"}
    placement = client.download_artifacts(run.info.run_id, "placement.json", str(tmp_path))
    assert json.loads(Path(placement).read_text()) == PLACEMENT


def test_mlflow_resumed_run_continues_the_same_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    _run(["mlflow"], tmp_path)
    tracker = Tracker(["mlflow"], output_dir=tmp_path, total_steps=5, start_step=3)
    changed = {**CONFIG, "trainer": {**CONFIG["trainer"], "total_steps": 5}}
    tracker.log_run_info(changed, PLACEMENT)  # params are immutable: no error, old value kept
    tracker.log(4, {"critic/score/mean": 0.7})
    tracker.close()
    client = _mlflow_client((tmp_path / "mlruns").as_uri())
    run = _only_run(client)
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "critic/score/mean")]
    assert steps == [1, 2, 3, 4]
    assert run.data.params["trainer.total_steps"] == "3"


def test_mlflow_resumed_run_does_not_chart_the_steps_it_trains_again_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run that crashed after step 3 resumes from its checkpoint of step 1: it trains steps
    2 and 3 again, with the same values (exact resume) but its own clocks. MLflow cannot
    delete a point: the run keeps one per step, the first attempt's."""
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    timed = [{**m, "timing_s/step": 1.0} for m in STEPS]
    tracker = Tracker(["mlflow"], output_dir=tmp_path, total_steps=4)
    for step, metrics in enumerate(timed, 1):
        tracker.log(step, metrics)
    tracker.close("FAILED")
    tracker = Tracker(["mlflow"], output_dir=tmp_path, total_steps=4, start_step=1)
    for step, metrics in enumerate(timed[1:], 2):
        tracker.log(step, {**metrics, "timing_s/step": 2.0})
    tracker.log(4, {"critic/score/mean": 0.9, "timing_s/step": 2.0})
    tracker.close()
    client = _mlflow_client((tmp_path / "mlruns").as_uri())
    run_id = _only_run(client).info.run_id

    def points(key: str) -> list[tuple[int, float]]:
        return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))

    assert points("critic/score/mean") == [(1, 0.1), (2, 0.3), (3, 0.2), (4, 0.9)]
    assert points("val/score/mean") == [(3, 0.4)]
    assert points("timing_s/step") == [(1, 1.0), (2, 1.0), (3, 1.0), (4, 2.0)]
    # A resume with changed settings that trains a step to other values: both are logged.
    tracker = Tracker(["mlflow"], output_dir=tmp_path, total_steps=4, start_step=3)
    tracker.log(4, {"critic/score/mean": 0.8})
    tracker.close()
    assert points("critic/score/mean")[-2:] == [(4, 0.8), (4, 0.9)]


def test_mlflow_run_restarted_from_its_first_step_continues_the_same_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    _run(["mlflow"], tmp_path)
    tracker = Tracker(["mlflow"], output_dir=tmp_path, total_steps=3, continuing=True)
    tracker.log(1, {"critic/score/mean": 0.9})
    tracker.close()
    client = _mlflow_client((tmp_path / "mlruns").as_uri())
    run = _only_run(client)  # not a second run
    history = client.get_metric_history(run.info.run_id, "critic/score/mean")
    assert [(m.step, m.value) for m in history][-1] == (1, 0.9)


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (RuntimeError("worker group 'actor' rank 1 died"), "FAILED"),
        (KeyboardInterrupt(), "KILLED"),
        (SystemExit(15), "KILLED"),  # SIGTERM in a driver that called ray.init
    ],
)
def test_mlflow_run_that_raises_is_not_marked_finished(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: BaseException, status: str
) -> None:
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    with (
        pytest.raises(type(error)),
        Tracker(["mlflow"], output_dir=tmp_path, total_steps=3) as tracker,
    ):
        tracker.log(1, STEPS[0])
        raise error
    run = _only_run(_mlflow_client((tmp_path / "mlruns").as_uri()))
    assert run.info.status == status
    assert run.data.metrics["critic/score/mean"] == pytest.approx(0.1)  # logged before it raised


def test_mlflow_tracking_uri_is_used_when_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    store = (tmp_path / "shared-store").as_uri()
    _run(["mlflow"], tmp_path / "out", mlflow_tracking_uri=store)
    assert not (tmp_path / "out" / "mlruns").exists()
    run = _only_run(_mlflow_client(store))
    assert run.data.metrics["critic/score/mean"] == pytest.approx(0.2)


def test_wandb_offline_run_lives_in_the_output_dir_and_wandb_sync_reads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import subprocess

    from verlite.config import WandbConfig

    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)  # never logged, whatever the sink
    _run(["wandb"], tmp_path, wandb=WandbConfig(project="sweep", run_name="trial-1"))
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    run_id = (tmp_path / "wandb_run_id").read_text().strip()
    assert run_dir.name.endswith(f"-{run_id}")
    records = wandb_records(run_dir)
    (run,) = [value for kind, value in records if kind == "run"]
    assert (run.project, run.display_name, run.run_id) == ("sweep", "trial-1", run_id)
    assert wandb_steps(run_dir) == [{**m, "step": s} for s, m in enumerate(STEPS, 1)]
    configured = {
        item.key: json.loads(item.value_json)
        for kind, value in records
        if kind == "config"
        for item in value.update
    }
    assert configured["trainer"]["ray_address"] == "http://***@head:8265"
    assert configured["trainer"]["api_token"] == "***"
    assert configured["placement"] == PLACEMENT
    charted = {(m.glob_name, m.step_metric) for kind, m in records if kind == "metric"}
    assert ("*", "step") in charted  # charts use verlite's step, not W&B's call count
    assert b"s3cret" not in (run_dir / f"run-{run_id}.wandb").read_bytes()
    (exit_record,) = [value for kind, value in records if kind == "exit"]
    assert exit_record.exit_code == 0
    listed = subprocess.run(
        [str(Path(sys.executable).parent / "wandb"), "sync", "--dry-run", str(run_dir)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        check=True,
    )
    assert "Would sync 1 run(s)" in listed.stdout + listed.stderr


def test_wandb_resumed_run_keeps_its_run_id(tmp_path: Path) -> None:
    _run(["wandb"], tmp_path)
    first_id = (tmp_path / "wandb_run_id").read_text()
    tracker = Tracker(["wandb"], output_dir=tmp_path, total_steps=5, start_step=2)
    tracker.log(3, STEPS[2])  # step 3 trained again after the checkpoint: the run holds it
    tracker.log(4, {"critic/score/mean": 0.7})
    tracker.close("FAILED")
    assert (tmp_path / "wandb_run_id").read_text() == first_id
    # Each process writes a folder of its own; `wandb sync` joins them by run id.
    steps = {}
    for run_dir in (tmp_path / "wandb").glob("offline-run-*"):
        (run,) = [value for kind, value in wandb_records(run_dir) if kind == "run"]
        assert run.run_id == first_id.strip()
        steps[len(wandb_steps(run_dir))] = run_dir
    resumed = steps[1]
    assert sorted(steps) == [1, 3]
    assert wandb_steps(resumed) == [{"critic/score/mean": 0.7, "step": 4}]
    (exit_record,) = [value for kind, value in wandb_records(resumed) if kind == "exit"]
    assert exit_record.exit_code == 1
    # A fresh run in a folder holding an earlier run's id starts a run of its own.
    _run(["wandb"], tmp_path)
    assert (tmp_path / "wandb_run_id").read_text() != first_id


def _resumed_wandb_steps(out: Path, steps: dict[int, dict[str, float]], **kwargs: Any) -> list:
    """What a run resumed from step 1 in ``out`` sends to W&B (its own offline folder)."""
    before = set((out / "wandb").glob("offline-run-*"))
    tracker = Tracker(["wandb"], output_dir=out, total_steps=5, start_step=1, **kwargs)
    for step, metrics in steps.items():
        tracker.log(step, metrics)
    tracker.close()
    (resumed,) = set((out / "wandb").glob("offline-run-*")) - before
    return wandb_steps(resumed)


def test_a_resume_sends_w_and_b_what_its_run_does_not_hold(tmp_path: Path) -> None:
    """The run holds steps 1-3 as STEPS; a resume from step 1 sends what differs: a step
    whose values changed (a resume with changed settings), and every step when another W&B
    run opens (another project under the same id). Clocks do not count as a change."""
    from verlite.config import WandbConfig

    _run(["wandb"], tmp_path)
    changed = {**STEPS[2], "actor/pg_loss": -0.25}
    sent = _resumed_wandb_steps(
        tmp_path, {2: {**STEPS[1], "timing_s/step": 9.0}, 3: changed, 4: STEPS[0]}
    )
    assert sent == [{**changed, "step": 3}, {**STEPS[0], "step": 4}]
    sent = _resumed_wandb_steps(tmp_path, {2: STEPS[1]}, wandb=WandbConfig(project="other"))
    assert sent == [{**STEPS[1], "step": 2}]
    # A record cut short by a crash: its step is sent again, the others are held.
    record = tmp_path / "wandb_sent.jsonl"
    lines = record.read_text().splitlines()
    record.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:9])
    assert _resumed_wandb_steps(tmp_path, {2: STEPS[1]}, wandb=WandbConfig(project="other")) == [
        {**STEPS[1], "step": 2}
    ]


def test_wandb_online_without_a_key_fails_before_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from verlite.config import WandbConfig
    from verlite.records.tracking import check_wandb

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc from `wandb login`
    with pytest.raises(UserError, match=r"^trainer.wandb.mode='online' needs a W&B API key"):
        check_wandb(WandbConfig(mode="online"))
    (tmp_path / ".netrc").write_text("machine api.wandb.ai login user password " + "k" * 40)
    (tmp_path / ".netrc").chmod(0o600)
    check_wandb(WandbConfig(mode="online"))
    check_wandb(WandbConfig())  # offline needs no key


@pytest.mark.parametrize(
    ("logger", "module"),
    [("tensorboard", "tensorboard"), ("mlflow", "mlflow"), ("wandb", "wandb")],
)
def test_missing_package_fails_at_construction_with_the_install_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, logger: str, module: str
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` fail
    with pytest.raises(MissingExtraError) as info:
        Tracker(["jsonl", logger], output_dir=tmp_path, total_steps=3)
    assert isinstance(info.value, UserError)  # the CLI prints it in one line, exit 2
    message = str(info.value)
    assert "\n" not in message
    assert f"the {logger} logger" in message
    assert "install it with: pip install '" in message
    assert message.endswith(f"(verlite's {logger!r} extra)")


def test_a_closed_mlflow_server_fails_in_seconds_without_its_credentials(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import socket

    from verlite.errors import UserError
    from verlite.reachable import connection_problem
    from verlite.records import tracking
    from verlite.records.tracking import check_tracking_server

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    checks = []

    def counted(host: str, port: int, timeout_s: float) -> str | None:
        checks.append((host, port, timeout_s))
        return connection_problem(host, port, timeout_s)

    monkeypatch.setattr(tracking, "connection_problem", counted)
    with pytest.raises(
        UserError,
        match=rf"'http://\*\*\*@127.0.0.1:{port}': nothing accepts .* \(Connection refused "
        r"within 5 s\)",
    ) as info:
        check_tracking_server(f"http://user:s3cret@127.0.0.1:{port}")
    assert "s3cret" not in str(info.value)
    # In seconds: one TCP connection tried within 5 s, not an MLflow client's retries.
    assert checks == [("127.0.0.1", port, 5.0)]
    check_tracking_server(None)
    check_tracking_server("file:///tmp/mlruns")  # a file store needs no server


def test_the_logged_params_are_the_configs_dotted_keys_as_a_checkpoint_records_them() -> None:
    """MLflow's params and the console's run line come from flatten_config, which had its own
    copy of config.flatten: a mapping-valued field was a param per name (none at all when
    empty), where the checkpoint records it as one setting."""
    config = {
        "actor": {"optim": {"lr": 0.001}},
        "data": {"chat_template_kwargs": {}},
        "reward": {"combine": {"fn": 1.0, "model": 0.5}},
    }
    assert flatten_config(config) == {
        "actor.optim.lr": "0.001",
        "data.chat_template_kwargs": "{}",
        "reward.combine": '{"fn": 1.0, "model": 0.5}',
    }
