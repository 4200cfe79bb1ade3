"""The PPO controller on the Ray driver: the stages of one step (docs/design.md, "A step"),
one timed call each.

``Trainer.fit`` reads as the training loop; everything it calls is either a worker-group
call (generation, log-probs, values, updates) or pure math on the driver (rewards,
advantages, statistics). The trainer is handed its worker groups (``verlite.run`` places
and removes them) and never touches the Ray session.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import torch
from tensordict import TensorDict
from transformers import PreTrainedTokenizerBase

from verlite import base_weights, metrics_log
from verlite.checkpoint import (
    begin_checkpoint,
    check_train_set,
    commit_checkpoint,
    read_trainer_state,
)
from verlite.config import Config
from verlite.config.derived import old_log_probs_source
from verlite.controller import DpSplit, WorkerGroup
from verlite.core.advantages import AdvantageInputs, compute_advantages
from verlite.core.losses import kl_penalty
from verlite.core.rollout_correction import truncated_is_weights
from verlite.core.step_stats import multi_turn_statistics, sampler_agreement, step_statistics
from verlite.core.token_rewards import KLController, apply_kl_penalty, place_scores
from verlite.data import (
    PromptDataset,
    PromptLoader,
    PromptRecord,
    build_datasets,
    load_tokenizer,
    prompt_tensordict,
    response_text,
    row_records,
)
from verlite.envs import get_environment, turn_stop_id
from verlite.errors import RunFailure
from verlite.models import (
    attention_crossover,
    check_lora_supported,
    check_packing_supported,
    check_tokenizer_fits,
)
from verlite.models.lora import BASE_FOLDER
from verlite.models.reward_model import check_reward_model
from verlite.output_folder import FolderLock, prepare_output_folder
from verlite.redaction import redact_config
from verlite.rewards import RewardFn, resolve_reward, score_responses
from verlite.rewards.combine import combine_scores
from verlite.rewards.remote import RemoteScorer
from verlite.rollout import SamplingParams, sample_keys
from verlite.rollout.multi_turn import OUTCOMES as MULTI_TURN_OUTCOMES
from verlite.rollouts import Rollouts, StepPrompts
from verlite.tracking import Tracker, check_tracking_server, check_wandb
from verlite.workers.reward_model import REWARD_INPUT_KEYS


class TrainingError(RunFailure):
    """The run cannot go on (diverged); the last checkpoint is still good to resume from."""


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
                f"norm (trainer.max_consecutive_skips={limit}); the run diverged. Lower the learning "
                "rate or check the rewards, then resume from the last checkpoint"
            )
    return None


def _every(freq: int, step: int, last: int) -> bool:
    """Whether a periodic action (validation, checkpoint) runs after ``step``."""
    return freq > 0 and (step % freq == 0 or step == last)


class Timer:
    """Wall time of each named stage of one step (``timing_s/<stage>``)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - start


@dataclass(frozen=True)
class RunInputs:
    """What a run reads before any worker starts, so that a bad file, checkpoint or output
    folder fails in a second, before Ray: the tokenizer, the prompt datasets, the reward
    function or the remote verifier (probed: it answers), the checkpoint to resume from
    (None: a fresh run) and the hold on the output folder, made ready under its contract
    (``verlite.output_folder``)."""

    tokenizer: PreTrainedTokenizerBase
    train_set: PromptDataset
    val_set: PromptDataset
    reward_fn: RewardFn
    resume_from: Path | None
    folder: FolderLock
    remote: RemoteScorer | None = None
    # The identity of model.path's weight files, taken once here (``verlite.base_weights``).
    base_weights: dict[str, str] | None = None

    @classmethod
    def load(cls, cfg: Config) -> RunInputs:
        tokenizer = load_tokenizer(cfg.model.path, task=cfg.data.task)
        check_tokenizer_fits(cfg.model.path, len(tokenizer), field="model.path")
        for role in ("actor", "critic"):
            if getattr(cfg, role).packing:
                check_packing_supported(cfg.model, role=role)
        check_lora_supported(cfg.model, cfg.actor.lora)
        if cfg.rollout.multi_turn.env is not None:
            get_environment(cfg.rollout.multi_turn.env)
            if cfg.rollout.multi_turn.turn_stop is not None:
                turn_stop_id(cfg, tokenizer)
        train_set, val_set = build_datasets(cfg, tokenizer)
        reward_fn = resolve_reward(cfg)
        if cfg.reward.model.path is not None:
            check_reward_model(cfg.reward.model)
        remote = RemoteScorer.from_config(cfg.reward.remote)
        if remote is not None:
            remote.probe(train_set[0]["prompt"], train_set[0]["answer"])
        if "mlflow" in cfg.trainer.loggers:
            check_tracking_server(cfg.trainer.mlflow_tracking_uri)
        if "wandb" in cfg.trainer.loggers:
            check_wandb(cfg.trainer.wandb)
        base = None if cfg.model.path is None else base_weights.identity(cfg.model.path)
        # Last: it may move an earlier folder aside, which only a run that starts should do.
        resume_from, folder = prepare_output_folder(cfg)
        if resume_from is not None:
            try:
                check_train_set(resume_from, train_set.fingerprint)
            except BaseException:
                folder.release()
                raise
        return cls(tokenizer, train_set, val_set, reward_fn, resume_from, folder, remote, base)


