"""Reward functions by name: the built-in registry, user functions by import path, and the
run's reward."""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Iterable
from typing import cast

from verlite.config import Config, ConfigError
from verlite.data import DataError, PromptDataset
from verlite.data.tasks import TASKS
from verlite.rewards.answer_reward import AnswerReward
from verlite.rewards.math_answer import MathReward, check_installed
from verlite.rewards.rules import Gsm8kReward, digit_match, exact_match, gsm8k
from verlite.user_code import load_object

# Seconds between the progress lines of a long start-up reading of the answers.
PROGRESS_EVERY_S = 10.0

RewardFn = Callable[[str, str, str], float]
"""``fn(response, answer, prompt) -> score`` in [0, 1], called positionally."""

# The registry's math reward: math-verify's equivalence (the extra ``math``), with
# reward.math_format_credit=0 and the default reward.timeout_s.
_MATH = MathReward()

REWARDS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    # The two that read a final answer (AnswerReward) count their responses without one: a
    # run builds its own (resolve_reward).
    "gsm8k": gsm8k,
    "digit_match": digit_match,
    "math": _MATH,
}


def _math_reward(cfg: Config) -> MathReward:
    check_installed()
    return MathReward(format_credit=cfg.reward.math_format_credit, timeout_s=cfg.reward.timeout_s)


# How a run builds its own instance of each built-in counting reward, from the shared one
# that reward.fn names (by a registered name or an import path alike: the same object). An
# instance of the user's own, of these classes or not, is the user's, used as it is.
RUN_INSTANCES: tuple[tuple[AnswerReward, Callable[[Config], AnswerReward]], ...] = (
    (gsm8k, lambda cfg: Gsm8kReward()),
    (_MATH, _math_reward),
)


def resolve_reward(cfg: Config) -> RewardFn:
    """``reward.fn`` when set; else the task's reward (digit_match) or exact_match for prompt
    files. A built-in reward that counts (``AnswerReward``), however ``reward.fn`` names it,
    is the run's own instance, built from its config (:data:`RUN_INSTANCES`), so that its
    counts are of this run's calls alone."""
    if cfg.reward.fn is not None:
        name = cfg.reward.fn
    else:
        name = TASKS[cfg.data.task].reward if cfg.data.task is not None else "exact_match"
    fn = get_reward(name)
    build = next((build for shared, build in RUN_INSTANCES if fn is shared), None)
    return fn if build is None else build(cfg)


def check_answers(fn: RewardFn, datasets: Iterable[PromptDataset]) -> None:
    """Every record's answer read as the built-in reward ``fn`` reads it (gsm8k's number,
    math's final answer, which math-verify must read), before the run starts: a record ``fn``
    cannot score against stops the run here, naming its file and row, instead of at the step
    that first draws it (validation's: the first validation). User functions are not called
    ahead."""
    found = _reference_check(fn)
    if found is None:
        return
    name, check = found
    # Each answer once, where it first occurs (math-verify took 1-2 ms a reading on a 2-core
    # machine: MATH's 12,500 answers would take 12-25 s, so a line every PROGRESS_EVERY_S).
    first: dict[str, str] = {}
    for dataset in datasets:
        for location, record in zip(dataset.where, dataset.records, strict=True):
            first.setdefault(record["answer"], location)
    started = shown = time.monotonic()
    for done, (answer, location) in enumerate(first.items(), 1):
        try:
            check(answer)
        except ValueError as exc:
            raise DataError(f"{location}: {exc} (reward.fn={name})") from None
        now = time.monotonic()
        if now - shown >= PROGRESS_EVERY_S and done < len(first):
            print(
                f"reward.fn={name}: read {done:,} of {len(first):,} distinct answers "
                f"({now - started:.0f} s)",
                flush=True,
            )
            shown = now


def _reference_check(fn: RewardFn) -> tuple[str, Callable[[str], object]] | None:
    """The name of the built-in reward ``fn`` and how it reads a record's answer, raising
    ValueError where it cannot; None for a reward that takes any answer."""
    if isinstance(fn, AnswerReward):
        return fn.name, fn.check_reference
    return None


def get_reward(spec: str) -> RewardFn:
    """A registered reward by name, or a user function by ``"package.module:function"``.

    Only the module named in ``spec`` is imported (``importlib``, never ``eval``).
    """
    if spec in REWARDS:
        return REWARDS[spec]
    target = load_object(
        spec,
        field="reward.fn",
        what="reward",
        example="package.module:function",
        registered=REWARDS,
    )
    if not callable(target):
        raise ConfigError(f"reward.fn={spec!r} is not callable (it is a {type(target).__name__})")
    _check_signature(spec, target)
    return cast(RewardFn, target)


def _check_signature(spec: str, fn: Callable[..., object]) -> None:
    # Fail at start-up, not after the first rollout, when the function cannot take the 3 arguments.
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have no introspectable signature
        return
    try:
        signature.bind("response", "answer", "prompt")
    except TypeError as exc:
        raise ConfigError(
            f"reward.fn={spec!r} must accept (response, answer, prompt) positionally: {exc}"
        ) from None


def reward_name(fn: Callable[..., object]) -> str:
    """How messages name a reward function: ``module:qualname``."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    return f"{module}:{qualname}" if module and qualname else repr(fn)
