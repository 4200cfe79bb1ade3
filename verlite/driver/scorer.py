"""A step's scores on the driver, from the reward sources ``reward.combine`` names
(docs/design.md, "Reward models", "Remote verifiers"): one call a step, for training and
validation alike.

It sits with the driver's modules, not in ``rewards/``: it calls the reward model's worker
group and sends it the columns that worker reads (``workers.reward_model``), which the
rewards package, below the workers, may not import.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict
from transformers import PreTrainedTokenizerBase

from verlite.config import Config
from verlite.controller import WorkerGroup
from verlite.data import PromptRecord, record_conversation, response_texts, row_records
from verlite.models.generation_ends import response_stop_ids
from verlite.models.precision import score_dtype
from verlite.rewards import RewardFn, score_responses
from verlite.rewards.answer_reward import AnswerReward
from verlite.rewards.combine import combine_scores
from verlite.rewards.remote import RemoteScorer
from verlite.workers.peak_memory import pop_peak
from verlite.workers.reward_model import REWARD_INPUT_KEYS


class Scorer:
    """The reward sources of a run: the reward function, the remote verifier
    (``reward.remote``) and the reward model's worker group (``reward.model.path``)."""

    def __init__(
        self,
        cfg: Config,
        tokenizer: PreTrainedTokenizerBase,
        *,
        reward_fn: RewardFn,
        remote: RemoteScorer | None,
        reward_model: WorkerGroup | None,
        reward_model_reads_chat: bool,
    ) -> None:
        """``reward_model_reads_chat``: whether the reward model reads each conversation in
        its chat template (``RunInputs.reward_model_reads_chat``); the prompts' conversations
        are sent to it only then."""
        self.cfg = cfg
        self.reward_model_reads_chat = reward_model_reads_chat
        self.tokenizer = tokenizer
        self.stops = response_stop_ids(cfg, tokenizer)
        self.reward_fn, self.remote, self.reward_model = reward_fn, remote, reward_model
        self.dtype = score_dtype(cfg.precision)

    def score(
        self, batch: TensorDict, records: list[PromptRecord]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Each row's score, in the run's score dtype (``score_dtype``), and the reward
        metrics: its environment's last reward (multi-turn), else the weighted sum of the
        reward sources ``reward.combine`` names (``rewards.combine``). The reward model scores
        on its group while the reward function scores here."""
        if "env_score" in set(batch.keys()):
            return batch["env_score"].to(self.dtype), {}
        weights = self.cfg.reward.combine
        assert weights is not None  # resolved at load
        pending = None
        if "model" in weights:
            assert self.reward_model is not None
            # The prompts' conversations, one a prompt, for a reward model that reads them in
            # its chat template (each rank reads its rows' by uid).
            conversations = (
                [record_conversation(r) for r in records] if self.reward_model_reads_chat else None
            )
            pending = self.reward_model.call_async(
                "score",
                batch.select(*REWARD_INPUT_KEYS),
                conversations,
                dispatch="dp_split",
                collect="concat",
            )
        sources: dict[str, list[float]] = {}
        metrics: dict[str, float] = {}
        if "fn" in weights or "remote" in weights:
            texts, answers, prompts = self._decoded(batch, records)
            if "fn" in weights:
                sources["fn"] = self._score_fn(texts, answers, prompts, metrics)
            if "remote" in weights:
                assert self.remote is not None
                sources["remote"] = self.remote.score(texts, answers, prompts)
        if pending is not None:
            scored = pending.result()
            sources["model"] = scored["rm_score"].tolist()
            metrics["reward/model/truncated"] = float(scored["rm_truncated"].sum())
            metrics["perf/max_memory_allocated_gb/reward_model"] = pop_peak(scored)
        combined = combine_scores(sources, weights)
        metrics.update(combined.metrics)
        return torch.tensor(combined.scores, dtype=self.dtype), metrics

    def _score_fn(
        self, texts: list[str], answers: list[str], prompts: list[str], metrics: dict[str, float]
    ) -> list[float]:
        """The reward function's scores; with a reward that reads a final answer
        (``AnswerReward``: gsm8k, math), its counts of these responses in ``metrics`` as
        ``reward/<name>/<count>``: ``no_answer`` (those without a final answer, each scored
        0) and what it counts beside (math's ``abandoned``: verifications that outlived their
        budget). The reward's counts are over the run: a step's is their difference across
        its scoring."""
        fn = self.reward_fn
        counted = fn if isinstance(fn, AnswerReward) else None
        before = counted.counts() if counted is not None else {}
        scores = score_responses(fn, texts, answers, prompts, timeout_s=self.cfg.reward.timeout_s)
        if counted is not None:
            for what, total in counted.counts().items():
                metrics[f"reward/{counted.name}/{what}"] = float(total - before[what])
        return scores

    def _decoded(
        self, batch: TensorDict, records: list[PromptRecord]
    ) -> tuple[list[str], list[str], list[str]]:
        """What a reward function and a remote verifier score: each decoded response, and
        its record's answer and prompt (``records``: one per prompt, by ``uid``)."""
        texts = response_texts(self.tokenizer, batch, stops=self.stops)
        rows = row_records(records, batch["uid"])
        answers = [r["answer"] for r in rows]
        prompts = [r["prompt"] for r in rows]
        return texts, answers, prompts
