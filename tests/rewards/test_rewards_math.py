"""The math reward (reward.fn=math): final answers found, equivalence by math-verify in a
process of its own, a bounded cost for huge and adversarial responses, the extra's absence
refused at start-up, and the driver's scoring of a step with it."""

import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from scorer_support import byte_tokenizer, fn_scorer, step_batch

from verlite.config import Config
from verlite.config.fields import MAX_SECONDS
from verlite.data import answers
from verlite.rewards import RewardError, math_answer, resolve_reward, score_responses
from verlite.rewards.math_answer import MathReward, final_answer, reference_answer

TIMEOUT_S = 6.0  # reward.timeout_s: a verification gets half of it
# Power towers: sympy takes far longer than the budget to compare them with a number.
ADVERSARIAL = [r"\boxed{9^{9^{9^{9}}}}", r"\boxed{(10^{100})!}", r"\boxed{100!!!}"]


def _config(**reward: Any) -> Config:
    return Config.model_validate({"data": {"train_file": "p.jsonl"}, "reward": reward})


@pytest.fixture(scope="module")
def math_reward() -> Iterator[MathReward]:
    reward = MathReward(format_credit=0.25, timeout_s=TIMEOUT_S, stream=io.StringIO())
    yield reward
    reward.close()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"so the answer is \boxed{72}.", "72"),
        (r"\boxed{1} then \boxed{ 2 }", "2"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{\boxed{1} + 2}", r"\boxed{1} + 2"),  # the box that closes last
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),  # escaped braces are not structure
        (r"\boxed{7} and a cut-off \boxed{\frac{1}{2}", "7"),  # the last one that balances
        ("Natalia sold 48/2 = 24 clips.\n#### 72\nthanks", "72"),
        ("#### 1\n#### 2", "2"),
        (r"#### 5 but \boxed{6}", "6"),  # a box first
        (r"\boxed{}", None),
        ("####   \n", None),
        ("the answer is 72", None),  # no other form is read
        (r"\boxed{" + "1" * 1001 + "}", None),  # longer than MAX_ANSWER_CHARS
    ],
)
def test_the_final_answer_is_the_last_balanced_box_else_the_last_mark(
    text: str, expected: str | None
) -> None:
    assert final_answer(text) == expected


def test_a_reference_without_a_marked_answer_is_taken_whole() -> None:
    assert reference_answer(" 72 ") == "72"
    assert reference_answer("Half of 144.\n#### 72") == "72"
    assert reference_answer(r"So $x = \boxed{\frac{1}{2}}$.") == r"\frac{1}{2}"
    with pytest.raises(ValueError, match=r"the reference answer '  ' is empty"):
        reference_answer("  ")


