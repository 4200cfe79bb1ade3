"""node_watch.py, the watcher that says why Ray ended a driver whose embedded node lost its
raylet or GCS: real processes (a driver, a stand-in vital process, the watcher script), no Ray."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from verlite.controller import session

DRIVER = textwrap.dedent(
    """
    import os, subprocess, sys
    vital = subprocess.Popen(["sleep", "60"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    watcher = subprocess.Popen(
        [sys.executable, "-I", sys.argv[1], str(os.getpid()), "gone: {gone}", f"raylet={vital.pid}"],
        stdin=subprocess.PIPE,
    )
    print(vital.pid, flush=True)

    def pidfds():  # the watcher's open pidfds (its files come and go while it starts)
        fds = f"/proc/{watcher.pid}/fd"
        links = []
        for fd in os.listdir(fds):
            try:
                links.append(os.readlink(f"{fds}/{fd}"))
            except FileNotFoundError:
                pass
        return links.count("anon_inode:[pidfd]")

    while pidfds() < 2:
        pass  # until the watcher waits on the driver and the vital process
    if sys.argv[2] == "told":  # what a new run does, told twice through session's function
        from verlite.controller import session
        session._watcher = watcher
        session.say_after_node_loss("no checkpoint saved: a new run starts afresh")
        session.say_after_node_loss("a new run continues from /runs/a\\nb/step_4")
    if sys.argv[2] in ("changed", "unchanged"):  # told before a change of the folder
        from pathlib import Path
        from verlite.controller import session
        session._watcher = watcher
        mark = Path(sys.argv[3])
        session.say_after_node_loss("continues from step_3", once=([mark], True, "continues from step_6"))
        if sys.argv[2] == "changed":
            mark.mkdir()  # the checkpoint renamed into place; the node lost before another word
    if sys.argv[2] != "driver first":
        vital.kill()
        vital.wait()
    if sys.argv[2] == "stop":
        watcher.stdin.write(b"stop")
        watcher.stdin.close()
        watcher.wait()
    os._exit(1)  # as Ray's QuickExit: no cleanup, nothing said
    """
)


def run_driver(case: str, *extra: str) -> str:
    """Run the driver for ``case`` and return what reached its standard error (the watcher's
    too: ``communicate`` waits until the watcher, which shares it, has exited)."""
    script = str(Path(session.__file__).with_name("node_watch.py"))
    proc = subprocess.Popen(
        [sys.executable, "-c", DRIVER, script, case, *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    vital = int(proc.stdout.readline())  # type: ignore[union-attr]
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1
    if case == "driver first":
        subprocess.run(["kill", "-9", str(vital)], check=False)
    return stderr


def test_a_driver_ended_after_its_vital_process_gets_the_watchers_line() -> None:
    assert run_driver("vital first").splitlines() == ["gone: raylet"]


def test_the_watchers_line_says_what_it_was_told_last_about_a_new_run() -> None:
    # It said "a new `verlite train` with trainer.resume=auto continues from the latest
    # checkpoint" whatever the run's folder held; the driver now tells it as that changes.
    assert run_driver("told") == "gone: raylet; a new run continues from /runs/a\nb/step_4\n"


@pytest.mark.parametrize("case", ["changed", "unchanged"])
def test_the_watcher_says_what_the_folder_holds_when_it_speaks(tmp_path: Path, case: str) -> None:
    # Told only after a checkpoint was placed, a node lost in between named the one before.
    # Told before the change too, with the path that marks it made, it looks when it speaks.
    said = run_driver(case, str(tmp_path / "step_6"))
    assert said == f"gone: raylet; continues from step_{6 if case == 'changed' else 3}\n"


@pytest.mark.parametrize("case", ["stop", "driver first"])
def test_the_watcher_is_silent_when_the_driver_stops_on_purpose_or_ends_first(case: str) -> None:
    assert run_driver(case) == ""
