"""A rollout worker group of its own (``rollout.placement=split``) on the shared embedded Ray:

- on-policy (``rollout.max_staleness=0``) it logs the colocated run's metrics.jsonl, every
  non-timing metric to 1e-9 in float64, also across a resume from a checkpoint taken while
  the next step's prompts were already drawn, at an epoch's end;
- with ``max_staleness=1`` a resume draws the uninterrupted run's prompts for every step;
- with ``max_staleness=2`` (and an FSDP actor of 2 workers) no batch is trained on by
  weights more than 2 versions newer than the ones that generated it, and truncated
  importance sampling reports its weights;
- a bucket corrupted in transit, a worker that holds another version than the sync's after
  it, or a killed rollout worker, stops the run with an error naming the worker.
"""

import dataclasses
import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import ray
import torch

from verlite.audit.run_invariance import RoleLayout, RunLayout, audit_runs
from verlite.audit.tolerances import RUN_ATOL
from verlite.config import Config, load_config
from verlite.controller import WorkerGroupError
from verlite.driver.preflight import RunInputs
from verlite.driver.run import run, start_groups
from verlite.driver.step_source import StepSource
from verlite.driver.trainer import Trainer
from verlite.generation import WeightSyncError
from verlite.records.compare import first_difference

CONFIG = "configs/grpo_tiny.yaml"
# 4 prompts x 8 samples a step, one actor update; half a CPU a worker on the shared Ray.
SMALL = (
    "model.precision=fp64",
    "trainer.cpus_per_worker=0.5",
    "data.train_batch_size=4",
    "actor.ppo_mini_batch_size=32",
    "trainer.val_freq=0",
    "trainer.loggers=[jsonl]",
)
SPLIT = ("rollout.placement=split", "rollout.workers_per_node=2")
# Epochs of 2 batches: a checkpoint of step 2 lands at the end of the first.
EPOCHS_OF_TWO = ("data.num_train_samples=8",)


