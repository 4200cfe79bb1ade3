"""Environments (``rollout.multi_turn.env``): the built-in lookup tool task, user classes by
import path, and the checked, time-bounded calls of a trajectory's session: a tool that
raises or hangs ends its trajectory with a recorded error, and a worker holding more such
calls still running than its limit stops the run; an environment that breaks its contract
(an observation the tokenizer cannot encode included) stops the run in one line naming it
and the prompt."""

import random
import sqlite3
import sys
import threading
import time
from typing import ClassVar

import pytest
from chat_model_support import chat_tokenizer, metaspace_tokenizer

from verlite.config import ConfigError, load_config
from verlite.data.dataset import build_datasets
from verlite.data.tasks import TASKS
from verlite.data.tokenizer import build_task_tokenizer
from verlite.envs.base import Turn
from verlite.envs.lookup import Lookup, LookupWithoutTool, digits_in_place
from verlite.envs.registry import get_environment
from verlite.envs.session import (
    AbandonedCalls,
    EnvironmentBroken,
    Session,
    SessionThreads,
    ToolsStuck,
    _Call,
    _Thread,
    open_sessions,
)

RECORD = {"prompt": "37>", "answer": "4821"}


def session(
    cls: type,
    timeout_s: float = 5.0,
    abandoned: AbandonedCalls | None = None,
    threads: SessionThreads | None = None,
    record: dict[str, str] = RECORD,
) -> Session:
    if threads is None:
        threads = SessionThreads(32, AbandonedCalls(limit=32) if abandoned is None else abandoned)
    return open_sessions(cls, [record], indices=[7], timeout_s=timeout_s, threads=threads)[0]


def test_the_lookup_tool_answers_its_key_and_scores_the_final_answer() -> None:
    s = session(Lookup)
    assert s.start_step("99+")() == Turn("=", 0.0, False)  # a key it does not hold
    assert s.start_step("37+")() == Turn("=4821", 0.2, False)  # found: the lookup's credit
    assert s.start_step("4821")() == Turn("", 1.0, True)
    called = session(Lookup)
    assert called.start_step("+")() == Turn("=4821", 0.2, False)  # no key: the prompt's
    assert called.start_step("4800")() == Turn("", pytest.approx(0.2 + 0.8 * 0.5), True)
    assert session(Lookup).start_step("4821")() == Turn("", 0.8, True)  # a lucky guess, no lookup
    assert digits_in_place("48210", "4821") == 0.8  # no credit for a wrong length


@pytest.mark.parametrize(
    "overrides",
    [
        [
            "data.chat_template=true",
            "model.path=/models/chat",
            "data.system_prompt=look it up.",
            "data.max_prompt_length=64",
            "rollout.multi_turn.max_total_length=128",
        ],
        [
            "data.prompt_suffix=look it up.",
            "data.max_prompt_length=32",
            "rollout.multi_turn.max_total_length=64",
        ],
    ],
    ids=["chat_template", "prompt_suffix"],
)
def test_the_lookup_tool_answers_the_key_of_a_prompt_rendered_or_with_a_suffix(
    overrides: list[str],
) -> None:
    """An environment is reset with the record of the prompt as the policy reads it: rendered
    in the chat template, or with the suffix after it; the tool still holds the task's key."""
    cfg = load_config("configs/tool_tiny.yaml", overrides)
    tokenizer = chat_tokenizer() if cfg.data.chat_template else build_task_tokenizer()
    record = build_datasets(cfg, tokenizer)[0][0]
    assert record["prompt"] != "821>"  # the task's prompt, as the policy reads it
    s = session(Lookup, record=dict(record))
    assert s.start_step("821+")() == Turn("=6", 0.2, False)


def test_without_the_tool_no_call_reveals_the_value() -> None:
    s = session(LookupWithoutTool)
    assert s.start_step("37+")() == Turn("=", 0.0, False)
    assert s.start_step("+")() == Turn("=", 0.0, False)


def test_lookup_prompts_hold_no_trace_of_their_answer() -> None:
    rng = random.Random(0)
    pairs = [TASKS["lookup"].generate(rng, 2, 4) for _ in range(2000)]
    assert all(prompt.endswith(">") and prompt[:-1].isdigit() for prompt, _ in pairs)
    # The value is drawn independently of the key: guessing by the key scores a tenth.
    guess = sum(digits_in_place(p[:-1], a) for p, a in pairs) / len(pairs)
    assert guess < 0.15


