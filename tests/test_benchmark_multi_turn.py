"""``benchmarks/multi_turn.py``: runs on tiny shapes, and its environment threads are those of
one pool per thread count, as a worker keeps one for its run, whatever the repetitions."""

import json
import sys
import threading

import pytest

from benchmarks import multi_turn


def test_the_benchmark_leaves_one_pool_of_threads_per_thread_count(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A pool made for each run (a warm-up and two repetitions of each of the two variants
    with a tool latency) left its threads waiting for sessions that never came: 3 x (2 + 1)."""
    before = set(threading.enumerate())
    argv = ["--rows", "2", "--turns", "2", "--turn", "2", "--observation", "1", "--repeats", "2"]
    argv += ["--tool-latency-s", "0.001", "--env-threads", "2"]
    monkeypatch.setattr(sys, "argv", ["multi_turn", *argv])
    multi_turn.main()
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(result["tokens_per_s"]) == {"single_turn", "multi_turn", "multi_turn_one_thread"}
    assert result["benchmark"] == "multi_turn" and result["trajectory_tokens"] == 2 * 2 + 1
    left = [t for t in set(threading.enumerate()) - before if t.name.startswith("verlite-env-")]
    assert len(left) == 2 + 1  # the pool of 2 threads, the pool of 1
