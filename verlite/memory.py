"""Keep freed memory in the process heap, so the next batch does not fault it in again.

glibc returns every block above its mmap threshold (at most 32 MiB by default) to the OS
when it is freed and trims the heap top above its trim threshold; a step batch of that
size allocated again is then faulted in page by page. On the 2-core test machine that
makes a fresh 64 MB copy cost 20 ms instead of 3 ms (``benchmarks/dispatch.py``
measures the effect on a dispatch). Raising both thresholds to 1 GiB keeps freed blocks
for reuse, as a caching allocator does: a process holds on to up to 1 GiB it has freed
at the top of its heap, and larger blocks are still mapped and unmapped one by one.

Every worker calls :func:`retain_freed_memory` when it starts, and so does the driver
of ``verlite train``. Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes

# mallopt parameters from glibc's malloc.h.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
RETAINED_BYTES = 1 << 30


def retain_freed_memory() -> bool:
    """Raise glibc's trim and mmap thresholds to :data:`RETAINED_BYTES`; whether it took."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return all(
        mallopt(parameter, RETAINED_BYTES) == 1
        for parameter in (_M_MMAP_THRESHOLD, _M_TRIM_THRESHOLD)
    )
