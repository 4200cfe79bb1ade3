"""Reward resolution (registry, config defaults, user functions by import path) and score validation."""

import sys
from pathlib import Path
from typing import Any

import pytest

from verlite.config import Config, ConfigError
from verlite.data import DataError, PromptDataset
from verlite.rewards import (
    REWARDS,
    check_answers,
    digit_match,
    exact_match,
    get_reward,
    gsm8k,
    resolve_reward,
)
from verlite.rewards.math_answer import MathReward
from verlite.rewards.rules import Gsm8kReward

USER_MODULE = """
def length_score(response, answer, prompt):
    return min(len(response) / 10, 1.0)

class Scorers:
    @staticmethod
    def always_one(response, answer, prompt):
        return 1.0

NOT_CALLABLE = 3

def two_args(response, answer):
    return 0.0

from verlite.rewards.math_answer import MathReward

strict_math = MathReward(format_credit=0.25, timeout_s=60.0)
"""


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    package = tmp_path / "userpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "scoring.py").write_text(USER_MODULE)
    (package / "broken.py").write_text("import not_a_real_dependency_xyz\n")
    (package / "raises.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [n for n in sys.modules if n.startswith("userpkg")]:
        monkeypatch.delitem(sys.modules, name)
    return "userpkg"


def _config(reward_fn: str | None = None, **data: Any) -> Config:
    return Config.model_validate({"data": data, "reward": {"fn": reward_fn}})


def test_registry() -> None:
    assert dict(REWARDS) == {
        "exact_match": exact_match,
        "gsm8k": gsm8k,
        "digit_match": digit_match,
        "math": REWARDS["math"],
    }
    assert isinstance(REWARDS["math"], MathReward)
    for name, fn in REWARDS.items():
        assert get_reward(name) is fn


def test_resolve_defaults() -> None:
    assert resolve_reward(_config(task="reverse")) is digit_match
    assert resolve_reward(_config(train_file="p.jsonl")) is exact_match
    # The rewards that count their responses without an answer: the run's own instance.
    run, other = (resolve_reward(_config("gsm8k", train_file="p.jsonl")) for _ in range(2))
    assert isinstance(run, Gsm8kReward) and run is not gsm8k and run is not other
    assert resolve_reward(_config("exact_match", task="copy")) is exact_match


@pytest.mark.parametrize("spec", ["gsm8k", "verlite.rewards.rules:gsm8k"])
def test_two_runs_count_into_their_own_rewards(spec: str) -> None:
    """A built-in counting reward named by its short name or by the import path of the
    registry's instance is each run's own: two runs in one process keep separate counts."""
    first, second = (resolve_reward(_config(spec, train_file="p.jsonl")) for _ in range(2))
    assert isinstance(first, Gsm8kReward) and isinstance(second, Gsm8kReward)
    shared_before = gsm8k.counts()
    first("no answer here", "#### 72", "")
    first("#### 72", "#### 72", "")
    second("still none", "#### 72", "")
    second("nor here", "#### 72", "")
    assert (first.counts(), second.counts()) == ({"no_answer": 1}, {"no_answer": 2})
    assert gsm8k.counts() == shared_before


def test_math_by_name_is_the_runs_own_with_its_config() -> None:
    pytest.importorskip("math_verify")
    cfg = Config.model_validate(
        {
            "data": {"train_file": "p.jsonl"},
            "reward": {"fn": "math", "math_format_credit": 0.1, "timeout_s": 8.0},
        }
    )
    run = resolve_reward(cfg)
    assert isinstance(run, MathReward) and run is not REWARDS["math"]
    assert (run.format_credit, run.budget_s) == (0.1, 4.0)


def test_a_users_own_instance_of_a_counting_reward_is_used_as_it_is(user_module: str) -> None:
    """Only the registry's shared instances are built anew for a run: a user's own instance
    of the math reward keeps its own settings (the run's reward.timeout_s and
    math_format_credit are the registry's)."""
    import userpkg.scoring

    fn = resolve_reward(_config(f"{user_module}.scoring:strict_math", task="copy"))
    assert fn is userpkg.scoring.strict_math
    assert (fn.format_credit, fn.budget_s) == (0.25, 30.0)


def test_user_function(user_module: str) -> None:
    fn = resolve_reward(_config(f"{user_module}.scoring:length_score", task="copy"))
    assert fn("12345", "", "") == 0.5
    assert get_reward(f"{user_module}.scoring:Scorers.always_one")("", "", "") == 1.0


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            "exact",
            r"reward.fn='exact': not a registered reward \(exact_match, gsm8k, digit_match, math\)",
        ),
        ("userpkg.scoring", r"nor an import path 'package.module:function'"),
        ("userpkg.scoring:f()", r"nor an import path"),
        ("os:system; rm", r"nor an import path"),
        ("nopkg_xyz.mod:fn", r"reward.fn='nopkg_xyz.mod:fn': no module named 'nopkg_xyz'"),
        ("userpkg.missing:fn", r"no module named 'userpkg.missing'"),
        (
            "userpkg.broken:fn",
            r"importing 'userpkg.broken' failed: No module named 'not_a_real_dependency_xyz'",
        ),
        ("userpkg.raises:fn", r"importing 'userpkg.raises' failed: RuntimeError: boom at import"),
        (
            "userpkg.scoring:nope",
            r"reward.fn='userpkg.scoring:nope': 'userpkg.scoring' has no attribute 'nope'",
        ),
        ("userpkg.scoring:Scorers.nope", r"'Scorers' has no attribute 'nope'"),
        # a typo is answered with the closest name, as a config key's is
        (
            "userpkg.scoring:length_scor",
            r"'userpkg.scoring' has no attribute 'length_scor'; did you mean 'length_score'\?$",
        ),
        (
            "exact_mach",
            r"nor an import path 'package.module:function'; did you mean 'exact_match'\?$",
        ),
        (
            "userpkg.scoring:NOT_CALLABLE",
            r"reward.fn='userpkg.scoring:NOT_CALLABLE' is not callable \(it is a int\)",
        ),
        ("userpkg.scoring:two_args", r"must accept \(response, answer, prompt\) positionally"),
    ],
)
def test_user_function_errors(user_module: str, spec: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        get_reward(spec)


def test_check_answers_reads_them_as_the_built_in_reward_does() -> None:
    records = ({"prompt": "q", "answer": "#### 1,234"}, {"prompt": "q", "answer": "many"})
    dataset = PromptDataset(records, name="train", where=("f.jsonl:1", "f.jsonl:2"))
    with pytest.raises(DataError, match=r"^f.jsonl:2: gsm8k reward: the answer 'many' holds no"):
        check_answers(gsm8k, [dataset])
    run = resolve_reward(_config("gsm8k", train_file="p.jsonl"))  # a run's own reads them too
    with pytest.raises(DataError, match=r"^f.jsonl:2: gsm8k reward: the answer 'many' holds no"):
        check_answers(run, [dataset])
    # Rewards that take any answer, and user functions, are not called ahead.
    check_answers(exact_match, [dataset])
    check_answers(lambda response, answer, prompt: 1.0, [dataset])


def test_a_long_check_of_the_answers_says_how_far_it_is(monkeypatch, capsys) -> None:
    """Each distinct answer is read once, the first row that holds it named on a failure; a
    reading that takes a while prints a line now and then (every one here)."""
    from verlite.rewards import registry

    monkeypatch.setattr(registry, "PROGRESS_EVERY_S", 0.0)
    answers = ["#### 1", "#### 2", "#### 1", "#### 3", "x", "x"]
    records = [{"prompt": "q", "answer": a} for a in answers]
    where = [f"f.jsonl:{i}" for i in range(1, 7)]
    with pytest.raises(DataError, match=r"^f.jsonl:5: gsm8k reward: the answer 'x'"):
        check_answers(gsm8k, [PromptDataset(records, name="train", where=where)])
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"reward.fn=gsm8k: read {n} of 4 distinct answers (0 s)" for n in (1, 2, 3)]
