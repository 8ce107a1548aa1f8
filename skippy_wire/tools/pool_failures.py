"""What breaks a process pool (``verify-exhaustive``'s workers), said in one line: a thread
the pool's manager could not start (``ulimit -u``) is the machine's limit, not a worker that
ended; Python 3.11 and 3.12 tell it in different ways."""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures.process import BrokenProcessPool

from ..errors import ToolError


@contextlib.contextmanager
def thread_failures_kept():
    """Keep what ends a thread (``threading.excepthook``) instead of printing its traceback:
    before Python 3.12 a pool whose manager thread cannot start a thread (``ulimit -u``)
    dies that way and never settles its futures, so the waiting loop must see it."""
    kept: list[BaseException] = []
    printing = threading.excepthook
    threading.excepthook = lambda failed: kept.append(failed.exc_value or failed.exc_type())
    try:
        yield kept
    finally:
        threading.excepthook = printing


def raise_what_broke_the_pool(exc: BrokenProcessPool) -> None:
    """Raise what broke the pool when it was the pool's own manager thread, not a worker
    that ended: from Python 3.12 that thread keeps its failure as the cause (one it could
    not start under ``ulimit -u``: the one-line "can't start new thread", as before 3.12)."""
    if exc.__cause__ is None:  # a worker ended
        return
    lines = [line for line in str(exc.__cause__).splitlines() if line.strip(" '\"")]
    last = lines[-1] if lines else "?"
    if last == "RuntimeError: can't start new thread":
        raise RuntimeError("can't start new thread")
    raise ToolError(f"the worker pool failed: {last}")


__all__ = ["raise_what_broke_the_pool", "thread_failures_kept"]
