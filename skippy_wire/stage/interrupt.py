"""Ctrl-C during a long native computation: a command that computes in its own process
(``run --check``, ``cluster --check``, ``bench-backend``) stops at the next graph node, not
after the step.

Python runs a signal's handler in the main thread between bytecodes, and that thread is
inside the backend's call (a prefill of thousands of tokens takes tens of seconds) with
the GIL released.  CPython's C-level handler also writes the signal's number to the
wake-up descriptor at once; a watcher thread reads it and sets the backend's interrupt
flag, the computation stops at its next node, and the call's error path clears the flag
and runs the signal's Python handler (KeyboardInterrupt for Ctrl-C, the command's exit for
SIGTERM and SIGHUP).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Iterator

#: The signals that stop a command: Ctrl-C, and SIGTERM and SIGHUP, which the commands that
#: clean up turn into exits (``tools.signals``).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def interruptible_compute() -> Iterator[None]:
    """While active, a stop signal interrupts the backend's computation in progress (a
    signal whose exception the block catches may leave its next computation interrupted
    too).  Outside the main thread, or without the compiled backend, nothing changes.  A
    wake-up descriptor set before (an event loop's) still gets every signal's byte."""
    from .native import BACKEND  # here: commands import STOP_SIGNALS without loading the backend

    if BACKEND is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    read_end, write_end = os.pipe()
    done = threading.Event()
    watcher = None
    try:
        os.set_blocking(write_end, False)  # CPython's handler must never block on it
        previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)

        def watch() -> None:
            while not done.is_set():
                received = os.read(read_end, 64)
                if not received:
                    return
                if any(number in STOP_SIGNALS for number in received):
                    BACKEND.set_interrupted(True)
                if previous >= 0 and not done.is_set():
                    with contextlib.suppress(OSError):
                        os.write(previous, received)

        try:
            watcher = threading.Thread(target=watch, name="interrupt-watch", daemon=True)
            watcher.start()
            yield
        finally:
            signal.set_wakeup_fd(previous)
    finally:
        BACKEND.set_interrupted(False)
        done.set()
        with contextlib.suppress(OSError):
            os.write(write_end, b"\0")  # wakes the watcher to see ``done``
        if watcher is not None:
            watcher.join(1.0)
        os.close(write_end)
        if watcher is None or not watcher.is_alive():  # else it still reads it: left open
            os.close(read_end)