def config(out: Path, *overrides: str) -> Config:
    return load_config(CONFIG, [*SMALL, f"trainer.output_dir={out}", *overrides])


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_split_on_policy_logs_the_colocated_run_also_across_a_resume(
    tmp_path: Path, local_ray, metrics, capsys: pytest.CaptureFixture[str]
) -> None:
    colocated = config(tmp_path / "colocated", *EPOCHS_OF_TWO, "trainer.total_steps=4")
    # The split run checkpoints steps 2 and 4; step 3's prompts are drawn (the loader moved
    # on) before step 2's checkpoint is saved. A copy of its folder resumes from step 2.
    straight = config(
        tmp_path / "split", *SPLIT, *EPOCHS_OF_TWO, "trainer.total_steps=4", "trainer.save_freq=2"
    )
    run(straight, RunInputs.load(straight))
    shutil.copytree(tmp_path / "split", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed/checkpoints/step_4")
    state = json.loads((tmp_path / "resumed/checkpoints/step_2/trainer_state.json").read_text())
    assert state["weight_version"] == 2
    # the loader as step 2 left it: at the end of epoch 0, not after step 3's prompts
    assert state["loader"] == {"epoch": 0, "position": 2, "seed": 0}
    # Resumed on the static decode path: the same run.
    resumed = config(
        tmp_path / "resumed",
        *SPLIT,
        *EPOCHS_OF_TWO,
        "trainer.total_steps=4",
        "rollout.decode=static",
    )
    one = RunLayout(RoleLayout(1, "ddp", "full"), RoleLayout(1, "ddp", "full"))
    reports = audit_runs([colocated, resumed], [one, one], tolerance=1e-9, atol=RUN_ATOL["fp64"])
    assert reports[1].ok and reports[1].identical_steps == 4, reports[1].first_difference
    assert "resumed from" in (tmp_path / "resumed/console.log").read_text()
    # the resumed run trained steps 3 and 4 and is the uninterrupted run
    assert metrics(tmp_path / "resumed", stable_only=True) == metrics(
        tmp_path / "split", stable_only=True
    )

    split = records(tmp_path / "resumed")
    assert [r["rollout/weight_version"] for r in split] == [0, 1, 2, 3]
    assert all(r["rollout/staleness/max"] == 0 for r in split)
    # each step reports the sync that delivered its weights; the weights are the model's
    assert all(r["perf/weight_sync_bytes"] > 0 and r["timing_s/weight_sync"] > 0 for r in split)
    # the sampler computes in float32, the recompute in float64
    assert all(r["rollout/logprob_max_diff"] < 1e-6 for r in split)
    placement = json.loads((tmp_path / "resumed/workers.json").read_text())
    assert sorted((w["role"], w["rank"]) for w in placement) == [
        ("actor", 0),
        ("rollout", 0),
        ("rollout", 1),
    ]
    assert len({w["pid"] for w in placement}) == 3


def test_async_training_keeps_every_batch_within_the_staleness_bound(
    tmp_path: Path, local_ray, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = config(
        tmp_path,
        "rollout.placement=split",
        # two FSDP actor workers: the sync gathers each shard in turn
        "actor.workers_per_node=2",
        "actor.strategy=fsdp",
        "actor.micro_batch_size_per_worker=16",
        "rollout.max_staleness=2",
        "algorithm.rollout_correction=tis",
        "algorithm.rollout_is_cap=1.5",
        "algorithm.recompute_old_log_probs=auto",
        "trainer.total_steps=5",
    )
    run(cfg, RunInputs.load(cfg))
    assert "recomputed by the actor, as the sampler's may differ" in capsys.readouterr().out
    logged = records(tmp_path)
    # batches 1-3 were generated by the initial weights; then each by the weights 2 updates old
    assert [r["rollout/weight_version"] for r in logged] == [0, 0, 0, 1, 2]
    assert [r["rollout/staleness/max"] for r in logged] == [0, 1, 2, 2, 2]
    # on-policy batches weigh 1; stale ones differ from the trained policy, within the cap
    first, *later = logged
    assert first["actor/rollout_is_weight/mean"] == pytest.approx(1.0, abs=1e-6)
    assert first["rollout/logprob_max_diff"] < 1e-6  # the sampler computes in float32
    assert all(r["rollout/logprob_max_diff"] > 1e-6 for r in later)
    assert all(0 < r["actor/rollout_is_weight/mean"] <= 1.5 for r in later)


def test_with_staleness_a_resume_draws_each_steps_prompts_of_the_uninterrupted_run(
    tmp_path: Path, local_ray, metrics, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``max_staleness=1`` step ``s + 1``'s prompts are drawn during step ``s``. A resume
    from step 2 draws steps 3 and 4 again from the loader's state after step 2: the prompts
    the uninterrupted run drew. Step 3's batch is then generated by version 2 (fresher than
    the uninterrupted run's version 1); step 4's by version 2 in both, from the same
    prompts and sampling keys, so its batch, scores and advantages are the same."""
    drawn: dict[str, list[tuple[int, list[str]]]] = {}
    draw_prompts = StepSource._draw

    def recorded(source: StepSource, step: int):
        prompts = draw_prompts(source, step)
        run_name = Path(source.cfg.trainer.output_dir).name
        drawn.setdefault(run_name, []).append((step, [r["prompt"] for r in prompts.records]))
        return prompts

    monkeypatch.setattr(StepSource, "_draw", recorded)
    stale = (*SPLIT, *EPOCHS_OF_TWO, "rollout.max_staleness=1", "trainer.total_steps=4")
    straight = config(tmp_path / "straight", *stale, "trainer.save_freq=2")
    run(straight, RunInputs.load(straight))
    shutil.copytree(tmp_path / "straight", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed/checkpoints/step_4")
    state = json.loads((tmp_path / "resumed/checkpoints/step_2/trainer_state.json").read_text())
    assert state["loader"] == {"epoch": 0, "position": 2, "seed": 0}  # not after step 4's
    resumed = config(tmp_path / "resumed", *stale)
    run(resumed, RunInputs.load(resumed))

    assert [step for step, _ in drawn["straight"]] == [1, 2, 3, 4]
    assert drawn["resumed"] == drawn["straight"][2:]
    before, after = metrics(tmp_path / "straight"), metrics(tmp_path / "resumed")
    assert after[:2] == before[:2]  # the records up to the checkpoint are kept
    assert [r["rollout/weight_version"] for r in before] == [0, 0, 1, 2]
    assert [r["rollout/weight_version"] for r in after] == [0, 0, 2, 2]
    assert [r["rollout/staleness/max"] for r in after] == [0, 1, 0, 1]
    batch_only = ("critic/", "response_length/")
    step_4 = [{k: v for k, v in r[3].items() if k.startswith(batch_only)} for r in (before, after)]
    assert step_4[0] and step_4[0] == step_4[1]


@ray.remote(num_cpus=0)
def _handed_over(refs: list) -> ray.ObjectRef:
    """A task whose result is the reference it was given (a list keeps Ray from fetching)."""
    return refs[0]


class InTransit:
    """The rollout group with the buckets of the sync of ``version`` altered in transit by
    ``alter(bucket)`` (a bucket, or None to leave one as it is): each is fetched, altered and
    put back in the object store under a new reference, which replaces the actor's in the
    call the workers receive."""

    def __init__(self, group, version: int, alter) -> None:
        self.group = group
        self.version = version
        self.alter = alter

    def __getattr__(self, name: str):
        return getattr(self.group, name)

    def call_async(self, method: str, *args, **kwargs):
        if method == "load_bucket":  # the argument: the actor's call, returning a reference
            bucket = ray.get(ray.get(args[0]))
            altered = self.alter(bucket) if bucket.version == self.version else None
            if altered is not None:
                # as the actor's call returns it
                args = (_handed_over.remote([ray.put(altered)]),)
        return self.group.call_async(method, *args, **kwargs)


def flip_a_bit_of_the_last_bucket(bucket):
    if bucket.index < bucket.count - 1:
        return None
    parts = [part.copy() for part in bucket.parts]
    next(part for part in parts if part.nbytes)[0] ^= 0x01
    return dataclasses.replace(bucket, parts=parts)


def split_trainer(inputs: RunInputs, cfg: Config, groups, rollout) -> Trainer:
    return Trainer(cfg, inputs, groups=dataclasses.replace(groups, rollout=rollout))


def third_step_error(tmp_path: Path, alter, error: type[Exception]) -> Exception:
    """What step 3 of a split run raises (``error``) when the sync of version 2 (made by
    step 2) is altered in transit by ``alter``; steps 1 and 2 train."""
    cfg = config(tmp_path, "rollout.placement=split", "rollout.sync_bucket_mb=0.01")
    inputs = RunInputs.load(cfg)
    with start_groups(cfg, inputs.tokenizer) as groups:
        trainer = split_trainer(inputs, cfg, groups, InTransit(groups.rollout, 2, alter))
        trainer.step_source.start(version=0)
        for step in (1, 2):
            trainer.train_step(step)
        with pytest.raises(error) as raised:
            trainer.train_step(3)
    return raised.value


def test_a_bucket_corrupted_in_transit_stops_the_run_naming_the_worker(
    tmp_path: Path, local_ray
) -> None:
    message = str(third_step_error(tmp_path, flip_a_bit_of_the_last_bucket, WorkerGroupError))
    assert "worker group 'rollout': rank 0" in message and "failed in load_bucket()" in message
    assert (
        "WeightSyncError: rollout rank 0 (node 127.0.0.1): weights of version 2 failed" in message
    )
    assert "generation is refused until a sync succeeds" in message


def test_a_worker_holding_another_version_after_a_sync_stops_the_run(
    tmp_path: Path, local_ray
) -> None:
    """Every bucket of the sync of version 2 arrives labelled version 3, intact: each worker
    lands it and reports version 3, which the driver refuses when it takes the sync's batch
    (before the generation that would use those weights is fetched)."""
    raised = third_step_error(
        tmp_path, lambda bucket: dataclasses.replace(bucket, version=3), WeightSyncError
    )
    assert str(raised) == (
        "rollout rank 0 (node 127.0.0.1): after the sync of version 2 it holds version 3"
    )


def test_a_killed_rollout_worker_stops_the_run_in_seconds_naming_it(
    tmp_path: Path, local_ray
) -> None:
    cfg = config(tmp_path, *SPLIT)
    inputs = RunInputs.load(cfg)
    with start_groups(cfg, inputs.tokenizer) as groups:
        trainer = split_trainer(inputs, cfg, groups, groups.rollout)
        trainer.step_source.start(version=0)
        trainer.train_step(1)
        victim = next(w for w in groups.rollout.placement() if w["rank"] == 1)
        os.kill(victim["pid"], signal.SIGKILL)
        # the batch of step 2 may have been generated before the kill; step 3's cannot be.
        # Seen as the process's death (the message says so), not waited out: a loss that
        # went unseen would hang the step (pytest's timeout is the only hang guard).
        with pytest.raises(WorkerGroupError) as raised:
            for step in (2, 3):
                trainer.train_step(step)
    message = str(raised.value)
    assert message.startswith("worker group 'rollout': rank 1 on node")
    assert "(127.0.0.1)" in message and "worker process died" in message


def test_with_recompute_auto_the_samplers_log_probs_serve_and_the_run_is_the_same(
    tmp_path: Path, local_ray, capsys: pytest.CaptureFixture[str]
) -> None:
    """On-policy in float32, the sampler's log-probs replace the actor's recompute: no
    forward pass for them, and metrics within float rounding of the recomputing run."""
    runs = {}
    for mode in ("always", "auto"):
        cfg = config(
            tmp_path / mode,
            "model.precision=fp32",
            f"algorithm.recompute_old_log_probs={mode}",
            "trainer.total_steps=3",
        )
        run(cfg, RunInputs.load(cfg))
        runs[mode] = records(tmp_path / mode)
    assert "old log-probs: the sampler's own" in capsys.readouterr().out
    assert all("rollout/logprob_abs_diff" in r for r in runs["always"])
    assert not any("rollout/logprob_abs_diff" in r for r in runs["auto"])
    sampler_only = {"rollout/logprob_abs_diff", "rollout/logprob_max_diff"}
    always = [{k: v for k, v in r.items() if k not in sampler_only} for r in runs["always"]]
    difference = first_difference(always, runs["auto"], tolerance=1e-4, atol=1e-6)
    assert difference is None, difference.describe("always", "auto")


def _tied_chat_model(folder: Path) -> tuple[str, ...]:
    """Overrides for a ``model.path`` Qwen2 whose LM head is tied to its embedding (as
    Qwen2.5-0.5B's), trained on a GSM8K parquet through its chat template."""
    from chat_model_support import save_chat_model, write_gsm8k_parquet

    save_chat_model(folder / "model")
    data = write_gsm8k_parquet(folder / "gsm8k.parquet")
    return (
        f"model.path={folder / 'model'}",
        "data.task=null",
        f"data.train_file={data}",
        f"data.val_file={data}",
        "data.prompt_key=question",
        "data.answer_rule=gsm8k",
        "data.chat_template=true",
        "data.max_prompt_length=64",
        "reward.fn=gsm8k",
    )


@pytest.mark.parametrize(
    "tied", [False, pytest.param(True, marks=pytest.mark.cluster, id="tied-head")]
)
def test_in_bf16_mixed_the_split_run_logs_the_colocated_run(
    tmp_path: Path, local_ray, capsys: pytest.CaptureFixture[str], tied: bool
) -> None:
    """The rollout model holds its linear layers in bf16 and each sync casts the actor's fp32
    master weights to it, checked where they land: it generates bit for bit what the
    colocated actor's fp32 policy generates under bf16 autocast. A head tied to the
    embedding (``tied``, a whole run: ``make test-cluster``) is a bf16 head of its own in the
    rollout model, sent under its own name."""
    model = _tied_chat_model(tmp_path) if tied else ()
    runs = {}
    for name, placement in (("colocated", ()), ("split", SPLIT)):
        cfg = config(
            tmp_path / name,
            "model.precision=bf16-mixed",
            "trainer.total_steps=2",
            *model,
            *placement,
        )
        run(cfg, RunInputs.load(cfg))
        runs[name] = records(tmp_path / name)
    assert "precision: bf16-mixed (fp32 master weights" in capsys.readouterr().out
    assert all(r["perf/weight_sync_bytes"] > 0 for r in runs["split"])
    if tied:  # every tensor the rollout model holds, its bf16 head beside the fp32 embedding
        from transformers import AutoModelForCausalLM

        from verlite.models.precision import store_for_generation

        held = store_for_generation(
            AutoModelForCausalLM.from_pretrained(tmp_path / "model"), "bf16-mixed"
        )
        assert held.lm_head.weight.dtype == torch.bfloat16
        nbytes = sum(t.nbytes for t in held.state_dict().values())
        assert all(r["perf/weight_sync_bytes"] == nbytes for r in runs["split"])
    unstable = ("timing_s/", "perf/", "trainer/")
    stable = {
        name: [{k: v for k, v in r.items() if not k.startswith(unstable)} for r in rs]
        for name, rs in runs.items()
    }
    difference = first_difference(stable["colocated"], stable["split"], tolerance=0, atol=0)
    assert difference is None, difference.describe("colocated", "split")