class Trainer:
    """The training loop on the driver over worker groups it is handed (the actor's, the
    critic's when the advantage estimator needs one, the rollout's when generation is
    split off, the reward model's with ``reward.model.path``); it never starts or stops
    them."""

    def __init__(
        self,
        cfg: Config,
        inputs: RunInputs,
        *,
        actor: WorkerGroup,
        critic: WorkerGroup | None,
        rollout: WorkerGroup | None = None,
        reward_model: WorkerGroup | None = None,
        restarts: int = 0,
        saved: list[Path] | None = None,
    ) -> None:
        if (critic is not None) != cfg.use_critic:
            raise ValueError(
                f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} needs "
                f"{'a' if cfg.use_critic else 'no'} critic group; the trainer was handed "
                f"{'one' if critic is not None else 'none'}"
            )
        if (rollout is not None) != (cfg.rollout.placement == "split"):
            raise ValueError(
                f"rollout.placement={cfg.rollout.placement} needs "
                f"{'a' if cfg.rollout.placement == 'split' else 'no'} rollout group"
            )
        if (reward_model is not None) != (cfg.reward.model.path is not None):
            raise ValueError(
                f"reward.model.path={cfg.reward.model.path!r} needs "
                f"{'a' if cfg.reward.model.path is not None else 'no'} reward group"
            )
        self.cfg = cfg
        self.output_dir = Path(cfg.trainer.output_dir)
        self.tokenizer = inputs.tokenizer
        self.train_set, self.val_set = inputs.train_set, inputs.val_set
        self.reward_fn, self.remote = inputs.reward_fn, inputs.remote
        self.base_weights = inputs.base_weights
        self.actor, self.critic = actor, critic
        self.reward_model = reward_model
        self.restarts = restarts  # of this run so far (``trainer/restarts``)
        # Where each checkpoint this run saves is recorded (a restart resumes the last).
        self.saved = [] if saved is None else saved
        self.groups = [actor] if critic is None else [actor, critic]
        self.loader = PromptLoader(
            self.train_set,
            cfg.data.train_batch_size,
            seed=cfg.trainer.seed,
            shuffle=cfg.data.shuffle,
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
        self.rollouts = Rollouts(
            cfg,
            actor=actor,
            rollout=rollout,
            sampling=SamplingParams(
                max_new_tokens=cfg.rollout.max_response_length,
                temperature=cfg.rollout.temperature,
                top_p=cfg.rollout.top_p,
                top_k=cfg.rollout.top_k,
            ),
            draw=self._draw_prompts,
            actor_split=self.splits["actor"],
            with_old=self.recompute_old,
            with_reference=cfg.use_reference,
        )
        self.placed = [*self.groups, *(g for g in (rollout, reward_model) if g is not None)]
        self._loader_state = self.loader.state_dict()

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
                cfg.model_dump(mode="json"), [w for g in self.placed for w in g.placement()]
            )
            print(self.old_log_probs_line, flush=True)
            self.rollouts.start(version=start_step)
            for step in range(start_step + 1, cfg.trainer.total_steps + 1):
                metrics = self.train_step(step)
                diverged = divergence(metrics, limit=cfg.trainer.max_consecutive_skips)
                if not diverged and _every(cfg.trainer.val_freq, step, cfg.trainer.total_steps):
                    metrics.update(self.validate())
                tracker.log(step, metrics)  # the step that diverged is logged too
                if diverged:
                    raise diverged
                if _every(cfg.trainer.save_freq, step, cfg.trainer.total_steps):
                    self.save_checkpoint(step)

    def export_policy(self) -> Path:
        """The trained policy and its tokenizer in Hugging Face format, in ``hf_actor/``; a
        LoRA adapter with the identity of the base it applies to (``verlite export --merge``
        checks it): ``model.path``'s as this run started, or the ``base/`` it wrote."""
        path = self.output_dir / "hf_actor"
        self.actor.call("export_hf", str(path))
        self.tokenizer.save_pretrained(path)
        if self.cfg.actor.lora.rank > 0:
            base = path / BASE_FOLDER if self.cfg.model.path is None else self.cfg.model.path
            weights = self.base_weights or base_weights.identity(base)
            base_weights.write_record(path, Path(base).resolve(), weights)
        return path

    # ---------------------------------------------------------------- checkpoints

    def save_checkpoint(self, step: int) -> None:
        """Workers write their state into ``step_N.tmp``; the driver's state last, then rename.
        Prints how long it took: what ``trainer.save_freq`` weighs against a step's time."""
        started = time.perf_counter()
        tmp = begin_checkpoint(self.output_dir, step)
        for group in self.groups:
            group.call("save_checkpoint", str(tmp / group.name))
        state = {
            "step": step,
            # The loader as it was once this step's prompts were drawn: batches generated
            # ahead (rollout.max_staleness) are drawn and generated again on resume.
            "loader": self._loader_state,
            "train_set": self.train_set.fingerprint,  # the prompts that state indexes
            "weight_version": step,
            "kl_coef": self.kl_ctrl.value,
            # What a resume compares its settings with (credentials masked, as in config.json).
            "config": redact_config(self.cfg.model_dump(mode="json")),
            # What a resume checks model.path's weights against (None: the built-in model).
            "base_weights": self.base_weights,
        }
        path = commit_checkpoint(tmp, state, keep=self.cfg.trainer.max_checkpoints)
        self.saved.append(path)
        print(f"saved {path} in {time.perf_counter() - started:.2f} s", flush=True)

    def resume(self, path: Path) -> int:
        """Load the checkpoint at ``path`` into the workers and the driver; its step."""
        state = read_trainer_state(path)
        for group in self.groups:
            group.call("load_checkpoint", str(path / group.name))
        self.loader.load_state_dict(state["loader"])
        self.kl_ctrl.value = float(state["kl_coef"])
        step = int(state["step"])
        # Older checkpoints do not record it; their weights are of their step all the same.
        version = int(state.get("weight_version", step))
        print(f"resumed from {path} at step {step} (weights of version {version})", flush=True)
        return step

    def train_step(self, step: int) -> dict[str, float]:
        """One step: the numbered stages, each one worker-group call or driver math."""
        cfg, timer = self.cfg, Timer()
        step_start = time.perf_counter()
        with timer("rollout"):  # 1. the step's batch (generated now or ahead), log-probs
            rollout = self.rollouts.take(step)
        batch, records = rollout.batch, rollout.prompts.records
        self._loader_state = rollout.prompts.loader_state
        sampler_metrics = self._behaviour_policy(batch)
        if self.critic is not None:
            with timer("values"):  # 2. values
                batch.update(
                    self.critic.call(
                        "compute_values",
                        batch,
                        dispatch=self.splits["critic"],
                        collect="concat",
                    )
                )
        with timer("reward"):  # 3. reward (a multi-turn environment's, or reward.combine's)
            scores, reward_metrics = self._score(batch, records)
            batch["token_level_scores"] = place_scores(scores, batch["response_mask"])
            turn_metrics = self._multi_turn(batch)
        with timer("adv"):  # 4. advantages
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
        metrics: dict[str, float] = {}
        if self.critic is not None:
            with timer("update_critic"):  # 5. critic update
                metrics.update(self._update("critic", self.critic, batch))
        if step > cfg.critic.warmup_steps or self.critic is None:
            with timer("update_actor"):  # 6. actor update
                metrics.update(self._update("actor", self.actor, batch))
        metrics.update(self.rollouts.updated(step))  # 7. the new weights to the rollout group
        metrics.update(kl_metrics)
        metrics.update(sampler_metrics)
        metrics.update(turn_metrics)
        metrics.update(reward_metrics)
        metrics.update(rollout.metrics)
        metrics.update(
            step_statistics(
                scores=scores,
                token_rewards=batch["token_level_rewards"],
                advantages=batch["advantages"],
                returns=batch["returns"],
                response_mask=batch["response_mask"],
                max_response_length=cfg.response_width,
                values=batch.get("values", None),
            )
        )
        step_time = time.perf_counter() - step_start
        metrics.update({f"timing_s/{stage}": seconds for stage, seconds in timer.seconds.items()})
        metrics["timing_s/step"] = step_time
        metrics["trainer/restarts"] = float(self.restarts)
        metrics["data/truncated_prompts"] = float(self.train_set.num_truncated)
        metrics["perf/throughput"] = float(batch["attention_mask"].sum()) / step_time
        return metrics

    # ---------------------------------------------------------------------- helpers

    def _update(
        self, role: Literal["actor", "critic"], group: WorkerGroup, batch: TensorDict
    ) -> dict[str, float]:
        """The updates of one role over the step batch: its global mini-batches (a count the
        config fixes) balanced over its ranks, metrics reduced over them."""
        k = self.cfg.role_sizes(role).num_mini_batches
        metrics: dict[str, float] = group.call(
            f"update_{role}",
            batch,
            dispatch=replace(self.splits[role], mini_batches=k),
            collect="metrics",
        )
        return metrics

    def _draw_prompts(self, step: int) -> StepPrompts:
        """The next prompts of the data order, each response's sampling key (design.md,
        "Whole-run invariance") and the loader's state after them."""
        records = next(self.loader)
        prompts = self._prompt_batch(
            records, repeat=self.cfg.rollout.n, temperature=self.cfg.rollout.temperature
        )
        prompts["sample_key"] = sample_keys(
            self.cfg.trainer.seed, step, len(records), self.cfg.rollout.n
        )
        return StepPrompts(step, prompts, records, self.loader.state_dict())

    def _behaviour_policy(self, batch: TensorDict) -> dict[str, float]:
        """Settle the old log-probs against the sampler's (which then leave the batch, with
        the sampling keys): their agreement when recomputed, the sampler's own otherwise,
        and the truncated importance weights with ``algorithm.rollout_correction=tis``."""
        algorithm = self.cfg.algorithm
        del batch["sample_key"]
        sampled = batch.pop("rollout_log_probs")
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

    def _prompt_batch(
        self, records: list[PromptRecord], *, repeat: int, temperature: float
    ) -> TensorDict:
        """The prompts as a TensorDict, each repeated ``repeat`` times; a row's record is
        ``row_records(records, uid)``."""
        return prompt_tensordict(
            records,
            self.tokenizer,
            max_prompt_length=self.cfg.data.max_prompt_length,
            repeat=repeat,
            temperature=temperature,
        )

    def _score(
        self, batch: TensorDict, records: list[PromptRecord]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Each row's score and the reward metrics: its environment's last reward
        (multi-turn), else the weighted sum of the reward sources ``reward.combine`` names
        (``rewards.combine``). The reward model scores on its group while the reward
        function scores here."""
        if "env_score" in set(batch.keys()):
            return batch["env_score"].float(), {}
        weights = self.cfg.reward.combine
        assert weights is not None  # resolved at load
        pending = None
        if "model" in weights:
            assert self.reward_model is not None
            pending = self.reward_model.call_async(
                "score",
                batch.select(*REWARD_INPUT_KEYS),
                dispatch="dp_split",
                collect="concat",
            )
        sources: dict[str, list[float]] = {}
        if "fn" in weights or "remote" in weights:
            texts, answers, prompts = self._decoded(batch, records)
            if "fn" in weights:
                sources["fn"] = score_responses(
                    self.reward_fn, texts, answers, prompts, timeout_s=self.cfg.reward.timeout_s
                )
            if "remote" in weights:
                assert self.remote is not None
                sources["remote"] = self.remote.score(texts, answers, prompts)
        metrics: dict[str, float] = {}
        if pending is not None:
            scored = pending.result()
            sources["model"] = scored["rm_score"].tolist()
            metrics["reward/model/truncated"] = float(scored["rm_truncated"].sum())
        combined = combine_scores(sources, weights)
        metrics.update(combined.metrics)
        return torch.tensor(combined.scores, dtype=torch.float32), metrics

    def _decoded(
        self, batch: TensorDict, records: list[PromptRecord]
    ) -> tuple[list[str], list[str], list[str]]:
        """What a reward function and a remote verifier score: each decoded response, and
        its record's answer and prompt (``records``: one per prompt, by ``uid``)."""
        texts = [
            response_text(self.tokenizer, row[:n].tolist())
            for row, n in zip(
                batch["responses"], batch["response_mask"].sum(-1).tolist(), strict=True
            )
        ]
        rows = row_records(records, batch["uid"])
        answers = [r["answer"] for r in rows]
        prompts = [r["prompt"] for r in rows]
        return texts, answers, prompts

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
        """Greedy decoding of the held-out prompts; the mean score is ``val/score/mean``."""
        records = list(self.val_set)
        prompts = self._prompt_batch(records, repeat=1, temperature=0.0)
        greedy = SamplingParams(
            max_new_tokens=self.cfg.rollout.max_response_length, temperature=0.0
        )
        records_for_envs = records if self.cfg.rollout.multi_turn.env is not None else None
        batch = self.actor.call(
            "generate",
            prompts,
            greedy,
            0,
            records_for_envs,
            dispatch="dp_split",
            collect="concat",
        )
        scores, reward_metrics = self._score(batch, records)
        return {
            "val/score/mean": float(scores.mean()),
            **{f"val/{name}": value for name, value in reward_metrics.items()},
        }
