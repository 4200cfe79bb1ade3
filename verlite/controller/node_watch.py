"""The last word of a driver that Ray ended: run as a script (standard library only) beside a
driver that started an embedded Ray.

When a process the embedded node cannot run without (its raylet, its GCS) exits, Ray's core
ends the driver at its next object-store access with a bare exit code 1 (``QuickExit``, no
Python cleanup, nothing on the console). The driver cannot say why; this watcher can. It waits
on the driver and on the node's vital processes (pidfds: woken the moment one exits) and on a
pipe from the driver, which writes ``stop`` before it shuts Ray down on purpose, and before
that, as JSON on a line of its own, what a new run of its output folder does (again each
time that changes; before the driver changes the folder, what it does once that change is
made too, and the paths whose presence says it is made: :func:`what_a_new_run_does` reads
them when it speaks, so a loss between the change and the driver's next word is said right).
If a vital process exits and the driver then ends without having written ``stop``, it prints
its message (given by the driver, ``{gone}`` naming what exited), followed by the latest of
those lines, to the standard error the two share. A driver that ends first, or says
``stop``, leaves it silent.

Usage: ``python -I node_watch.py DRIVER_PID MESSAGE NAME=PID [NAME=PID ...]``
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
from typing import Any

STOP = b"stop"


def what_a_new_run_does(told: str | dict[str, Any]) -> str:
    """The line the driver told last, as the folder is now: the line, or, told before a change
    of the folder, ``{"now", "once", "present", "then"}``: ``then`` once any of the paths
    ``once`` exists (``present``) or once none does, ``now`` until then."""
    if isinstance(told, str):
        return told
    made = any(os.path.lexists(path) for path in told["once"]) == told["present"]
    return str(told["then"] if made else told["now"])


def watch(driver: int, message: str, vital: dict[str, int]) -> None:
    try:
        driver_fd = os.pidfd_open(driver)
    except OSError:  # the driver ended before this watcher started, or no pidfds (Linux < 5.3)
        return
    if os.getppid() != driver:
        return
    vital_fds, gone = {}, []
    for name, pid in vital.items():
        try:
            vital_fds[os.pidfd_open(pid)] = name
        except ProcessLookupError:  # exited (and reaped) before this watcher started
            gone.append(name)
        except OSError:  # cannot be watched: stay silent rather than guess
            return
    stdin, unread, next_step = sys.stdin.fileno(), b"", None
    while True:
        ready, _, _ = select.select([stdin, driver_fd, *vital_fds], [], [])
        gone += [vital_fds.pop(fd) for fd in ready if fd in vital_fds]
        ended = driver_fd in ready
        if stdin in ready:
            chunk = os.read(stdin, 1 << 16)
            ended = ended or not chunk  # the driver ended (its pipe closed)
            *lines, unread = (unread + chunk).split(b"\n")
            if STOP in lines or unread == STOP:
                return  # the driver shuts its Ray down on purpose and speaks for itself
            next_step = json.loads(lines[-1]) if lines else next_step
        if ended:
            if gone:
                said = message.format(gone=", ".join(gone))
                if next_step is not None:
                    said = f"{said}; {what_a_new_run_does(next_step)}"
                print(said, file=sys.stderr, flush=True)
            return


def main(argv: list[str]) -> None:
    # Its own session keeps a Ctrl-C in the terminal from reaching it: the driver decides.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    driver, message, *pairs = argv
    vital = {name: int(pid) for name, _, pid in (pair.partition("=") for pair in pairs)}
    watch(int(driver), message, vital)


if __name__ == "__main__":
    main(sys.argv[1:])