@pytest.mark.parametrize(
    ("response", "answer", "score"),
    [
        (r"\boxed{0.5}", "1/2", 1.0),
        (r"\boxed{1/2}", r"\frac{1}{2}", 1.0),
        (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
        ("#### 72", "72", 1.0),
        (r"\boxed{72.0}", "72", 1.0),
        ("#### 72", r"\boxed{72}", 1.0),
        (r"\boxed{\$1,234}", "1234", 1.0),
        (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}", 1.0),
        ("Half of 144 is\n#### 72", "Natalia sold 72 clips.\n#### 72", 1.0),
        (r"\boxed{73}", "72", 0.25),  # read, wrong: the format credit
        (r"\boxed{x + 1}", "72", 0.25),
        (r"\boxed{)(}", "72", 0.0),  # not an expression: no credit
        ("72", "72", 0.0),  # no final answer
        ("", "72", 0.0),
    ],
)
def test_scores(math_reward: MathReward, response: str, answer: str, score: float) -> None:
    assert math_reward(response, answer, "a prompt") == score


def test_no_format_credit_by_default() -> None:
    fn = resolve_reward(_config(fn="math"))
    try:
        assert isinstance(fn, MathReward)
        assert fn.format_credit == 0.0 and fn.budget_s == 15.0  # half the default timeout_s
        assert fn(r"\boxed{73}", "72", "") == 0.0
    finally:
        fn.close()


def test_a_reference_math_verify_cannot_read_stops_in_one_line(math_reward: MathReward) -> None:
    with pytest.raises(RewardError, match=r"raised on response 0 .*cannot read the reference"):
        score_responses(math_reward, [r"\boxed{1}"], ["}"], [""], timeout_s=TIMEOUT_S)


def test_a_reference_math_verify_cannot_read_is_refused_before_the_run(
    verlite_main: Any, tmp_path: Path
) -> None:
    # "$$" has no box and no "####": taken whole, math-verify reads nothing in it. Found by a
    # response that has a final answer, it stopped the run mid-way; now the run is refused
    # before Ray starts, naming the file, the row and the answer.
    path = tmp_path / "p.jsonl"
    rows = [{"prompt": f"{i}+{i}=", "answer": f"#### {2 * i}"} for i in range(70)]
    rows[5]["answer"] = "$$"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = verlite_main(
        "train",
        "--config",
        "configs/ppo_tiny.yaml",
        "data.task=null",
        f"data.train_file={path}",
        "data.num_val_samples=2",
        "reward.fn=math",
        f"trainer.output_dir={tmp_path / 'run'}",
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr == (
        f"verlite: error: {path}:6: math reward: math-verify cannot read the reference answer "
        "'$$'; write it as a number or a LaTeX expression (reward.fn=math)\n"
    )


def test_a_reference_is_checked_in_the_verifier_process_within_its_budget() -> None:
    reward = MathReward(timeout_s=TIMEOUT_S)
    try:
        reward.check_reference("Half of 144.\n#### 72")
        with pytest.raises(ValueError, match=r"cannot read the reference answer '\}'"):
            reward.check_reference("}")
        assert reward(r"\boxed{72}", "72", "") == 1.0  # the same process scores on
    finally:
        reward.close()
    # A budget the process cannot start in: an error that says so (not the answer's doing),
    # not a response scored 0 and counted.
    out = io.StringIO()
    hurried = MathReward(timeout_s=0.02, stream=out)
    with pytest.raises(ValueError, match=r"process did not start within 0.01 s .* raise reward"):
        hurried.check_reference("72")
    assert hurried.abandoned == 0 and out.getvalue() == "" and hurried._process is None


def test_huge_responses_cost_one_pass_and_never_reach_math_verify(
    math_reward: MathReward, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Counted, not timed: each response's braces are read once, and a megabyte that holds no
    # answer short enough is no answer, never a verification that could be abandoned.
    megabyte = 2**20
    responses = [
        "x " * (megabyte // 2) + r"\boxed{72}",
        "{" * megabyte,
        r"\boxed{" * (megabyte // 7),
        r"\boxed{" + "1+" * (megabyte // 2) + "1}",  # too long to be an answer
    ]
    braces = answers._BRACES
    read: list[str] = []

    class Counted:
        def finditer(self, text: str) -> Iterator[re.Match[str]]:
            for match in braces.finditer(text):
                read.append(match.group())
                yield match

    monkeypatch.setattr(answers, "_BRACES", Counted())
    before = math_reward.counts()
    scores = score_responses(
        math_reward, responses, ["72"] * 4, [""] * 4, timeout_s=TIMEOUT_S, stream=io.StringIO()
    )
    assert scores == [1.0, 0.0, 0.0, 0.0]
    assert len(read) == sum(len(braces.findall(text)) for text in responses)
    assert math_reward.counts() == {
        "abandoned": before["abandoned"],
        "no_answer": before["no_answer"] + 3,
    }


def test_adversarial_answers_are_abandoned_within_the_budget_and_counted() -> None:
    out = io.StringIO()
    reward = MathReward(format_credit=0.25, timeout_s=TIMEOUT_S, stream=out)
    try:
        reward(r"\boxed{1}", "1", "")  # started: the budget below is the verification's
        scores = score_responses(
            reward,
            [*ADVERSARIAL, r"\boxed{2}"],
            ["1"] * 4,
            [""] * 4,
            timeout_s=TIMEOUT_S,  # the run's bound, never reached
            stream=out,
        )
    finally:
        reward.close()
    assert scores == [0.0, 0.0, 0.0, 0.25]  # the last one after a restart, verified
    # Three verifications abandoned at their budget (none reached the run's bound, which
    # would have stopped scoring), each process killed and the next started anew.
    assert reward.abandoned == 3
    lines = out.getvalue().splitlines()
    assert lines[0] == (
        "reward: math: math-verify did not answer within 3 s (half of reward.timeout_s) on the "
        "answer '9^{9^{9^{9}}}'; scored 0 and its process restarted (1 so far)"
    )
    assert lines[2].endswith("(3 so far)")


# A driver that starts a verification that never ends in time, then is killed outright.
KILLED_DRIVER = """
import os, signal, threading, time
from verlite.rewards.math_answer import MathReward
reward = MathReward(timeout_s=2.0)
reward._start(time.monotonic() + 60)  # its start not held to the 1 s budget on a loaded machine
print(reward._process.pid, flush=True)
threading.Thread(target=reward, args=(r"\\boxed{9^{9^{9^{9}}}}", "1", ""), daemon=True).start()
time.sleep(0.5)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has ended (whoever adopted it may not reap it)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_verification_orphaned_by_its_killed_driver_ends_within_its_cpu_budget() -> None:
    # The orphan computed on at 100% CPU for as long as the answer asked (minutes here).
    # Not stderr: the verifier inherits it, and an orphan holding it open would hold this.
    driver = subprocess.run(
        [sys.executable, "-c", KILLED_DRIVER],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        timeout=60,
    )
    assert driver.returncode == -signal.SIGKILL
    worker = int(driver.stdout.split()[0])
    # Its limit is 3 s of CPU time (twice the 1 s budget, and one); the wait only guards
    # against a hang, loosely: a loaded machine gives it a share of a core.
    deadline = time.monotonic() + 60
    while _running(worker) and time.monotonic() < deadline:
        time.sleep(0.2)
    running = _running(worker)
    if running:
        os.kill(worker, signal.SIGKILL)
    assert not running


@pytest.mark.parametrize(
    ("worker", "message"),
    [
        (
            'print(json.dumps({"ready": True}), flush=True); sys.stdin.readline(); sys.exit(3)',
            r"math reward: the math-verify process exited \(code 3\)",
        ),
        ("print(json.dumps({'hello': 1}), flush=True)", r"said \{'hello': 1\} at start"),
    ],
    ids=["crashed", "no greeting"],
)
def test_a_verifier_process_that_breaks_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, worker: str, message: str
) -> None:
    script = tmp_path / "worker.py"
    script.write_text(f"import json, sys\n{worker}\n")
    monkeypatch.setattr(math_answer, "_WORKER", script)
    reward = MathReward(timeout_s=TIMEOUT_S)
    try:
        with pytest.raises(RuntimeError, match=message):
            reward(r"\boxed{1}", "1", "")
        assert reward._process is None  # the next call starts a new one
    finally:
        reward.close()


def test_without_the_extra_the_run_is_refused_in_one_line(
    verlite_main: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "math_verify", None)  # not installed: import fails
    result = verlite_main("train", "--config", "configs/ppo_tiny.yaml", "reward.fn=math")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1
    assert "reward.fn=math needs the 'math_verify' package" in result.stderr
    assert result.stderr.endswith(
        "install it with: pip install 'math-verify>=0.7' (verlite's 'math' extra)\n"
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["reward.math_format_credit=0.5"],
            "reward.math_format_credit=0.5 is the math reward's: it needs reward.fn=math "
            "(reward.fn is not set)",
        ),
        (
            ["reward.fn=math", "reward.math_format_credit=1"],
            "reward.math_format_credit=1: Input should be less than 1",
        ),
        (
            ["reward.fn=math", "reward.timeout_s=1.5"],
            "reward.timeout_s=1.5 with reward.fn=math: a verification gets half of it, which must "
            "hold the start of math-verify's process (up to a second); give at least 2",
        ),
    ],
)
def test_math_setting_errors_are_one_line(
    verlite_main: Any, overrides: list[str], message: str
) -> None:
    result = verlite_main("train", "--config", "configs/ppo_tiny.yaml", *overrides)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and message in result.stderr


def test_the_driver_scores_a_step_with_it() -> None:
    cfg = _config(fn="math", math_format_credit=0.25, timeout_s=TIMEOUT_S)
    tokenizer = byte_tokenizer()
    texts = [r"so \boxed{0.5}", "#### 72.0", r"\boxed{71}", "72", r"\frac{1}{2}"]
    batch = step_batch(tokenizer, texts, [0, 1, 1, 1, 0])
    records = [
        {"prompt": "Half of 1?", "answer": r"\frac{1}{2}"},
        {"prompt": "Clips?", "answer": "48 + 24 = 72\n#### 72"},
    ]
    reward_fn = resolve_reward(cfg)
    scorer = fn_scorer(cfg, tokenizer, reward_fn)
    try:
        scores, metrics = scorer.score(batch, records)
    finally:
        reward_fn.close()  # type: ignore[attr-defined]
    assert scores.tolist() == [1.0, 1.0, 0.25, 0.0, 0.0]
    # "72" and "\frac{1}{2}" have no final answer (no \boxed{}, no ####): 0, and counted.
    assert metrics == {
        "reward/fn/mean": pytest.approx(2.25 / 5),
        "reward/math/abandoned": 0.0,
        "reward/math/no_answer": 2.0,
    }


def test_a_step_counts_its_responses_without_a_final_answer() -> None:
    """A model that never writes the form the prompt asks for scores 0 on every response: the
    step says how many of them had no answer to verify (a silent 0 is never without a
    count), the step's own count, not the run's."""
    cfg = _config(fn="math", timeout_s=TIMEOUT_S)
    tokenizer = byte_tokenizer()
    records = [{"prompt": "One?", "answer": "#### 1"}]
    reward_fn = resolve_reward(cfg)
    scorer = fn_scorer(cfg, tokenizer, reward_fn)
    try:
        steps = [
            scorer.score(step_batch(tokenizer, texts, [0] * len(texts)), records)
            for texts in (["1", "72", r"\boxed{2}"], [r"\boxed{1}", "#### 1"])
        ]
    finally:
        reward_fn.close()  # type: ignore[attr-defined]
    assert [scores.tolist() for scores, _ in steps] == [[0.0, 0.0, 0.0], [1.0, 1.0]]
    assert [metrics["reward/math/no_answer"] for _, metrics in steps] == [2.0, 0.0]


def test_a_step_counts_its_abandoned_verifications() -> None:
    # A silent 0 is never without a count: reward/math/abandoned is the step's own, not the run's.
    cfg = _config(fn="math", timeout_s=TIMEOUT_S)
    tokenizer = byte_tokenizer()
    records = [{"prompt": "One?", "answer": "1"}]
    reward_fn = resolve_reward(cfg)
    scorer = fn_scorer(cfg, tokenizer, reward_fn)
    try:
        steps = [
            scorer.score(step_batch(tokenizer, texts, [0] * len(texts)), records)
            for texts in ([ADVERSARIAL[0], r"\boxed{1}"], [r"\boxed{1}"])
        ]
    finally:
        reward_fn.close()  # type: ignore[attr-defined]
    assert [scores.tolist() for scores, _ in steps] == [[0.0, 1.0], [1.0]]
    assert [metrics["reward/math/abandoned"] for _, metrics in steps] == [1.0, 0.0]


def test_the_longest_timeout_accepted_verifies() -> None:
    """reward.timeout_s=5e6 (accepted then) gave the verifier a budget its select could not
    wait (``OverflowError: timeout is too large``); the longest now accepted verifies (the
    refusal above it: tests/rewards/test_rewards_remote.py)."""
    reward = MathReward(timeout_s=MAX_SECONDS)
    try:
        assert reward(r"so \boxed{2}", "2", "1+1=") == 1.0
    finally:
        reward.close()
