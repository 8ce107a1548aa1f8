"""Ctrl-C during a long native computation: a command that computes in its own process
(``run --check``, ``bench-backend``) stops at the next graph node, not after the step.

Python runs a signal's handler in the main thread between bytecodes, and that thread is
inside the backend's call (a prefill of thousands of tokens takes tens of seconds) with
the GIL released.  CPython's C-level handler also writes the signal's number to the
wake-up descriptor at once; a watcher thread reads it and sets the backend's interrupt
flag, the computation stops at its next node, and the call's error path runs the signal's
Python handler (KeyboardInterrupt for Ctrl-C, the command's exit for SIGTERM and SIGHUP).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Iterator

from .native import BACKEND

#: The signals whose handlers end a command (Ctrl-C, and SIGTERM / SIGHUP as the commands
#: that clean up handle them).
STOPPING_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP})


@contextlib.contextmanager
def interruptible_compute() -> Iterator[None]:
    """While active, a stopping signal interrupts the backend's computation in progress.
    Outside the main thread, or without the compiled backend, nothing changes."""
    if BACKEND is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)  # CPython's handler must never block on it
    previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            received = os.read(read_end, 64)
            if not received:
                return
            if any(number in STOPPING_SIGNALS for number in received):
                BACKEND.set_interrupted(True)

    watcher = threading.Thread(target=watch, name="interrupt-watch", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous)
        done.set()
        os.write(write_end, b"\0")  # wakes the watcher to see ``done``
        watcher.join(1.0)
        os.close(write_end)
        os.close(read_end)
        BACKEND.set_interrupted(False)
