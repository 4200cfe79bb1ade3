"""The shell command a verlite job runs on the head: ``verlite ARGS``, found whatever the
head's PATH, and shown back as that command; and the job's output made UTF-8 text, the only
log Ray's job server can read back."""

from __future__ import annotations

import codecs
import io
import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Sequence

# Set by the entrypoint: `verlite` then runs its command in a child and copies the output.
UTF8_OUTPUT_ENV = "VERLITE_JOB_UTF8_OUTPUT"
_ESCAPED = re.compile("[\udc80-\udcff]")  # an undecodable byte, as surrogateescape keeps it

# Ray's job supervisor runs the entrypoint with `sh -c` and the PATH of the shell that ran
# `ray start`. A head started as `/venv/bin/ray start` without activating the virtualenv has no
# `verlite` on that PATH; its environment is still named by the Python running the supervisor
# (the entrypoint shell's parent), whose memory maps `<env>/lib/pythonX.Y/site-packages/ray/
# _raylet.so`, and `<env>/bin/verlite` is the command. Where neither finds one, the job's log
# says so in one line: no /proc (not Linux), verlite not installed there, a Python under
# lib64/ or named python3.Xt, a path with " /" in it, or a _raylet.so replaced on disk while
# the head runs.
FIND_VERLITE = (
    'v=$(command -v verlite || sed -n "s#^.* \\(/.*\\)/lib/python[0-9.]*/site-packages/ray/'
    '_raylet[.]so\\$#\\1/bin/verlite#p" /proc/$PPID/maps 2>/dev/null | head -n 1); '
    '[ -x "$v" ] || { echo "verlite: error: the Ray head has no verlite command on its PATH '
    "($PATH) nor beside the Python running its jobs; start Ray from the environment verlite is "
    'installed in (activate its virtualenv, or put its bin/ on PATH)" >&2; exit 127; }; '
    f'{UTF8_OUTPUT_ENV}=1 exec "$v" '
)


def job_entrypoint(args: Sequence[str]) -> str:
    """The shell command that runs ``verlite ARGS`` on the head, whatever its PATH."""
    return FIND_VERLITE + shlex.join(args)


def shown_command(entrypoint: str) -> str:
    """A verlite job's entrypoint as the command it runs (``verlite train ...``); any other
    entrypoint as it is."""
    if entrypoint.startswith(FIND_VERLITE):
        return "verlite " + entrypoint.removeprefix(FIND_VERLITE)
    return entrypoint


def run_with_utf8_output(command: Sequence[str]) -> int:
    """Run ``command`` (the job's ``verlite ARGS``) in a child and copy its stdout and stderr,
    merged as Ray's job log merges them, to this stdout as UTF-8 text: a byte that is not
    UTF-8 (a user's print of raw bytes, a tool's binary output) becomes U+FFFD, and one line
    at the end says so. Ray's job server reads a job's log as UTF-8 and fails on anything
    else: the log would end where the byte is while followed, and be unreadable after, its
    metrics with it. Returns the child's exit code (128 + N for a signal N)."""
    # Ray stops a job by signalling the entrypoint and all its children: the child ends as
    # it does on SIGTERM, and this process copies what it writes until then. (A handler, not
    # SIG_IGN, which the child would inherit.)
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    env = {k: v for k, v in os.environ.items() if k != UTF8_OUTPUT_ENV}
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    # Popen's default bufsize (-1) wraps the pipe in a BufferedReader, whose read1 returns
    # what the pipe holds without waiting for a full chunk.
    assert isinstance(child.stdout, io.BufferedReader)
    replaced = 0
    # An incremental decoder keeps a character split over two reads until it is complete.
    decoder = codecs.getincrementaldecoder("utf-8")("surrogateescape")
    out = sys.stdout.buffer
    while True:
        chunk = child.stdout.read1(1 << 16)
        text = decoder.decode(chunk, final=not chunk)
        replaced += len(_ESCAPED.findall(text))
        out.write(_ESCAPED.sub("\ufffd", text).encode("utf-8"))
        out.flush()
        if not chunk:
            break
    code = child.wait()
    if replaced:
        note = (
            f"\nverlite: the job's output held {replaced} byte(s) that are not UTF-8 text, "
            "shown as \ufffd\n"
        )
        out.write(note.encode("utf-8"))
        out.flush()
    return 128 - code if code < 0 else code
