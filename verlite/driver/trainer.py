"""The PPO controller on the Ray driver: the stages of one step (docs/design.md, "A step"),
one timed call each.

``Trainer.fit`` reads as the training loop; everything it calls is a worker-group call
(generation, log-probs, values, updates), the step source (``verlite.driver.step_source``: the
prompts and the batch), the scorer (``verlite.driver.scorer``) or pure math on the driver
(advantages, statistics). The trainer is handed its worker groups as one
:class:`RunGroups` (``verlite.driver.run`` places and removes them) and never touches the Ray
session.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tensordict import TensorDict
from torch import Tensor

from verlite import base_weights
from verlite.config import Config, TrainedRole
from verlite.config.derived import old_log_probs_source, precision_line
from verlite.controller import DpSplit, PendingCall, WorkerGroup, completed
from verlite.controller.failures import WorkerInputError, input_error
from verlite.core.advantages import AdvantageInputs, compute_advantages
from verlite.core.dapo import overlong_penalty
from verlite.core.losses import kl_penalty
from verlite.core.rollout_correction import truncated_is_weights
from verlite.core.step_stats import multi_turn_statistics, sampler_agreement, step_statistics
from verlite.core.token_rewards import KLController, apply_kl_penalty, place_scores
from verlite.driver.checkpoint import (
    CheckpointError,
    DamagedCheckpointError,
    begin_checkpoint,
    checkpoint_step,
    clear_folder,
    commit_checkpoint,
    mismatch_error,
    placed_path,
    read_trainer_state,
    resolved_resume,
    resume_instead,
    seal_checkpoint,
    setting_changes,
)
from verlite.driver.dynamic_sampling import DynamicSampling
from verlite.driver.output_folder import FolderChange, FolderState, tell_node_watcher
from verlite.driver.preflight import RunInputs
from verlite.driver.scorer import Scorer
from verlite.driver.step_source import DRIVER_ONLY_COLUMNS, GeneratedStep, StepSource
from verlite.errors import DamagedFileError, MismatchedFileError, RunFailure
from verlite.generation import SamplingParams
from verlite.generation.multi_turn import OUTCOMES as MULTI_TURN_OUTCOMES
from verlite.models.flops import DecoderShape, bf16_peak_flops
from verlite.models.generation_ends import response_stop_ids
from verlite.models.lora import BASE_FOLDER
from verlite.models.packing_cost import attention_crossover
from verlite.package_versions import package_versions
from verlite.policy_folder import (
    INCOMPLETE_MARK,
    MERGED_FOLDER,
    POLICY_FOLDER,
    record_exported_step,
)
from verlite.records import metrics_log
from verlite.records.tracking import Tracker
from verlite.redaction import redact_config
from verlite.step_batch import response_lengths


class TrainingError(RunFailure):
    """The run cannot go on (diverged); every checkpoint it saved is still good to resume from."""


def divergence(metrics: dict[str, float], *, limit: int) -> TrainingError | None:
    """The error that stops a run once a role has skipped ``limit`` updates in a row for a
    non-finite loss or norm; None while it has not.

    Skipped updates never change the weights, so every checkpoint written so far is finite.
    """
    for role in ("actor", "critic"):
        streak = metrics.get(f"{role}/nonfinite_streak", 0.0)
        if streak >= limit:
            return TrainingError(
                f"{role}: {int(streak)} consecutive updates skipped for a non-finite loss or gradient "
                f"norm (trainer.max_consecutive_skips={limit}); the run diverged: lower the "
                "learning rate or check the rewards"
            )
    return None


# The MFU metric of each trained role and the stage that times its update.
MFU_METRICS: dict[TrainedRole, tuple[str, str]] = {
    "actor": ("perf/mfu/update", "update_actor"),
    "critic": ("perf/mfu/critic_update", "update_critic"),
}


def mfu_peaks(
    cfg: Config, groups: dict[TrainedRole, WorkerGroup]
) -> dict[TrainedRole, tuple[DecoderShape, float]]:
    """For each role of ``groups`` on cuda: what its model's FLOPs are counted from, and the
    bf16 peak of the GPUs its ranks hold (``trainer.peak_tflops`` or the table's, times the
    GPUs); asked of each group's rank 0 once. A role on CPU has none; a role on a GPU the
    table does not know without the override has none either (the other roles keep theirs),
    said once a GPU name."""
    peaks: dict[TrainedRole, tuple[DecoderShape, float]] = {}
    unknown = set()
    for role, group in groups.items():
        name, shape = group.call("compute_profile", dispatch="broadcast", collect="rank0")
        if name is None:
            continue
        override = cfg.trainer.peak_tflops
        peak = bf16_peak_flops(name) if override is None else override * 1e12
        if peak is None:
            if name not in unknown:
                print(
                    f"perf/mfu: no bf16 peak known for {name!r} (verlite.models.flops); set "
                    "trainer.peak_tflops to log MFU",
                    flush=True,
                )
            unknown.add(name)
            continue
        placement = group.placement()
        gpus = {(w["node_id"], gpu) for w in placement for gpu in w["gpu_ids"]}
        peaks[role] = (shape, peak * max(len(gpus), 1))
    return peaks


def mfu_metrics(
    cfg: Config,
    peaks: dict[TrainedRole, tuple[DecoderShape, float]],
    attention_mask: Tensor,
    loss_masks: dict[str, Tensor],
    seconds: dict[str, float],
    *,
    response_width: int,
) -> dict[str, float]:
    """``perf/mfu/*`` of the updates that ran (timed in ``seconds``, ``timing_s``'s stages):
    the FLOPs of ppo_epochs forward and backward passes over the real tokens
    (``attention_mask``, the LM head over the real ones of its last ``response_width``
    columns, the responses, where a log-prob pass runs it) of the global mini-batches the
    role updated on (:func:`updated_rows` of its ``loss_masks``) per second of the update's
    wall time, over the bf16 peak of the role's GPUs (:func:`mfu_peaks`)."""
    out = {}
    for role, (shape, peak) in peaks.items():
        key, stage = MFU_METRICS[role]
        if stage in seconds:
            k = cfg.role_sizes(role).num_mini_batches
            rows = attention_mask[updated_rows(loss_masks[role], k)]
            attended, windowed = shape.pairs(rows)
            flops = getattr(cfg, role).ppo_epochs * shape.flops(
                tokens=float(rows.sum()),
                attended=attended,
                windowed=windowed,
                backward=True,
                head_tokens=float(rows[:, -response_width:].sum()),
            )
            out[key] = flops / (seconds[stage] * peak)
    return out


def updated_rows(loss_mask: Tensor, mini_batches: int) -> Tensor:
    """(B,) which rows of a step batch its role's update ran forward and backward passes on:
    those of the global mini-batches (contiguous, ``core.partition.dp_shares``) that hold a
    loss token. The engine skips one that holds none (``TrainEngine.train_mini_batch``: the
    overlong filter can leave a whole mini-batch out), and it costs no FLOPs."""
    by_mini_batch = loss_mask.bool().any(-1).view(mini_batches, -1)
    return by_mini_batch.any(-1, keepdim=True).expand_as(by_mini_batch).flatten()


def _every(freq: int, step: int, last: int) -> bool:
    """Whether a periodic action (validation, checkpoint) runs after ``step``."""
    return freq > 0 and (step % freq == 0 or step == last)


class Timer:
    """Wall time of each named stage of one step (``timing_s/<stage>``): a block's
    (``with timer(stage)``), or a call's in flight from :meth:`start` to :meth:`stop`, which
    other stages may overlap."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._started: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        self.start(stage)
        yield
        self.stop(stage)

    def start(self, stage: str) -> None:
        """Start timing ``stage``; its place among the stages is where it started (stages
        in flight side by side may end in either order)."""
        self.seconds.setdefault(stage, 0.0)
        self._started[stage] = time.perf_counter()

    def stop(self, stage: str) -> None:
        elapsed = time.perf_counter() - self._started.pop(stage)
        self.seconds[stage] += elapsed


@dataclass(frozen=True)
class RunGroups:
    """The worker groups of one run: the actor's, the critic's when the advantage
    estimator needs a value model, the rollout's with ``rollout.placement=split``, and the
    reward model's with ``reward.model.path``."""

    actor: WorkerGroup
    critic: WorkerGroup | None
    rollout: WorkerGroup | None
    reward_model: WorkerGroup | None = None

    @property
    def all(self) -> list[WorkerGroup]:
        groups = (self.actor, self.critic, self.rollout, self.reward_model)
        return [g for g in groups if g is not None]

    @property
    def trained(self) -> list[WorkerGroup]:
        """The groups that train: their state is a checkpoint's."""
        return [self.actor] if self.critic is None else [self.actor, self.critic]

    def check(self, cfg: Config) -> None:
        """These are the groups ``cfg`` runs with: a critic, a rollout and a reward model
        group each exactly when the config needs one."""
        if (self.critic is not None) != cfg.use_critic:
            raise ValueError(
                f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} needs "
                f"{'a' if cfg.use_critic else 'no'} critic group; the trainer was handed "
                f"{'one' if self.critic is not None else 'none'}"
            )
        if (self.rollout is not None) != (cfg.rollout.placement == "split"):
            raise ValueError(
                f"rollout.placement={cfg.rollout.placement} needs "
                f"{'a' if cfg.rollout.placement == 'split' else 'no'} rollout group"
            )
        if (self.reward_model is not None) != (cfg.reward.model.path is not None):
            raise ValueError(
                f"reward.model.path={cfg.reward.model.path!r} needs "
                f"{'a' if cfg.reward.model.path is not None else 'no'} reward model group"
            )


def run_record(cfg: Config) -> dict[str, Any]:
    """The config as the run records it (``config.json``, each checkpoint's state):
    credentials masked, and ``trainer.resume`` as the run resolved it
    (:func:`~verlite.driver.checkpoint.resolved_resume`), for a reader in another folder
    (``verlite export``'s hint of what a new run does)."""
    record = cfg.model_dump(mode="json")
    record["trainer"]["resume"] = resolved_resume(cfg.trainer.resume)
    return redact_config(record)


class Trainer:
    """The training loop on the driver over the worker groups it is handed (``groups``,
    checked against ``cfg``); it never starts or stops them."""

    def __init__(
        self,
        cfg: Config,
        inputs: RunInputs,
        *,
        groups: RunGroups,
        restarts: int = 0,
        saved: list[Path] | None = None,
    ) -> None:
        groups.check(cfg)
        self.cfg = cfg
        self.output_dir = Path(cfg.trainer.output_dir)
        self.tokenizer = inputs.tokenizer
        self.train_set, self.val_set = inputs.train_set, inputs.val_set
        self.base_weights = inputs.base_weights
        self.groups = groups
        self.actor, self.critic = groups.actor, groups.critic
        self.restarts = restarts  # of this run so far (``trainer/restarts``)
        # Where each checkpoint this run saves is recorded (a restart resumes the last).
        self.saved = [] if saved is None else saved
        self.scorer = Scorer(
            cfg,
            inputs.tokenizer,
            reward_fn=inputs.reward_fn,
            remote=inputs.remote,
            reward_model=groups.reward_model,
            reward_model_reads_chat=inputs.reward_model_reads_chat,
        )
        kl = cfg.algorithm.kl_ctrl
        self.kl_ctrl = KLController(
            kl.kl_coef, adaptive=kl.type == "adaptive", target_kl=kl.target_kl, horizon=kl.horizon
        )
        self.recompute_old, self.old_log_probs_line = old_log_probs_source(cfg)
        # Roles that run packed rows get DP shares balanced by a packed row's cost.
        self.splits = {
            role: DpSplit(
                crossover=attention_crossover(cfg.model) if getattr(cfg, role).packing else None
            )
            for role in ("actor", "critic")
        }
        self.step_source = StepSource(
            cfg,
            actor=groups.actor,
            rollout=groups.rollout,
            tokenizer=inputs.tokenizer,
            train_set=inputs.train_set,
            sampling=SamplingParams(
                max_new_tokens=cfg.rollout.max_response_length,
                temperature=cfg.rollout.temperature,
                top_p=cfg.rollout.top_p,
                top_k=cfg.rollout.top_k,
                stop_token_ids=response_stop_ids(cfg, inputs.tokenizer),
                ignore_eos=cfg.rollout.ignore_eos,
            ),
            actor_split=self.splits["actor"],
            with_old=self.recompute_old,
            with_reference=cfg.use_reference,
        )
        self.dynamic_sampling = (
            DynamicSampling(cfg, self.step_source, self._score)
            if cfg.algorithm.dynamic_sampling.enable
            else None
        )
        trained: dict[TrainedRole, WorkerGroup | None] = {
            "actor": groups.actor,
            "critic": groups.critic,
        }
        self.mfu_peaks = mfu_peaks(cfg, {k: g for k, g in trained.items() if g is not None})

    # -------------------------------------------------------------------- the loop

    def fit(self, start_step: int = 0) -> None:
        """Train from ``start_step`` (the step of the checkpoint resumed, 0 for a fresh run)
        to ``trainer.total_steps``: validate and checkpoint on schedule, log every step."""
        cfg = self.cfg
        # A resumed run drops what a crash logged after its checkpoint.
        metrics_log.truncate(self.output_dir, after_step=start_step)
        with Tracker(
            cfg.trainer.loggers,
            output_dir=self.output_dir,
            total_steps=cfg.trainer.total_steps,
            start_step=start_step,
            continuing=self.restarts > 0,
            mlflow_tracking_uri=cfg.trainer.mlflow_tracking_uri,
            wandb=cfg.trainer.wandb,
        ) as tracker:
            tracker.log_run_info(
                run_record(cfg), [w for g in self.groups.all for w in g.placement()]
            )
            print(precision_line(cfg), flush=True)
            print(self.old_log_probs_line, flush=True)
            self.step_source.start(version=start_step)
            for step in range(start_step + 1, cfg.trainer.total_steps + 1):
                self.run_step(step, tracker)

    def run_step(self, step: int, tracker: Tracker) -> None:
        """Train ``step``, validate and write its checkpoint on schedule, log it, then put the
        checkpoint in place. ``timing_s/step`` is all of it but that rename (and the pruning
        of older checkpoints) after the log: what a step costs the run, so that the steps'
        sum is the run's wall time; ``timing_s/validation`` and ``timing_s/checkpoint`` are
        its parts. A checkpoint is renamed into place only once its step is logged: a run
        resumed from it finds the step in every sink."""
        cfg, timer = self.cfg, Timer()
        started = time.perf_counter()
        metrics = self.train_step(step)
        diverged = divergence(metrics, limit=cfg.trainer.max_consecutive_skips)
        sealed = None
        if not diverged and _every(cfg.trainer.val_freq, step, cfg.trainer.total_steps):
            with timer("validation"):
                metrics.update(self.validate())
        if not diverged and _every(cfg.trainer.save_freq, step, cfg.trainer.total_steps):
            with timer("checkpoint"):
                sealed = self.write_checkpoint(step)
        metrics.update({f"timing_s/{stage}": seconds for stage, seconds in timer.seconds.items()})
        metrics["timing_s/step"] = time.perf_counter() - started
        tracker.log(step, metrics)  # the step that diverged is logged too
        if diverged:
            raise diverged
        if sealed is not None:
            self.place_checkpoint(sealed, timer.seconds["checkpoint"])

    def export_policy(self) -> Path:
        """The trained policy and its tokenizer in Hugging Face format, in ``hf_actor/``, with
        the step it is (``record_exported_step``); a LoRA adapter with the identity of the
        base it applies to (``verlite export --merge`` checks it): ``model.path``'s as this
        run started, or the ``base/`` it wrote."""
        path, mark = self.output_dir / POLICY_FOLDER, self.output_dir / INCOMPLETE_MARK
        if path.exists():  # a continued run's earlier export, or a part of an interrupted one
            what = (
                "an earlier step's or an interrupted export"
                if mark.exists()
                else "the earlier export"
            )
            print(f"replacing {path} ({what}) with this run's policy", flush=True)
        mark.touch()  # until the export is whole: a run stopped before resumes to export
        if os.path.lexists(path):
            clear_folder(path)  # none of its files may outlive it beside the new ones
        self.actor.call("export_hf", str(path))
        self.tokenizer.save_pretrained(path)
        if self.cfg.actor.lora.rank > 0:
            base = path / BASE_FOLDER if self.cfg.model.path is None else self.cfg.model.path
            weights = self.base_weights or base_weights.identity(base)
            base_weights.write_record(path, Path(base).resolve(), weights)
        record_exported_step(self.output_dir, self.cfg.trainer.total_steps)
        # Told before the mark goes: a node lost right after it says the export is whole.
        whole = FolderChange((mark,), False, lambda state: replace(state, exported=True))
        tell_node_watcher(self.output_dir, self.cfg.trainer, whole)
        mark.unlink()
        tell_node_watcher(self.output_dir, self.cfg.trainer)
        if (merged := self.output_dir / MERGED_FOLDER).exists():  # verlite export --merge's
            print(
                f"{merged} holds an earlier policy, merged; run verlite export --merge with "
                "--out for this one",
                flush=True,
            )
        return path

    # ---------------------------------------------------------------- checkpoints

    def write_checkpoint(self, step: int) -> Path:
        """Workers write their state into ``step_N.tmp``, the driver's state last, all of it
        flushed to the disk (:func:`~verlite.driver.checkpoint.seal_checkpoint`); the folder,
        for :meth:`place_checkpoint` to put in place."""
        tmp = begin_checkpoint(self.output_dir, step)
        for group in self.groups.trained:
            group.call("save_checkpoint", str(tmp / group.name))
        self.step_source.save_ahead(tmp, version=step)
        state = {
            "step": step,
            # The loader as it was once this step's prompts were drawn: batches generated
            # ahead (rollout.max_staleness) are drawn again on resume (those of older weights
            # kept, StepSource.save_ahead).
            "loader": self.step_source.loader_state,
            "train_set": self.train_set.fingerprint,  # the prompts that state indexes
            "weight_version": step,
            "kl_coef": self.kl_ctrl.value,
            # What a resume compares its settings with (credentials masked, as in config.json).
            "config": run_record(self.cfg),
            # What a resume checks model.path's weights against (None: the built-in model).
            "base_weights": self.base_weights,
            # What a resume compares its own with: other versions may compute other numbers.
            "versions": package_versions(peft=self.cfg.actor.lora.rank > 0),
        }
        seal_checkpoint(tmp, state)
        return tmp

    def place_checkpoint(self, tmp: Path, seconds: float) -> None:
        """Rename a written checkpoint into place. Prints how long the save took
        (``timing_s/checkpoint``, ``seconds``): what ``trainer.save_freq`` weighs against a
        step's time."""
        final = placed_path(tmp)

        keep = self.cfg.trainer.max_checkpoints

        def placed(state: FolderState) -> FolderState:
            # As commit_checkpoint leaves it: the latest, checkpoints of later steps (of a run
            # this one resumed) gone, and of the earlier ones the newest keep - 1.
            earlier = sorted(
                (p for p in state.checkpoints if checkpoint_step(p) < checkpoint_step(final)),
                key=checkpoint_step,
            )
            return replace(state, checkpoints=(*earlier[max(0, len(earlier) - keep + 1) :], final))

        # Told before the rename: a node lost right after it names this checkpoint. Made once
        # the written folder is gone (renamed): this step's own mark may be there before,
        # where the run this one resumed saved the same step.
        placing = FolderChange((tmp,), False, placed)
        tell_node_watcher(self.output_dir, self.cfg.trainer, placing)
        path = commit_checkpoint(tmp, keep=self.cfg.trainer.max_checkpoints)
        self.saved.append(path)
        print(f"saved {path} in {seconds:.2f} s", flush=True)
        tell_node_watcher(self.output_dir, self.cfg.trainer)

    def resume(self, path: Path) -> int:
        """Load the checkpoint at ``path`` into the workers and the driver; its step."""
        state = read_trainer_state(path)
        try:
            for group in self.groups.trained:
                group.call("load_checkpoint", str(path / group.name))
        except WorkerInputError as err:
            cause = input_error(err.__cause__)
            if isinstance(cause, MismatchedFileError) and "config" not in state:
                # The oldest checkpoints record the model settings alone: an adapter's or a
                # role's that changed builds another model, and an earlier one would not do.
                raise CheckpointError(
                    f"{err}: this config builds another model; resume it with the model, "
                    "adapter and role settings it was trained with"
                ) from err
            if not isinstance(cause, DamagedFileError | MismatchedFileError):
                raise  # any other bad input is as it says
            if isinstance(cause, MismatchedFileError):
                # Start-up found every setting of the config that shapes the model as the
                # checkpoint recorded it (check_resumable).
                raise mismatch_error(
                    str(err),
                    path,
                    state,
                    model_path=self.cfg.model.path,
                    workers=self.cfg.trained_workers,
                    readers=[record["versions"] for record in group.placement()],
                ) from err
            raise DamagedCheckpointError(
                f"{err}. {resume_instead(path, self.cfg.trained_workers)}"
            ) from err
        step = int(state["step"])
        # Older checkpoints do not record it; their weights are of their step all the same.
        version = int(state.get("weight_version", step))
        self.step_source.load_loader_state(state["loader"])
        changes = setting_changes(state, self.cfg.model_dump(mode="json"))
        self.step_source.load_ahead(path, changes, version=version)
        self.kl_ctrl.resume(float(state["kl_coef"]))
        print(f"resumed from {path} at step {step} (weights of version {version})", flush=True)
        return step

    def train_step(self, step: int) -> dict[str, float]:
        """One step: the numbered stages, each one worker-group call or driver math."""
        cfg, timer = self.cfg, Timer()
        step_start = time.perf_counter()
        values: PendingCall | None = None  # 3. the critic's values, once submitted
        if self.dynamic_sampling is None:
            with timer("rollout"):  # 1. the step's batch (generated now or ahead), log-probs
                # With a critic, its value pass runs beside the actor's log-prob pass: neither
                # reads the other's result.
                generated = self.step_source.take(step, log_probs=self.critic is None)
                if self.critic is not None:
                    values = self._values(generated.batch)
                    generated.metrics.update(self.step_source.add_log_probs(generated.batch))
            with timer("reward"):  # 2. scores (a multi-turn environment's, or reward.combine's)
                scores, reward_metrics = self._score(generated)
        else:  # 1-2. more draws until enough groups' scores vary (DAPO's dynamic sampling)
            generated, scores, reward_metrics = self.dynamic_sampling.take(step, timer)
        batch = generated.batch
        sampler_metrics = self._behaviour_policy(batch)
        if self.critic is not None:  # 3. values (in flight since the batch was generated)
            # Dynamic sampling refuses GAE, the one estimator with a critic (config.checks).
            assert values is not None
            batch.update(values.result())
        with timer("adv"):  # 4. token rewards and advantages
            batch["token_level_scores"] = place_scores(scores, batch["response_mask"])
            at_limit = response_lengths(batch) >= cfg.response_width
            cut = self._cut_short(batch, at_limit)  # read before the multi-turn outcomes leave
            turn_metrics = self._multi_turn(batch)
            kl_metrics = self._token_rewards(batch)
            batch["advantages"], batch["returns"] = compute_advantages(
                cfg.algorithm.adv_estimator,
                AdvantageInputs(
                    token_level_rewards=batch["token_level_rewards"],
                    response_mask=batch["response_mask"],
                    values=batch.get("values", None),
                    index=batch["uid"],
                    gamma=cfg.algorithm.gamma,
                    lam=cfg.algorithm.lam,
                    norm_adv_by_std=cfg.algorithm.norm_adv_by_std,
                ),
            )
        # 5-6. The updates, in flight side by side: neither reads the other's result. Each
        # is timed from its submission to its own result.
        updates: dict[TrainedRole, PendingCall] = {}
        if self.critic is not None:  # 5. critic update
            updates["critic"] = self._update("critic", self.critic, batch, timer)
        response_mask = batch["response_mask"]
        filtered: dict[str, float] = {}
        # algorithm.overlong.filter, for the actor alone: the critic's shares are sent.
        if cut is not None:
            batch["response_mask"] = response_mask * ~cut.unsqueeze(-1)
            filtered["response_length/overlong_filtered"] = float(cut.float().mean())
        skipping = None
        if step > cfg.critic.warmup_steps or self.critic is None:  # 6. actor update
            updates["actor"] = self._update("actor", self.actor, batch, timer)
        else:  # the critic's warm-up: the actor's peak memory and generation time still count
            skipping = self.actor.call_async("skip_update", dispatch="broadcast", collect="metrics")
        results: dict[TrainedRole, dict[str, float]] = {}
        for role, result in completed(updates):
            timer.stop(f"update_{role}")
            results[role] = result
        actor = results["actor"] if skipping is None else skipping.result()
        metrics = {**results.get("critic", {}), **filtered, **actor}
        metrics.update(self.step_source.updated(step))  # 7. the new weights to the rollout group
        metrics.update(kl_metrics)
        metrics.update(sampler_metrics)
        metrics.update(turn_metrics)
        metrics.update(reward_metrics)
        metrics.update(generated.metrics)
        metrics.update(
            step_statistics(
                scores=scores,
                token_rewards=batch["token_level_rewards"],
                advantages=batch["advantages"],
                returns=batch["returns"],
                response_mask=response_mask,
                at_limit=at_limit,
                values=batch.get("values", None),
            )
        )
        step_time = time.perf_counter() - step_start
        metrics.update({f"timing_s/{stage}": seconds for stage, seconds in timer.seconds.items()})
        metrics["trainer/restarts"] = float(self.restarts)
        metrics.update(self.train_set.length_metrics(""))
        # The training's seconds and tokens per second (:meth:`run_step` adds validation and
        # checkpoint to timing_s/step).
        metrics["timing_s/train"] = step_time
        metrics["perf/throughput"] = float(batch["attention_mask"].sum()) / step_time
        metrics.update(
            mfu_metrics(
                cfg,
                self.mfu_peaks,
                batch["attention_mask"],
                # the critic updated on every response token, the actor on the filter's
                {"critic": response_mask, "actor": batch["response_mask"]},
                timer.seconds,
                response_width=batch["responses"].shape[1],
            )
        )
        return metrics

    # ---------------------------------------------------------------------- helpers

    def _update(
        self, role: TrainedRole, group: WorkerGroup, batch: TensorDict, timer: Timer
    ) -> PendingCall:
        """Start the updates of one role over the step batch, timed from here as
        ``update_<role>`` (``timer``: the caller stops it at the result): its global
        mini-batches (a count the config fixes) balanced over its ranks, metrics reduced over
        them. The shares are sent as this returns (``WorkerGroup.call_async``): the caller may
        then change ``batch`` for the other role's update."""
        k = self.cfg.role_sizes(role).num_mini_batches
        timer.start(f"update_{role}")
        return group.call_async(
            f"update_{role}",
            batch,
            dispatch=replace(self.splits[role], mini_batches=k),
            collect="metrics",
        )

    def _values(self, batch: TensorDict) -> PendingCall:
        """Start the critic's value pass over the step batch's rows (it times the pass
        itself: ``timing_s/values`` comes with its update's metrics); the columns that stay on
        the driver do not travel."""
        assert self.critic is not None
        return self.critic.call_async(
            "compute_values",
            batch.exclude(*DRIVER_ONLY_COLUMNS),
            dispatch=self.splits["critic"],
            collect="concat",
        )

    def _behaviour_policy(self, batch: TensorDict) -> dict[str, float]:
        """Settle the old log-probs against the sampler's (which then leave the batch, with
        the sampling keys): their agreement when recomputed, the sampler's own otherwise,
        and the truncated importance weights with ``algorithm.rollout_correction=tis``."""
        algorithm = self.cfg.algorithm
        del batch["sample_key"]
        sampled = batch.pop("rollout_log_probs")
        assert isinstance(sampled, Tensor)  # a column of the rollout's, never a nested TensorDict
        mask = batch["response_mask"]
        if not self.recompute_old:
            batch["old_log_probs"] = sampled
            return {}
        metrics = sampler_agreement(batch["old_log_probs"], sampled, mask)
        if algorithm.rollout_correction == "tis":
            weights, is_metrics = truncated_is_weights(
                batch["old_log_probs"], sampled, mask, cap=algorithm.rollout_is_cap
            )
            batch["rollout_is_weights"] = weights
            metrics.update(is_metrics)
        return metrics

    def _score(self, generated: GeneratedStep) -> tuple[Tensor, dict[str, float]]:
        """Each row's score (``Scorer``) less its soft overlong penalty
        (``algorithm.overlong.buffer``), and the reward metrics."""
        scores, metrics = self.scorer.score(generated.batch, generated.records)
        overlong = self.cfg.algorithm.overlong
        if overlong.buffer > 0:
            penalty = overlong_penalty(
                response_lengths(generated.batch),
                limit=self.cfg.response_width,
                buffer=overlong.buffer,
                factor=overlong.penalty,
                dtype=scores.dtype,
            )
            scores = scores + penalty
            metrics["reward/overlong_penalty/mean"] = float(penalty.mean())
        return scores, metrics

    def _cut_short(self, batch: TensorDict, at_limit: Tensor) -> Tensor | None:
        """With ``algorithm.overlong.filter``, the rows that leave the policy loss (their
        ``response_mask`` zeroed for the actor's update, so its global counts skip them): the
        responses that reach the response limit (``at_limit``, whose share is
        ``response_length/clip_ratio``), and multi-turn trajectories cut short
        (``truncated``: out of turns or room); None without the filter."""
        if not self.cfg.algorithm.overlong.filter:
            return None
        if "truncated" in set(batch.keys()):
            truncated: Tensor = batch["truncated"]
            return at_limit | truncated.bool()
        return at_limit

    @staticmethod
    def _multi_turn(batch: TensorDict) -> dict[str, float]:
        """The ``multiturn/`` metrics of a multi-turn batch (none otherwise); the per-row
        outcomes they come from leave the batch, which the updates do not read."""
        if "turns" not in set(batch.keys()):
            return {}
        outcomes = {name: batch[name] for name in MULTI_TURN_OUTCOMES}
        for name in MULTI_TURN_OUTCOMES:
            del batch[name]
        del outcomes["env_score"]
        return multi_turn_statistics(**outcomes)

    def _token_rewards(self, batch: TensorDict) -> dict[str, float]:
        if not self.cfg.algorithm.use_kl_in_reward:
            batch["token_level_rewards"] = batch["token_level_scores"]
            return {}
        kl = kl_penalty(
            batch["old_log_probs"], batch["ref_log_prob"], kind=self.cfg.algorithm.kl_penalty
        )
        rewards, mean_kl = apply_kl_penalty(
            batch["token_level_scores"], kl, batch["response_mask"], coef=self.kl_ctrl.value
        )
        batch["token_level_rewards"] = rewards
        metrics = {
            "actor/reward_kl_penalty": mean_kl,
            "actor/reward_kl_penalty_coeff": self.kl_ctrl.value,
        }
        self.kl_ctrl.update(mean_kl, n_samples=batch.batch_size[0])
        return metrics

    def validate(self) -> dict[str, float]:
        """Greedy decoding of the held-out prompts; the mean score is ``val/score/mean``, and
        ``val/data/truncated_prompts`` (and ``val/data/dropped_prompts``) count those cut to
        ``data.max_prompt_length`` (left out), as ``data/...`` the training set's; a
        multi-turn run's trajectories' outcomes as ``val/multiturn/...`` (its tool errors and
        truncations, which score 0 or a cut trajectory's last reward)."""
        records = list(self.val_set)
        batch = self.step_source.validation_batch(records)
        scores, reward_metrics = self.scorer.score(batch, records)
        outcomes = {**reward_metrics, **self._multi_turn(batch)}
        return {
            "val/score/mean": float(scores.mean()),
            **self.val_set.length_metrics("val/"),
            **{f"val/{name}": value for name, value in outcomes.items()},
        }