class Raises:
    def reset(self, record):
        pass

    def step(self, action):
        raise RuntimeError("tool crashed\nwith a traceback")


class Hangs:
    def reset(self, record):
        pass

    def step(self, action):
        time.sleep(30)


def test_a_tool_that_raises_or_hangs_ends_only_its_trajectory() -> None:
    crashed = session(Raises)
    assert crashed.start_step("x")() is None
    assert crashed.error == "step raised RuntimeError: tool crashed with a traceback"
    # The timeout fired, not the 30 s call's end: the error says so, and the call was left
    # running (timed_out).
    hung = session(Hangs, timeout_s=0.2)
    assert hung.start_step("x")() is None
    assert hung.error == "step did not return within 0.2 s"
    assert hung.timed_out and not crashed.timed_out


class Database:
    """A tool over a SQLite database opened in ``reset``, its connection kept per thread (as
    database clients keep theirs, in a ``threading.local``)."""

    local = threading.local()

    def __init__(self):
        self.threads = [threading.current_thread()]

    def reset(self, record):
        self.threads.append(threading.current_thread())
        self.local.db = sqlite3.connect(":memory:")
        self.local.db.execute("create table kv (k text, v text)")
        self.local.db.execute(
            "insert into kv values (?, ?)", (record["prompt"][:-1], record["answer"])
        )

    def step(self, action):
        self.threads.append(threading.current_thread())
        row = self.local.db.execute("select v from kv where k = ?", (action,)).fetchone()
        return Turn("=" + (row[0] if row else ""), 0.0, done=False)


def test_an_environment_is_made_reset_and_stepped_in_one_thread() -> None:
    """Each call ran in a thread of its own: every step of an environment with per-thread
    state raised (here ``AttributeError: '_thread._local' object has no attribute 'db'``),
    a tool error that scored every trajectory 0."""
    s = session(Database)
    assert s.start_step("37")() == Turn("=4821", 0.0, False)
    assert s.error is None
    assert s.start_step("38")() == Turn("=", 0.0, False)
    assert len(set(s.env.threads)) == 1 and len(s.env.threads) == 4
    s.close()


class Connected:
    """A tool that keeps one database connection per thread (a client's pool) and the
    trajectory's own data on the environment object, as per-thread state shared by the
    sessions of a thread asks."""

    local = threading.local()

    def __init__(self):
        self.threads = [threading.current_thread()]
        if not hasattr(self.local, "db"):
            self.local.db = sqlite3.connect(":memory:")
            self.local.db.execute("create table kv (owner int, k text, v text)")

    def reset(self, record):
        self.threads.append(threading.current_thread())
        self.local.db.execute(
            "insert into kv values (?, ?, ?)", (id(self), record["prompt"][:-1], record["answer"])
        )

    def step(self, action):
        self.threads.append(threading.current_thread())
        query = "select v from kv where owner = ? and k = ?"
        row = self.local.db.execute(query, (id(self), action)).fetchone()
        return Turn("=" + (row[0] if row else ""), 0.0, done=False)


def test_many_sessions_share_a_bounded_number_of_threads_each_in_one() -> None:
    """Each session had a thread of its own for the whole rollout: 2,048 trajectories held
    2,048 idle threads (200 here), and a container with a low thread limit failed."""
    before = threading.active_count()
    threads = SessionThreads(4, AbandonedCalls(limit=0))
    records = [{"prompt": f"{k}>", "answer": f"{1000 + k}"} for k in range(200)]
    sessions = [session(Connected, threads=threads, record=r) for r in records]
    assert threading.active_count() - before == 4
    for k in (5, 7):  # every session answers from its own data, over its thread's connection
        assert [s.start_step(str(k))() for s in sessions[k - 5 : k + 3]] == [
            Turn("=" if j != k else f"={1000 + k}", 0.0, False) for j in range(k - 5, k + 3)
        ]
    bound = {s.env.threads[0] for s in sessions}
    assert len(bound) == 4
    assert all(len(set(s.env.threads)) == 1 for s in sessions)
    per_thread = [sum(s.env.threads[0] is t for s in sessions) for t in bound]
    assert per_thread == [50] * 4
    for s in sessions:
        s.close()
        s.close()  # closing twice releases its thread once
    assert threading.active_count() - before == 4  # the pool's threads wait for the next batch
    assert session(Connected, threads=threads).env.threads[0] in bound


