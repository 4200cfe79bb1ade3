"""The math reward's verifier process (``reward.fn=math``, :mod:`verlite.rewards.math_answer`).

Run as a script by its path (``python -P math_worker.py``), not imported: it starts in half
a second with math-verify and the standard library alone (verlite's packages would import
torch). Its main thread does nothing else, and the process that started it kills it when a
verification outlives its budget: a computation math-verify cannot interrupt (a long
operation on huge integers holds the interpreter) never blocks the run.

It runs as its own clock too: before each verification it limits its CPU time
(``RLIMIT_CPU``) to what it has used plus twice the budget and a second, which the kernel
enforces by ending it. A process whose driver is alive is killed at the budget first (its
single thread uses no more CPU time than time passes); one whose driver died without
killing it (SIGKILL, the out-of-memory killer) would otherwise compute on for as long as
the answer asks, orphaned (a power tower: hours).

The protocol, one JSON object a line. It says ``{"ready": true}`` once math-verify is
imported; then for each request ``{"gold": ..., "pred": ...}`` (the reference's and the
response's final answers, as text) it answers ``{"parsed": bool, "equal": bool}``: whether
math-verify read the response's answer as an expression, and whether the two are
equivalent; or ``{"error": ...}`` when the reference cannot be read. A request without
``pred`` checks the reference alone (``MathReward.check_reference``, before the run starts):
``{"read": true}``, or the error.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import resource
import sys
from typing import Any

# The most memory the process may map: math-verify's own use is under 100 MiB; a response
# whose answer asks for an enormous number fails inside sympy (scored as not equivalent)
# instead of taking the machine's memory from the run.
MAX_MEMORY_BYTES = 2 * 2**30


def _boxed(answer: str) -> str:
    # An answer's text as math-verify reads a final answer: in \boxed{}, which it takes first.
    return f"\\boxed{{{answer}}}"


def _limit_cpu_time(budget_s: float) -> None:
    """End this process once this verification used twice its budget of CPU time."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    used = usage.ru_utime + usage.ru_stime
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = math.ceil(used + 2 * budget_s) + 1
    resource.setrlimit(
        resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard)
    )


def main() -> None:
    budget_s = float(sys.argv[1])  # a verification's, in seconds (MathReward.budget_s)
    resource.setrlimit(resource.RLIMIT_AS, (MAX_MEMORY_BYTES, MAX_MEMORY_BYTES))
    # Ended by RLIMIT_CPU (SIGXCPU), it would dump a core as large as its memory.
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    # An optional extra (pyproject's ``math``): the driver checked it imports before starting
    # this process.
    import math_verify

    # Its timeouts are off (they use SIGALRM, and the budget is kept by the process that
    # started this one); so is its warning that they are, and its logging of what it failed
    # to parse (a response's text, which may be a megabyte).
    logging.getLogger("math_verify").setLevel(logging.CRITICAL + 1)

    @functools.lru_cache(maxsize=4096)  # a prompt's reference answer, for each of its responses
    def parse_gold(gold: str) -> list[Any]:
        return list(math_verify.parse(_boxed(gold), parsing_timeout=None))

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        _limit_cpu_time(budget_s)
        gold = parse_gold(request["gold"])
        if not gold:
            reply: dict[str, Any] = {
                "error": f"math-verify cannot read the reference answer {request['gold']!r}"
            }
        elif "pred" not in request:  # a reference checked before the run
            reply = {"read": True}
        else:
            pred = math_verify.parse(_boxed(request["pred"]), parsing_timeout=None)
            # Parsed: read as an expression, not only kept as the text it failed to read.
            parsed = any(not isinstance(p, str) for p in pred)
            equal = bool(pred) and bool(math_verify.verify(gold, pred, timeout_seconds=None))
            reply = {"parsed": parsed, "equal": equal}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
