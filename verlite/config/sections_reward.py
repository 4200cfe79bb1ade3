"""The ``reward`` section: the reward function, a remote verifier (its URL checked for
credentials, its token named by an environment variable), a reward model, and how their
scores combine."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import AfterValidator, BeforeValidator, Field, model_validator

from verlite.config.defaults import as_dict
from verlite.config.fields import (
    Needs,
    NonEmptyStr,
    PathStr,
    PositiveInt,
    Seconds,
    Section,
    fields_but,
)
from verlite.errors import shown
from verlite.reachable import is_loopback_host
from verlite.redaction import MASK, redact_url, secret_query_names


def _service_url(value: str | None) -> str | None:
    # The message starts with the field name so that config loading prints it as it is: the
    # URL without user:password@ or its query, never a credential it would otherwise echo.
    if value is None:
        return None
    parts = urlsplit(value)
    where = f"reward.remote.url={shown(redact_url(re.split(r'[?#]', value)[0]))}"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{where}: must be an http:// or https:// URL with a host")
    secret_names = secret_query_names(value)
    if "@" in parts.netloc or secret_names:
        held = (
            f"?{'&'.join(f'{name}={MASK}' for name in secret_names)}"
            if secret_names
            else "user:password@"
        )
        raise ValueError(
            f"{where}: must not hold credentials ({held}); name an environment variable "
            "that holds the token in reward.remote.auth_env instead"
        )
    try:
        parts.port  # noqa: B018 (it raises on a port that is not a number in range)
    except ValueError:
        raise ValueError(f"{where}: the port must be a number from 0 to 65535") from None
    return value


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# The least reward.timeout_s of reward.fn=math (verlite.rewards.math_answer).
MATH_MIN_TIMEOUT_S = 2.0


def _environment_name(value: str | None) -> str | None:
    # The value is not shown: what is not a variable's name may be the token itself.
    if value is not None and not _ENV_NAME.fullmatch(value):
        raise ValueError(
            "reward.remote.auth_env must be the name of an environment variable (letters, "
            "digits, '_'; not a digit first) that holds the token, never the token itself"
        )
    return value


def _auto_or_bool(value: Any) -> Any:
    # One line naming what is allowed, for the union's two lines of pydantic's words.
    if isinstance(value, bool) or value == "auto":
        return value
    raise ValueError(f"reward.model.chat_template={shown(value)}: allowed: auto, true, false")


# The longest wait between two retries of a remote verifier's request (10 minutes): the
# doubling stops there, so the waits of many retries stay waits a service can come back in.
MAX_RETRY_WAIT_S = 600.0


class RemoteRewardConfig(Section):
    """A remote verifier: a user's HTTP service that scores batches of responses
    (docs/reward-models-and-verifiers.md; the protocol is in verlite/rewards/remote.py)."""

    url: Annotated[str | None, AfterValidator(_service_url)] = Field(
        None,
        description="http(s) URL the responses are POSTed to, as JSON batches; its scores are "
        "the reward source 'remote' of reward.combine (not with rollout.multi_turn.env). None: "
        "no remote verifier. "
        "Probed with one request of one response before Ray starts.",
    )
    batch_size: PositiveInt = Field(64, description="Responses per request.")
    concurrency: Annotated[int, Field(gt=0, le=256)] = Field(
        4, description="Requests in flight at once."
    )
    timeout_s: Seconds = Field(
        30.0,
        description="Most seconds one request may take, from connecting to the end of its "
        "reply (at most a day); a slower one is retried.",
    )
    max_retries: Annotated[int, Field(ge=0, le=100)] = Field(
        3,
        description="Retries of a request that failed in a way a retry can mend (no "
        "connection, a timeout, HTTP 5xx or 429); then the run stops naming the batch. A "
        "malformed reply, another 4xx or a score outside [0, 1] stops it at once.",
    )
    retry_backoff_s: float = Field(
        1.0,
        ge=0.0,
        le=MAX_RETRY_WAIT_S,
        description="Wait before the first retry of a request; it doubles with each retry, "
        f"up to {MAX_RETRY_WAIT_S:g} s.",
    )
    auth_env: Annotated[str | None, AfterValidator(_environment_name)] = Field(
        None,
        description="Name of the environment variable that holds a bearer token for the "
        "service (sent as 'Authorization: Bearer ...'; never logged). None sends none. Over "
        "plain http only to a service on this machine (loopback).",
    )

    @model_validator(mode="after")
    def _token_not_in_cleartext(self) -> RemoteRewardConfig:
        if self.auth_env is None or self.url is None:
            return self
        parts = urlsplit(self.url)
        if parts.scheme == "http" and not is_loopback_host(parts.hostname or ""):
            raise ValueError(
                f"reward.remote.auth_env={self.auth_env!r} with an http:// URL to "
                f"{parts.hostname}: the token would cross the network in cleartext; use https "
                "(plain http is for a service on this machine: 127.0.0.1, localhost)"
            )
        return self


class RewardModelConfig(Section):
    """A reward model: a Hugging Face sequence-classification model scored by a worker group
    of its own (role ``reward``), placed like the critic."""

    path: PathStr | None = Field(
        None,
        description="Local Hugging Face sequence-classification model directory (weights, "
        "config.json with one label, its own tokenizer); it reads prompt + response as text "
        "and scores sigmoid(logit). None: no reward model.",
    )
    workers_per_node: PositiveInt | None = Field(
        None,
        description="Reward-model workers on each node (over trainer.nnodes nodes; CPUs and "
        "GPUs per worker as trainer's, shared with roles of the same count under "
        "trainer.placement=colocate); None uses trainer.workers_per_node.",
    )
    micro_batch_size_per_worker: PositiveInt = Field(
        16, description="Responses one reward-model worker scores per forward pass."
    )
    max_length: PositiveInt | None = Field(
        None,
        description="Most reward-model tokens of one prompt + response; a longer text keeps its "
        "last tokens (the response's end, which the score is read at; reward/model/truncated "
        "counts them). None: the model's max_position_embeddings.",
    )
    chat_template: Annotated[bool | Literal["auto"], BeforeValidator(_auto_or_bool)] = Field(
        "auto",
        description="Whether the reward model reads each conversation in its tokenizer's own "
        "chat template: the prompt's messages as the policy read them (data.system_prompt's "
        "turn, data.prompt_suffix included; the prompt text as the user's turn without "
        "data.chat_template), then the response as the assistant's turn, rendered and "
        "tokenized as written (no special tokens added). false: the prompt as the policy "
        "read it, decoded without special tokens, then the response, as plain text. auto: "
        "true when reward.model.path's tokenizer has a chat template; true with one that has "
        "none is refused.",
    )


class RewardConfig(Section):
    """How responses are scored: every reward, built-in or user, returns a finite score in [0, 1]."""

    fn: NonEmptyStr | None = Field(
        None,
        description="A registered reward name (exact_match, gsm8k, digit_match, or math: "
        "math-verify's equivalence of final answers, the extra 'math', docs/math-verifier.md) "
        "or 'package.module:function'; None uses the task's reward (exact match of the answer "
        "for prompt files).",
    )
    timeout_s: Seconds = Field(
        30.0,
        description="Longest one call of the reward function may take (at most a day, in "
        "seconds); a slower call stops the "
        "run with an error naming the response. reward.fn=math (at least 2 s) gives one "
        "verification half of it and scores a slower one 0.",
    )
    math_format_credit: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="With reward.fn=math: the score of a response whose final answer reads as "
        "an expression but is not equivalent to the reference (a format-only partial credit); "
        "0 gives none.",
    )
    remote: RemoteRewardConfig = Field(
        default_factory=RemoteRewardConfig,
        description="A remote verifier: a user's HTTP service that scores the responses.",
    )
    model: RewardModelConfig = Field(
        default_factory=RewardModelConfig,
        description="A reward model scored by a worker group of its own.",
    )
    combine: dict[str, float] | None = Field(
        None,
        description="The step's score as a weighted sum of reward sources, e.g. {fn: 0.5, model: "
        "0.5}: fn (the rule-based reward: reward.fn or the task's), model (reward.model) and "
        "remote (reward.remote), each of the last two named when set; weights >= 0, not all 0; "
        "a source of weight 0 is scored and logged (reward/<source>/mean) without counting. "
        "None: the one of model and remote that is set, with weight 1, else {fn: 1}.",
    )

    @model_validator(mode="before")
    @classmethod
    def _default_combine(cls, data: Any) -> Any:
        """An unset ``combine`` is resolved at load: the reward model alone when one is set."""
        if not isinstance(data, Mapping):
            return data
        combine = data.get("combine")
        if combine is not None:
            return data
        model, remote = as_dict(data.get("model")), as_dict(data.get("remote"))
        chosen = [
            source
            for source, section, key in (("model", model, "path"), ("remote", remote, "url"))
            if isinstance(section, dict) and section.get(key) is not None
        ]
        if len(chosen) > 1:
            return data  # the after-validator asks for combine
        return {**data, "combine": {chosen[0] if chosen else "fn": 1.0}}

    @property
    def sources(self) -> tuple[str, ...]:
        """The reward sources this config sets up: what ``combine`` may weigh."""
        return (
            "fn",
            *(("model",) if self.model.path is not None else ()),
            *(("remote",) if self.remote.url is not None else ()),
        )

    @model_validator(mode="after")
    def _check_math(self) -> RewardConfig:
        if self.math_format_credit != 0.0 and self.fn != "math":
            raise ValueError(
                f"reward.math_format_credit={self.math_format_credit:g} is the math reward's: "
                "it needs reward.fn=math ("
                + ("reward.fn is not set" if self.fn is None else f"reward.fn={self.fn!r}")
                + "); set it or unset the credit"
            )
        if self.fn == "math" and self.timeout_s < MATH_MIN_TIMEOUT_S:
            raise ValueError(
                f"reward.timeout_s={self.timeout_s:g} with reward.fn=math: a verification gets "
                "half of it, which must hold the start of math-verify's process (up to a "
                f"second); give at least {MATH_MIN_TIMEOUT_S:g}"
            )
        return self

    @model_validator(mode="after")
    def _check_combine(self) -> RewardConfig:
        if self.combine is None:  # left unset with both a reward model and a remote verifier
            raise ValueError(
                "reward.model.path and reward.remote.url are both set: give reward.combine, "
                "e.g. {model: 0.5, remote: 0.5}"
            )
        unset_field = {"model": "reward.model.path", "remote": "reward.remote.url"}
        for source, weight in self.combine.items():
            if source not in self.sources:
                unset = f" ({unset_field[source]} is unset)" if source in unset_field else ""
                raise ValueError(
                    f"reward.combine.{source}: not a configured reward source{unset}; "
                    f"configured: {', '.join(self.sources)}"
                )
            if weight < 0:
                raise ValueError(f"reward.combine.{source}={weight:g}: weights must be >= 0")
        for source in self.sources[1:]:
            if source not in self.combine:
                raise ValueError(
                    f"reward.combine={self.combine} leaves out {source}, but "
                    f"{unset_field[source]} is set: it would be set up for nothing; add "
                    f"{source} (weight 0 only logs it) or unset {unset_field[source]}"
                )
        if self.fn is not None and "fn" not in self.combine:
            raise ValueError(
                f"reward.fn={self.fn!r} is set, but reward.combine={self.combine} leaves out fn: "
                "it would score nothing; add fn to reward.combine or unset reward.fn"
            )
        if not any(self.combine.values()):
            raise ValueError(
                f"reward.combine={self.combine}: no source has a weight > 0; give at least one"
            )
        return self


# Settings of this section that only a feature makes count (verlite.config.inert).
NEEDS = (
    Needs(
        fields_but(RemoteRewardConfig, "reward.remote", "url"),
        unless="reward.remote.url is set",
        active=lambda cfg: cfg.reward.remote.url is not None,
        example={"reward.remote.url": "http://127.0.0.1:8000/score"},
    ),
    Needs(
        fields_but(RewardModelConfig, "reward.model", "path"),
        unless="reward.model.path is set",
        active=lambda cfg: cfg.reward.model.path is not None,
        example={"reward.model.path": "reward_model"},
    ),
)
