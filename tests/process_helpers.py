"""Helpers for tests that start the CLI as a child process."""

from __future__ import annotations

import os
import signal


def default_sigint() -> None:
    """``preexec_fn`` for a child that a test stops with a signal: a runner started in the
    background (``cmd &``) ignores SIGINT, one started under ``nohup`` SIGHUP, and the child
    would inherit that (Python only turns SIGINT into KeyboardInterrupt when it starts with
    the default disposition; the commands leave an ignored SIGHUP ignored, as nohup asks)."""
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGHUP, signal.SIGTERM})


def thread_slices(pid: int) -> set[int]:
    """The scheduler slices (se.slice of /proc/PID/task/TID/sched) of the threads of ``pid``."""
    found = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/sched", encoding="ascii") as fh:
                found |= {int(line.split(":")[1]) for line in fh if line.startswith("se.slice")}
        except (FileNotFoundError, ProcessLookupError):  # the thread ended after the listing (or the open)
            pass
    return found