class Blocks:
    """A tool whose step in one trajectory (prompt "1>") waits until the test lets it."""

    release = threading.Event()
    running = threading.Event()

    def reset(self, record):
        self.key = record["prompt"]
        self.thread = threading.current_thread()

    def step(self, action):
        self.step_thread = threading.current_thread()
        if self.key == "1>":
            self.running.set()
            self.release.wait()
        return Turn(self.key, 0.0, False)


def test_a_call_that_outlives_its_timeout_holds_only_its_threads_sessions() -> None:
    """A call that timed out leaves its thread busy: the sessions bound to it move to a
    fresh thread at their next call without waiting for it, the sessions of the other
    threads go on, new sessions get a fresh thread too, and the held thread ends once its
    call returned and its last session is closed."""
    threads = SessionThreads(2, AbandonedCalls(limit=1))
    records = [{"prompt": f"{k}>", "answer": ""} for k in range(4)]
    Blocks.release.clear()
    s = [session(Blocks, timeout_s=0.5, threads=threads, record=r) for r in records]
    held = s[1].env.thread  # sessions 1 and 3 share a thread, 0 and 2 the other
    assert [x.env.thread for x in s] == [s[0].env.thread, held] * 2
    try:
        assert s[1].start_step("x")() is None and s[1].timed_out
        stuck = s[1]._thread.held
        assert s[3].start_step("x")() == Turn("3>", 0.0, False)  # run at once, in a fresh thread
        moved = s[3].env.step_thread
        assert moved not in (held, s[0].env.thread)
        assert [s[0].start_step("x")(), s[2].start_step("x")()] == [
            Turn("0>", 0.0, False),
            Turn("2>", 0.0, False),
        ]
        fresh = session(Blocks, timeout_s=0.5, threads=threads)
        assert fresh.env.thread == moved  # the fresh thread takes new sessions
        assert fresh.start_step("x")() == Turn("37>", 0.0, False)
        s[1].close()
        s[3].close()
        assert held.is_alive()  # its call still runs
    finally:
        Blocks.release.set()
    assert stuck is not None and stuck.done.wait(timeout=60)  # the held call has returned
    held.join(timeout=60)
    assert not held.is_alive()


def test_a_call_waits_for_its_threads_running_call_without_counting_it() -> None:
    """The timeout counts from a call's start: a call started behind another session's call
    on its thread, which is within its own timeout, waits for it (here longer than its own
    timeout, its answer waited for first) and then gets its whole timeout."""
    threads = SessionThreads(1, AbandonedCalls(limit=0))
    slow = session(Blocks, timeout_s=60, threads=threads, record={"prompt": "1>", "answer": ""})
    quick = session(Blocks, timeout_s=0.2, threads=threads, record={"prompt": "2>", "answer": ""})
    Blocks.release.clear()
    Blocks.running.clear()
    slow_answer = slow.start_step("x")
    quick_answer = quick.start_step("x")
    Blocks.running.wait()
    # The quick call waits longer than its timeout for its thread.
    threading.Timer(1.0, Blocks.release.set).start()
    assert quick_answer() == Turn("2>", 0.0, False)
    assert slow_answer() == Turn("1>", 0.0, False)
    assert quick.error is None and slow.error is None


class Overruns:
    """A tool whose step in trajectory "1>" outlives its timeout and returns before the one
    of trajectory "0>" (on another thread) does."""

    returned = threading.Event()

    def reset(self, record):
        self.key = record["prompt"]

    def step(self, action):
        if self.key == "1>":
            time.sleep(2.0)
            self.returned.set()
        else:
            self.returned.wait()
        return Turn(self.key, 0.0, False)


def test_a_call_is_judged_by_its_own_deadline_whichever_call_is_waited_for() -> None:
    """Calls of a turn run side by side and are waited for in row order: while the caller
    waits for one, another that outlives its timeout is a tool error left running, as it
    is when waited for alone, not an answer taken late because the caller looked at it
    after it returned."""
    threads = SessionThreads(2, AbandonedCalls(limit=1))
    first, late = (
        session(Overruns, timeout_s=t, threads=threads, record={"prompt": f"{k}>", "answer": ""})
        for k, t in ((0, 60), (1, 0.2))
    )
    Overruns.returned.clear()
    answers = [first.start_step("x"), late.start_step("x")]
    assert answers[0]() == Turn("0>", 0.0, False)  # returns after the late call has
    assert answers[1]() is None
    assert late.error == "step did not return within 0.2 s"
    assert late.timed_out  # it still ran at its deadline


