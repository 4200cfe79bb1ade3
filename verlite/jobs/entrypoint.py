"""The shell command a verlite job runs on the head: ``verlite ARGS``, found whatever the
head's PATH, and shown back as that command."""

from __future__ import annotations

import shlex
from collections.abc import Sequence

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
    'exec "$v" '
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
