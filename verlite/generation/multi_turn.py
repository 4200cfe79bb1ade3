"""Multi-turn rollouts (``rollout.multi_turn``): the policy and an environment take turns, and
the trajectory is kept as token ids from start to end.

Token in, token out: each policy turn's tokens are kept exactly as the sampler drew them,
with the log-probs it drew them with; the environment reads the turn as text (decoded
once, special tokens shown), and its observation is tokenized once and appended as tokens. The conversation is
never decoded and tokenized again as a whole, so what the trainer scores and trains on is
what the model sampled (re-tokenizing ``"4" "8"`` may give ``"48"``, a token the model
never chose). With a chat template (``verlite.data.templates.TurnFormat``) the observation's
tokens are the template's text after the policy's turn: the end of the assistant turn (what
the turn did not end with itself), the observation's turn and the next generation prompt.

The step layout is the single-turn one (``verlite.step_batch``): the prompt, then a
response area holding every turn and observation end to end, right-padded. The model reads
all of it (``attention_mask``); ``response_mask`` marks the policy's tokens only, so the
losses and advantage estimators skip observations (``verlite.core.advantages``: holes).

Each turn generates for every unfinished trajectory at once, from its whole sequence so
far (prefilled again: a turn boundary costs one prefill of the sequence), then starts the
environment step of every one of them before waiting for any, so that a worker's sessions
run their calls side by side (``verlite.envs.Session.start_step``). A trajectory
ends when the environment says it is done, the policy ends the sequence, a tool call fails,
or it runs out of turns or room (``truncated``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from tensordict import TensorDict
from transformers import PreTrainedTokenizerBase

from verlite.data import position_ids
from verlite.data.tokenizer import response_text
from verlite.generation.sampling import BUDGET_KEY, build_step_batch, mark_prompt_padding


class TurnResult(Protocol):
    """An environment's answer (``verlite.envs.Turn``)."""

    @property
    def observation(self) -> str: ...

    @property
    def reward(self) -> float: ...

    @property
    def done(self) -> bool: ...


class EnvironmentSession(Protocol):
    """One trajectory's environment (``verlite.envs.Session``)."""

    error: str | None
    timed_out: bool  # the failed call outlived its timeout and still runs

    def start_step(self, action: str) -> Callable[[], TurnResult | None]:
        """Starts the environment's answer to ``action``; the function returned waits for
        it (None after a tool error)."""
        ...

    def observation_ids(
        self, observation: str, tokenizer: PreTrainedTokenizerBase
    ) -> list[int]: ...


@dataclass(frozen=True)
class TurnLimits:
    max_turns: int
    width: int  # tokens of the response area: every turn and observation of a trajectory
    turn_tokens: int  # most tokens of one policy turn
    end_token_ids: tuple[int, ...]  # tokens that end a trajectory (EOS, rollout.stop_token_ids)
    pad_token_id: int
    turn_stop_ids: tuple[int, ...] = ()  # the token that ends a turn (rollout.multi_turn.turn_stop)
    # With a chat template (``data.chat_template``), the policy turn's end the template writes
    # before an observation, less what the turn wrote itself: ``TurnFormat.unwritten_end``.
    unwritten_end: Callable[[list[int]], list[int]] | None = None


TurnGenerator = Callable[[TensorDict, int, int], TensorDict]
"""``generate(prompts, turn, max_new_tokens)``: one turn's responses to left-padded prompts,
as the sampler's step batch (``responses``, ``response_mask``, ``rollout_log_probs``), the
noise keyed by the turn so that turns do not reuse each other's draws."""

# Per-row outcomes a multi-turn batch carries, for the trainer's score and metrics.
OUTCOMES = (
    "env_score",
    "turns",
    "cut_turns",
    "tool_calls",
    "observation_tokens",
    "truncated",
    "tool_error",
    "abandoned_call",
)


@dataclass
class _Trajectory:
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    policy: list[bool] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    active: bool = True
    env_score: float = 0.0
    turns: int = 0
    cut_turns: int = 0  # turns rollout.max_response_length cut (no stop token ended them)
    tool_calls: int = 0
    observation_tokens: int = 0
    truncated: bool = False
    tool_error: bool = False
    abandoned_call: bool = False

    def add(self, tokens: list[int], log_probs: list[float], *, policy: bool) -> None:
        self.tokens += tokens
        self.policy += [policy] * len(tokens)
        self.log_probs += log_probs