class HangsOrOverruns:
    """Trajectory "0>"'s step hangs until the test releases it; "1>"'s outlives its
    timeout, then returns when the test lets it."""

    release, finish = threading.Event(), threading.Event()

    def reset(self, record):
        self.key = record["prompt"]

    def step(self, action):
        (self.release if self.key == "0>" else self.finish).wait()
        return Turn(self.key, 0.0, False)


def test_a_call_left_running_that_returned_before_its_answer_is_taken_is_not_counted() -> None:
    """Both steps outlive their timeout while the caller waits for the first; the second
    returns before the caller takes its answer (it tokenized the first's): only the first
    still runs, within max_abandoned_calls=1. Counting the returned call stopped the run
    with ToolsStuck ("still running in this worker: 2")."""
    threads = SessionThreads(2, AbandonedCalls(limit=1))
    hangs, overruns = (  # the second is judged while the caller waits for the first
        session(HangsOrOverruns, timeout_s=t, threads=threads, record={"prompt": f"{k}>"})
        for k, t in ((0, 0.5), (1, 0.1))
    )
    try:
        answers = [hangs.start_step("x"), overruns.start_step("x")]
        assert answers[0]() is None and hangs.timed_out
        HangsOrOverruns.finish.set()
        while len(threads.running) > 1:  # the second call returns; the first still runs
            time.sleep(0.01)
        assert answers[1]() is None
        assert overruns.timed_out  # left running at its deadline, as the first
    finally:
        HangsOrOverruns.release.set()


class Spins:
    """A tool stuck in a loop, until the test releases it."""

    release = threading.Event()

    def reset(self, record):
        pass

    def step(self, action):
        while not self.release.is_set():
            pass


def test_calls_left_running_past_the_workers_limit_stop_the_run_in_one_line() -> None:
    abandoned = AbandonedCalls(limit=2)
    try:
        for _ in range(2):  # within the limit: tool errors of their trajectories
            assert session(Spins, timeout_s=0.5, abandoned=abandoned).start_step("x")() is None
        with pytest.raises(ToolsStuck) as caught:
            session(Spins, timeout_s=0.5, abandoned=abandoned).start_step("x")()
    finally:
        Spins.release.set()
    assert str(caught.value) == (
        "environment test_environments:Spins, prompt 7: calls that outlived "
        "rollout.multi_turn.tool_timeout_s=0.5 still running in this worker: 3, more than "
        "rollout.multi_turn.max_abandoned_calls=2; a thread cannot be stopped and each one "
        "left running slows every later step: make step return in time (run work that may "
        "hang in a process it can kill)"
    )


class Finishes:
    """A slow tool whose calls end once the test lets them."""

    release = threading.Event()
    threads: ClassVar[list[threading.Thread]] = []

    def reset(self, record):
        pass

    def step(self, action):
        self.threads.append(threading.current_thread())
        self.release.wait()
        return Turn("", 0.0, True)


def test_abandoned_calls_that_finish_no_longer_count() -> None:
    abandoned = AbandonedCalls(limit=1)
    first = session(Finishes, timeout_s=0.5, abandoned=abandoned)
    assert first.start_step("x")() is None
    first.close()
    Finishes.release.set()
    for thread in Finishes.threads:  # the abandoned call returns now, its thread ends
        thread.join()
    Finishes.release.clear()
    try:  # one running again: within the limit of 1
        assert session(Finishes, timeout_s=0.5, abandoned=abandoned).start_step("x")() is None
    finally:
        Finishes.release.set()


@pytest.mark.parametrize(
    ("observation", "message"),
    [
        (
            "=4\ud800",
            "step returned observation '=4\\ud800', not valid text (surrogates not allowed at character 2)",
        ),
        (
            "=4\u00c4<unk>",
            "step returned observation '=4Ä<unk>', which holds characters the tokenizer does not know (they would reach the policy as <unk>)",
        ),
    ],
)
def test_an_observation_the_tokenizer_cannot_encode_is_named(observation, message) -> None:
    tokenizer = build_task_tokenizer()
    s = session(Lookup)
    assert s.observation_ids("=4", tokenizer) == tokenizer.encode("=4", add_special_tokens=False)
    # The unknown token's own text is its characters, as any special token's is.
    assert s.observation_ids("=4<unk>", tokenizer) == tokenizer.encode(
        "=4<unk>", add_special_tokens=False, split_special_tokens=True
    )
    assert tokenizer.unk_token_id not in tokenizer.encode("<unk>", split_special_tokens=True)
    with pytest.raises(EnvironmentBroken) as caught:
        s.observation_ids(observation, tokenizer)
    assert str(caught.value) == f"environment lookup, prompt 7: {message}"


