"""A stage process bounds glibc's malloc arenas (``serve.bound_malloc_arenas``).

Each connection is served by its own thread, and glibc gives threads that allocate at once
arenas of their own (up to 8 per CPU), where freed session memory stays: rounds of
connection floods took a stage from 112 to 800 MB resident.  Two arenas kept it near 260 MB.
The check counts the heaps glibc reports after threads allocate at once (ctypes calls run
without the GIL, so the threads contend as a stage's do).
"""

from __future__ import annotations

import os
import subprocess
import sys

_COUNT_HEAPS = r"""
import ctypes, sys, tempfile, threading
from skippy_wire.tools import serve
applied = serve.bound_malloc_arenas() if sys.argv[1] == "bound" else None
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.free.argtypes, libc.fopen.restype = ctypes.c_void_p, [ctypes.c_void_p], ctypes.c_void_p
def churn():
    for _ in range(20000):
        libc.free(libc.malloc(512))
threads = [threading.Thread(target=churn) for _ in range(16)]
[t.start() for t in threads]
[t.join() for t in threads]
with tempfile.NamedTemporaryFile("r") as out:
    fp = libc.fopen(out.name.encode(), b"w")
    libc.malloc_info(0, ctypes.c_void_p(fp))
    libc.fclose(ctypes.c_void_p(fp))
    print(applied, out.read().count("<heap nr="))
"""

def _heaps(mode: str, **env) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", _COUNT_HEAPS, mode], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **env}, check=True).stdout.split()
    return out[0], int(out[1])


def test_a_stage_keeps_at_most_two_malloc_arenas():
    assert _heaps("bound") == ("True", 2)
    assert _heaps("free")[1] > 2  # what the threads make of it unbounded: one arena each, up to 8 per CPU


def test_a_user_s_malloc_arena_max_wins():
    applied, heaps = _heaps("bound", MALLOC_ARENA_MAX="3")
    assert applied == "False" and heaps == 3