def generate_multi_turn(
    generate: TurnGenerator,
    prompts: TensorDict,
    sessions: Sequence[EnvironmentSession],
    tokenizer: PreTrainedTokenizerBase,
    limits: TurnLimits,
) -> TensorDict:
    """The trajectories of ``prompts`` (left-padded, one session each) as a step batch with
    observation holes in ``response_mask``, plus the per-row :data:`OUTCOMES`."""
    # Each batch read on the host once, not a row at a time: on a GPU every read waits for
    # the device.
    trajectories = [
        _Trajectory(prompt=[token for token, real in zip(ids, mask, strict=True) if real])
        for ids, mask in zip(
            prompts["input_ids"].tolist(), prompts["attention_mask"].tolist(), strict=True
        )
    ]
    for turn in range(limits.max_turns):
        rows = [i for i, t in enumerate(trajectories) if t.active]
        if not rows:
            break
        room = [limits.width - len(trajectories[i].tokens) for i in rows]
        turn_prompts = _left_padded(
            [trajectories[i].prompt + trajectories[i].tokens for i in rows],
            prompts[torch.tensor(rows)],
            limits.pad_token_id,
        )
        # Each row draws at most one token past its room: it says whether the turn would
        # have gone on (``truncated``), and no row runs past the positions a trajectory
        # may reach, whatever the room of the rows beside it. The turn's length leaves the
        # row with the most room its token past it too: a row's outcome must not depend on
        # whether a row with more room shares its batch.
        turn_prompts[BUDGET_KEY] = torch.tensor(room, device=turn_prompts["input_ids"].device) + 1
        out = generate(turn_prompts, turn, min(limits.turn_tokens, max(room) + 1))
        lengths = out["response_mask"].sum(-1).tolist()
        responses, log_probs = out["responses"].tolist(), out["rollout_log_probs"].tolist()
        turns = []
        stops = {*limits.end_token_ids, *limits.turn_stop_ids}
        for j, i in enumerate(rows):
            kept = min(lengths[j], room[j])
            tokens = responses[j][:kept]
            trajectories[i].add(tokens, log_probs[j][:kept], policy=True)
            trajectories[i].turns += 1
            trajectories[i].truncated |= kept < lengths[j]
            # A whole turn of the turn's limit that no stop token ended: the environment
            # reads it as the policy's turn all the same (room cuts count as ``truncated``).
            trajectories[i].cut_turns += kept == limits.turn_tokens and tokens[-1] not in stops
            turns.append(tokens)
        # Every row's step is started before any is waited for, so that the environment
        # calls of the worker's threads run side by side; the answers are taken in row order.
        answers = [
            sessions[i].start_step(response_text(tokenizer, tokens, limits.end_token_ids))
            for i, tokens in zip(rows, turns, strict=True)
        ]
        for i, tokens, answer in zip(rows, turns, answers, strict=True):
            _take_answer(trajectories[i], sessions[i], tokens, answer(), tokenizer, limits, turn)
    return _step_batch(prompts, trajectories, limits)


def _take_answer(
    trajectory: _Trajectory,
    session: EnvironmentSession,
    tokens: list[int],
    result: TurnResult | None,
    tokenizer: PreTrainedTokenizerBase,
    limits: TurnLimits,
    turn: int,
) -> None:
    """The environment's answer ``result`` to the policy's turn ``tokens``."""
    if result is None:  # the tool failed: the trajectory ends, scored 0
        trajectory.active, trajectory.env_score, trajectory.tool_error = False, 0.0, True
        trajectory.abandoned_call = session.timed_out
        return
    trajectory.env_score = result.reward
    if result.done or any(token in limits.end_token_ids for token in tokens):
        trajectory.active = False
        return
    observation = session.observation_ids(result.observation, tokenizer)
    if limits.unwritten_end is not None:
        observation = limits.unwritten_end(tokens) + observation
    # The observation and at least one more policy token must fit, and a turn must be left.
    if turn + 1 == limits.max_turns or len(trajectory.tokens) + len(observation) >= limits.width:
        trajectory.active, trajectory.truncated = False, True
        return
    trajectory.add(observation, [0.0] * len(observation), policy=False)
    trajectory.tool_calls += 1
    trajectory.observation_tokens += len(observation)


def _left_padded(sequences: list[list[int]], rows: TensorDict, pad_token_id: int) -> TensorDict:
    """Sequences as left-padded prompts, with the other per-row entries of ``rows``."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        ids[row, width - len(sequence) :] = torch.tensor(sequence)
        mask[row, width - len(sequence) :] = 1
    td = rows.exclude("input_ids", "attention_mask", "position_ids")
    td["input_ids"] = ids.to(rows.device)
    td["attention_mask"] = mask.to(rows.device)
    td["position_ids"] = position_ids(mask).to(rows.device)
    return mark_prompt_padding(td, padded=min(map(len, sequences)) < width)


def _step_batch(
    prompts: TensorDict, trajectories: list[_Trajectory], limits: TurnLimits
) -> TensorDict:
    rows, width = len(trajectories), limits.width
    responses = torch.full((rows, width), limits.pad_token_id, dtype=torch.long)
    real = torch.zeros((rows, width), dtype=prompts["attention_mask"].dtype)
    policy = torch.zeros_like(real)
    log_probs = torch.zeros((rows, width), dtype=torch.float32)
    for row, t in enumerate(trajectories):
        n = len(t.tokens)
        responses[row, :n] = torch.tensor(t.tokens, dtype=torch.long)
        real[row, :n] = 1
        policy[row, :n] = torch.tensor(t.policy, dtype=real.dtype)
        log_probs[row, :n] = torch.tensor(t.log_probs, dtype=torch.float32)
    device = prompts["input_ids"].device
    td = build_step_batch(
        prompts, responses.to(device), real.to(device), log_probs.to(device), policy.to(device)
    )
    for name in OUTCOMES:  # float64: an environment's reward whole, until the scorer's dtype
        values = [float(getattr(t, name)) for t in trajectories]
        td[name] = torch.tensor(values, dtype=torch.float64, device=device)
    return td
