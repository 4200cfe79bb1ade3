"""retain_freed_memory: a freed 64 MB tensor stays in the heap for the next one (glibc's
own accounting, ``mallinfo2``), where by default it goes back to the OS."""

import subprocess
import sys

import pytest

PROBE = """
import ctypes, sys
import torch
from verlite.memory import retain_freed_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
        "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "retain":
    assert retain_freed_memory()
block = torch.ones(16_000_000)  # 64 MB
del block
print(libc.mallinfo2().fordblks)  # free bytes kept in the heap
"""


def free_bytes_kept(mode: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True
    )
    return int(done.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_a_freed_block_stays_in_the_heap_only_when_retained() -> None:
    assert free_bytes_kept("retain") >= 64_000_000
    assert free_bytes_kept("default") < 64_000_000