class Echoes:
    """Answers each turn with ``observation`` (the turn's own text when unset)."""

    observation: ClassVar[str | None] = None

    def reset(self, record: dict) -> None:
        pass

    def step(self, action: str) -> Turn:
        return Turn(self.observation or action, 0.0, done=False)


def test_an_observation_is_tokenized_as_it_follows_the_turn() -> None:
    """Without a chat template an observation is appended to the turn's text: a tokenizer
    that marks a text's first word (SentencePiece's) made ``▁cat`` of ``cat`` alone, which
    reads back with a space the environment did not write (a special token's text in it
    stays characters: test_multi_turn_chat_template.py's forged observations). Mutation: the
    observation tokenized alone -> ``cat? cat``."""
    tokenizer = metaspace_tokenizer()
    s = session(Echoes)
    turn = tokenizer.encode("cat?", add_special_tokens=False)
    observation = s.observation_ids(s.start_step("cat")().observation, tokenizer)
    assert tokenizer.decode(turn + observation) == "cat?cat"


class Refuses:
    """A tokenizer that raises on text it cannot take."""

    unk_token, unk_token_id = None, None
    added_tokens_decoder: ClassVar[dict] = {}

    def encode(self, text, add_special_tokens):
        raise TypeError("TextEncodeInput must be Union[TextInputSequence, Tuple]")


def test_a_tokenizer_that_raises_on_an_observation_blames_the_environment() -> None:
    with pytest.raises(EnvironmentBroken) as caught:
        session(Lookup).observation_ids("=4", Refuses())
    assert str(caught.value) == (
        "environment lookup, prompt 7: step returned observation '=4', which the tokenizer "
        "cannot encode: TypeError: TextEncodeInput must be Union[TextInputSequence, Tuple]"
    )


class Answers:
    answer: object = None

    def reset(self, record):
        pass

    def step(self, action):
        return self.answer


def answering(value: object) -> type:
    return type("Answers", (Answers,), {"answer": value})


class BadReset:
    def reset(self, record):
        raise KeyError("answer")

    def step(self, action):
        return Turn("", 0.0, True)


@pytest.mark.parametrize(
    ("cls", "message"),
    [
        (answering(Turn(b"bytes", 0.0, False)), "an observation of type bytes, not str"),
        (answering(Turn("", 1.5, True)), "reward 1.5; rewards must be in [0, 1]"),
        (answering(Turn("", float("nan"), True)), "reward nan; rewards must be in [0, 1]"),
        (answering(Turn("", "1", True)), "reward '1'; rewards must be in [0, 1]"),
        (answering(Turn("", 0.5, 1)), "done=1; it must be a bool"),
        (answering(("", 0.5, True)), "step returned tuple, not a verlite.envs.Turn"),
    ],
)
def test_an_environment_that_breaks_its_contract_is_named_in_one_line(cls, message) -> None:
    with pytest.raises(EnvironmentBroken) as caught:
        session(cls).start_step("x")()
    text = str(caught.value)
    assert text.startswith("environment test_environments:Answers, prompt 7: step returned")
    assert message in text and "\n" not in text


class BadInit(BadReset):
    def __init__(self):
        raise RuntimeError("no licence")


def test_a_reset_that_raises_stops_the_run_naming_the_prompt() -> None:
    with pytest.raises(EnvironmentBroken, match=r"prompt 7: reset raised KeyError: 'answer'"):
        session(BadReset)
    with pytest.raises(EnvironmentBroken) as caught:
        session(BadInit)
    assert str(caught.value) == (
        "environment test_environments:BadInit, prompt 7: BadInit() raised RuntimeError: no licence"
    )


