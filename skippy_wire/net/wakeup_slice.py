"""A short scheduler slice for a stage's and a server's threads, so that a woken thread runs soon.

A stage process is one compute thread at a time among several connection threads, and a
thread woken by another of the process (the GIL handed over, a step's result, a reply on a
socket) is queued on the waker's CPU.  Linux's fair scheduler (EEVDF) then lets the running
thread -- often the one that has just started a decode step's compute -- finish its slice
first (a few ms) before the woken one runs, even when the other CPU is idle: a KVM guest's
idle vCPU reads as preempted and is not chosen.  Four streams through two stages measured
those waits at 150-200 ms per second of decoding in each stage process (docs/benchmarks.md,
twenty-fifth session).  From Linux 6.12 a fair thread may ask for its own slice
(``sched_setattr``'s ``sched_runtime``); asking for the shortest lets a woken thread take
its turn within 0.1 ms.  Threads and processes started later inherit it.  Older kernels
accept and ignore it; other systems are left alone.
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct

#: The slice asked for: the shortest Linux grants (its clamp is 0.1-100 ms).
SHORT_SLICE_NS = 100_000

_SCHED_SETATTR = {"x86_64": 314, "aarch64": 274}  # the syscall's number per architecture
_SCHED_FLAG_KEEP_POLICY = 0x08
_SCHED_ATTR = struct.Struct("=IIQiIQQQ")  # struct sched_attr, SCHED_ATTR_SIZE_VER0


def ask_for_short_slice(slice_ns: int = SHORT_SLICE_NS) -> bool:
    """Ask the kernel for a ``slice_ns`` scheduler slice for the calling thread (and what it
    starts later), keeping its policy and nice value; whether the request was accepted."""
    number = _SCHED_SETATTR.get(platform.machine())
    if number is None or not hasattr(os, "getpriority"):
        return False
    attr = ctypes.create_string_buffer(_SCHED_ATTR.pack(
        _SCHED_ATTR.size, 0, _SCHED_FLAG_KEEP_POLICY, os.getpriority(os.PRIO_PROCESS, 0), 0, slice_ns, 0, 0))
    try:
        return ctypes.CDLL(None, use_errno=True).syscall(number, 0, attr, 0) == 0
    except (OSError, AttributeError):  # no C library to call through
        return False


__all__ = ["SHORT_SLICE_NS", "ask_for_short_slice"]