def test_environments_load_by_name_or_import_path(tmp_path, monkeypatch) -> None:
    assert get_environment("lookup") is Lookup
    (tmp_path / "userenv.py").write_text(
        "class Env:\n    def reset(self, record): pass\n    def step(self, action): pass\n"
        "class NeedsArgs(Env):\n    def __init__(self, table): pass\n"
        "def not_a_class(): pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert get_environment("userenv:Env").__name__ == "Env"
    for spec, message in [
        (
            "lokup",
            "not a registered environment (lookup, lookup_without_tool) nor an import path 'package.module:Class'",
        ),
        ("userenv:NeedsArgs", "must be made without arguments"),
        ("userenv:not_a_class", "is not a class (it is a function)"),
        ("userenv:Missing", "'userenv' has no attribute 'Missing'"),
        ("nosuchmodule:Env", "no module named 'nosuchmodule'"),
    ]:
        with pytest.raises(ConfigError, match=None) as caught:
            get_environment(spec)
        assert message in str(caught.value), str(caught.value)
    sys.modules.pop("userenv", None)


class Gathers:
    """An environment whose making and ``reset`` each wait until those of ``parties``
    trajectories run at once (``barrier``; broken after a few seconds alone), noting the
    thread and prompt of each reset (``resets``)."""

    barrier: threading.Barrier
    resets: ClassVar[list[tuple[threading.Thread, str]]] = []

    def __init__(self):
        self.barrier.wait()

    def reset(self, record):
        self.resets.append((threading.current_thread(), record["prompt"]))
        self.barrier.wait()
        self.prompt = record["prompt"]

    def step(self, action):
        return Turn(self.prompt, 1.0, True)


def test_a_step_makes_and_resets_its_environments_side_by_side() -> None:
    """Each environment was made and reset, and waited for, before the next was begun,
    however many threads the worker had: a 2 s sandbox start cost 128 s a step for 64
    trajectories. Here each thread's calls wait for those of the 3 other threads: one at a
    time, the barrier broke (``BrokenBarrierError``: the run stopped); side by side every
    environment is made and reset, each with its own record, and a thread's resets run in
    row order (8 trajectories on 4 threads)."""
    Gathers.barrier, Gathers.resets[:] = threading.Barrier(4, timeout=5), []
    records = [{"prompt": f"{row}>", "answer": ""} for row in range(8)]
    threads = SessionThreads(4, AbandonedCalls(limit=0))
    sessions = open_sessions(Gathers, records, indices=range(8), timeout_s=30, threads=threads)
    assert [s.start_step("x")() for s in sessions] == [
        Turn(f"{row}>", 1.0, True) for row in range(8)
    ]
    by_thread: dict[threading.Thread, list[int]] = {}
    for thread, prompt in Gathers.resets:
        by_thread.setdefault(thread, []).append(int(prompt[:-1]))
    assert len(by_thread) == 4
    assert all(rows == sorted(rows) for rows in by_thread.values())
    for s in sessions:
        s.close()


class FailsLate:
    """A ``reset`` that raises naming its prompt: prompt 1's only once prompt 3's raised."""

    raised = threading.Event()

    def reset(self, record):
        if record["prompt"] == "1>":
            # Prompt 3's reset runs beside it, in a thread of its own; the cap is a hang
            # guard only, below the resets' 30 s timeout.
            assert self.raised.wait(20)
        elif record["prompt"] == "3>":
            self.raised.set()
        raise RuntimeError(f"no sandbox for {record['prompt']}")

    def step(self, action):
        return Turn("", 0.0, True)


def test_the_first_row_whose_reset_fails_stops_the_run_whichever_failed_first() -> None:
    """The results of a step's resets are taken in row order: prompt 3's raised first, yet
    prompt 1, the first row that failed, is the one named, on every run."""
    FailsLate.raised.clear()
    records = [{"prompt": f"{row}>", "answer": ""} for row in range(1, 5)]
    threads = SessionThreads(4, AbandonedCalls(limit=0))
    with pytest.raises(EnvironmentBroken) as caught:
        open_sessions(FailsLate, records, indices=range(1, 5), timeout_s=30, threads=threads)
    assert str(caught.value) == (
        "environment test_environments:FailsLate, prompt 1: reset raised RuntimeError: "
        "no sandbox for 1>"
    )
    assert FailsLate.raised.is_set()


class MadeInTurn:
    """An environment that cannot be made the first time; the next makings wait for ``go``."""

    go = threading.Event()
    made: ClassVar[list[int]] = []

    def __init__(self):
        if self.made:
            self.go.wait(30)
        self.made.append(len(self.made))
        if len(self.made) == 1:
            raise RuntimeError("no sandbox")

    def step(self, action):
        return Turn("", 0.0, True)


def test_a_step_stopped_by_a_broken_environment_makes_no_more_of_them() -> None:
    """Four trajectories on one thread; the first environment cannot be made. The run stops
    naming it, and the three makings queued behind it are not run (each would start a
    sandbox no session closes): they ran after the error, one after another."""
    MadeInTurn.go.clear()
    MadeInTurn.made.clear()
    records = [{"prompt": f"{row}>", "answer": ""} for row in range(4)]
    threads = SessionThreads(1, AbandonedCalls(limit=0))
    with pytest.raises(EnvironmentBroken, match="prompt 0: MadeInTurn\\(\\) raised RuntimeError"):
        open_sessions(MadeInTurn, records, indices=range(4), timeout_s=30, threads=threads)
    MadeInTurn.go.set()  # the second, if it started as the first failed, is made
    time.sleep(0.5)  # what the thread still had queued would run by now
    assert MadeInTurn.made in ([0], [0, 1])


class HangsInReset:
    """A ``reset`` that hangs for prompt 2 (until ``release``)."""

    release = threading.Event()

    def reset(self, record):
        if record["prompt"] == "2>":
            self.release.wait(30)

    def step(self, action):
        return Turn("", 0.0, True)


def test_a_reset_that_hangs_among_a_steps_resets_stops_the_run_naming_its_prompt() -> None:
    """A step's resets run side by side under the same bound as its steps: the one that
    outlives ``tool_timeout_s`` is left running (counted an abandoned call) and names its
    prompt."""
    HangsInReset.release.clear()
    abandoned = AbandonedCalls(limit=4)
    records = [{"prompt": f"{row}>", "answer": ""} for row in range(4)]
    try:
        with pytest.raises(EnvironmentBroken) as caught:
            open_sessions(
                HangsInReset,
                records,
                indices=range(4),
                timeout_s=0.3,
                threads=SessionThreads(2, abandoned),
            )
        assert str(caught.value) == (
            "environment test_environments:HangsInReset, prompt 2: reset did not return "
            "within 0.3 s"
        )
        assert [c.left_running for c in abandoned._calls] == [True]  # the hung reset
    finally:
        HangsInReset.release.set()


def test_a_call_is_charged_the_time_it_would_take_alone() -> None:
    """A call's timeout counts the time it would have taken alone (``SessionThreads.apply``,
    on given clocks): the wall time less the CPU time the pool's other threads ran meanwhile,
    or its own CPU time where more, and at least its share of the wall time. Charged the
    wall time, 8 steps of 0.2 s of Python each, side by side, each took 1.6 s; charged the
    wall time less the others' CPU time from its start, a stuck call beside calls on several
    cores, or beside a call left running, was never found."""
    threads = SessionThreads(3, AbandonedCalls(limit=3))
    a, b, c = (threads.bind() for _ in range(3))
    calls = [_Call(t, print, (), timeout_s=2.0) for t in (a, b, c)]
    with threads.lock:
        threads.apply(100.0, {a: 0.0, b: 0.0, c: 0.0})
        for call in calls:
            call.started = True
            threads.running.add(call)
        # On three cores (code that releases the lock): its own CPU time, 1 s.
        threads.apply(101.0, {a: 1.0, b: 1.0, c: 1.0})
        assert [x.charged for x in calls] == pytest.approx([1.0] * 3)
        # Turns on the interpreter lock: 0.9 s, 0.3 s of CPU each: 0.3 s alone.
        threads.apply(101.9, {a: 1.3, b: 1.3, c: 1.3})
        assert [x.charged for x in calls] == pytest.approx([1.3] * 3)
        # Waiting while the others wait (a request, a hang): the wall time.
        threads.apply(102.2, {a: 1.3, b: 1.3, c: 1.3})
        assert [x.charged for x in calls] == pytest.approx([1.6] * 3)
        # b and c on two cores, a stuck: nothing it would have spent alone...
        threads.apply(102.5, {a: 1.3, b: 1.6, c: 1.6})
        assert calls[0].charged == pytest.approx(1.6)
        threads.running -= {calls[1], calls[2]}  # ...and they returned: a owes them nothing
        threads.apply(103.0, {a: 1.3, b: 1.6, c: 1.6})
        assert calls[0].charged == pytest.approx(2.1) and calls[0].overdue
        assert calls[0].left_running and a.held is calls[0]
        # Alone beside a's call, left running and spinning on: a stuck call of b's is
        # charged its share of the wall time, all of it.
        stuck = _Call(b, print, (), timeout_s=2.0)
        stuck.started = True
        threads.running.add(stuck)
        threads.apply(103.6, {a: 1.9, b: 1.6, c: 1.6})
        assert stuck.charged == pytest.approx(0.6)


def two_started_calls(*, at: float) -> tuple[SessionThreads, _Thread, _Thread, list[_Call]]:
    """A pool of two threads, each running a call of 2 s started (and first charged) at ``at``
    seconds of a fake clock, no CPU used yet."""
    threads = SessionThreads(2, AbandonedCalls(limit=2))
    a, b = (threads.bind() for _ in range(2))
    calls = [_Call(t, print, (), timeout_s=2.0) for t in (a, b)]
    with threads.lock:
        threads.apply(at, {a: 0.0, b: 0.0})
        for call in calls:
            call.started = True
            threads.running.add(call)
    return threads, a, b, calls


@pytest.mark.parametrize("serve_first", [True, False])
def test_a_call_that_returned_is_judged_by_its_charge_up_to_its_return(serve_first: bool) -> None:
    """Two calls of 2 s started at 100 s return at 101.9 s and 102.1 s; the pool is charged
    at 102.5 s, by their threads recording their outcomes or by a waiter before they do.
    Either way the first returned within its budget ("ok") and the second late, neither
    left running: charged to 102.5 s before its outcome was recorded, the first was overdue
    and both counted as left running, their threads retired."""
    threads, a, b, calls = two_started_calls(at=100.0)
    with threads.lock:
        for call, returned_at in zip(calls, (101.9, 102.1), strict=True):
            call.returned_at = returned_at
            if serve_first:
                call.outcome = ("ok", None)
        threads.apply(102.5, {a: 0.0, b: 0.0})
        for call in calls:
            call.outcome = ("ok", None)
            threads.running.discard(call)
        threads.apply(102.6, {a: 0.0, b: 0.0})
    assert [c.charged for c in calls] == pytest.approx([1.9, 2.1])
    assert [(c.overdue, c.left_running) for c in calls] == [(False, False), (True, False)]
    assert a.held is None and b.held is None and not a.retired and not b.retired
    assert threads.wait(calls[0]) == ("ok", None)
    assert threads.wait(calls[1]) == ("timeout", calls[1])


@pytest.mark.parametrize("intervals", [1, 2, 200])
def test_a_calls_charge_does_not_depend_on_how_often_it_is_charged(intervals: int) -> None:
    """Two calls taking turns on the interpreter lock for 1 s, 0.5 s of CPU each: each is
    charged 0.5 s, charged once or at every turn (a share taken per interval charged 0.75 s
    at 5 ms turns: other calls' starts and returns charge the pool)."""
    threads, a, b, calls = two_started_calls(at=0.0)
    with threads.lock:
        for i in range(1, intervals + 1):  # a runs the odd turns, b the even ones
            if intervals == 1:
                threads.apply(1.0, {a: 0.5, b: 0.5})
            else:
                threads.apply(i / intervals, {a: (i + 1) // 2 / intervals, b: i // 2 / intervals})
    assert [x.charged for x in calls] == pytest.approx([0.5, 0.5], abs=0.01)


class Computes:
    """A step that computes in Python for 0.2 s of its thread's CPU time."""

    def reset(self, record):
        pass

    def step(self, action):
        start = time.thread_time()
        while time.thread_time() - start < 0.2:
            pass
        return Turn("", 0.0, False)


@pytest.mark.cluster  # timing-sensitive on a loaded machine: with make test-cluster
def test_steps_that_compute_in_python_side_by_side_are_not_timed_out_for_their_turns() -> None:
    """8 steps of 0.2 s of Python each, on 8 threads, within a 1 s timeout: side by side
    each took about 1.6 s of wall time, and every one was a tool error."""
    threads = SessionThreads(8, AbandonedCalls(limit=8))
    sessions = [session(Computes, timeout_s=1.0, threads=threads) for _ in range(8)]
    answers = [s.start_step("x") for s in sessions]
    assert [answer() for answer in answers] == [Turn("", 0.0, False)] * 8
