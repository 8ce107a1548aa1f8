"""How a command stops: the signals that end it, handled so that its cleanup runs (stage
processes stopped, temporary files removed) before it exits 130, 143 or 129."""

from __future__ import annotations

import contextlib
import signal
import sys
from concurrent.futures import ProcessPoolExecutor
from typing import Iterator

from ..stage.interrupt import STOP_SIGNALS


@contextlib.contextmanager
def handling_signals(signals, handler) -> Iterator[None]:
    """Inside: ``handler`` for each of ``signals`` not ignored on entry (``nohup``: it stays
    ignored); the previous handlers come back on leaving."""
    previous = {}
    for sig in signals:
        if signal.getsignal(sig) is not signal.SIG_IGN:
            previous[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)


@contextlib.contextmanager
def signals_deferred() -> Iterator[list[int]]:
    """Inside: Ctrl-C, SIGTERM and SIGHUP do not interrupt (a cleanup that must finish, or code
    whose locks an exception raised anywhere could leave held) but are remembered, in the list
    it yields (a loop may look at it to stop early); on leaving, the first one is delivered
    again to the handler it would have met (Ctrl-C raises KeyboardInterrupt there), unless a
    KeyboardInterrupt or SystemExit is already unwinding (the command is stopping anyway).  A
    signal ignored on entry stays ignored."""
    pending: list[int] = []
    with handling_signals(STOP_SIGNALS, lambda signum, _frame: pending.append(signum)):
        yield pending
    if pending and not isinstance(sys.exc_info()[1], (KeyboardInterrupt, SystemExit)):
        signal.raise_signal(pending[0])


@contextlib.contextmanager
def exiting_on_signals() -> Iterator[None]:
    """Inside: SIGTERM and SIGHUP unwind like Ctrl-C, as ``SystemExit(128 + signal)`` raised
    in the main thread, so that ``with``/``finally`` blocks stop stage processes and remove
    temporary files before the command exits 143 or 129.  A signal ignored on entry (``nohup``)
    stays ignored."""

    def on_signal(signum: int, _frame) -> None:
        raise SystemExit(128 + signum)

    with handling_signals((signal.SIGTERM, signal.SIGHUP), on_signal):
        yield


@contextlib.contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """Inside: a stop signal waits, blocked in this thread, and the processes started meanwhile
    begin with them blocked (multiprocessing's resource tracker then keeps SIGHUP so: it ignores
    only SIGINT and SIGTERM, and a group's hang-up killed it); one that came is delivered on
    leaving."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def ignore_stop_signals() -> None:
    """A worker process's initializer: the stop signals are its parent's to act on (a terminal's
    Ctrl-C or hang-up, or ``kill -- -PGID``, reaches every process of the group), which ends
    the workers (:func:`end_workers`)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def end_workers(pool: ProcessPoolExecutor) -> None:
    """On a stop: end the workers of ``pool`` (started with :func:`ignore_stop_signals`) now,
    not after the tasks in flight, and wait for them."""
    procs = list((getattr(pool, "_processes", None) or {}).values())  # no public handle before 3.14
    # Its manager thread closes a wake-up pipe that Python 3.11 writes to unlocked at exit
    # (EBADF): joined below, taken now since shutdown() forgets it (it was never joined).
    manager = getattr(pool, "_executor_manager_thread", None)
    for proc in procs:
        proc.kill()
    pool.shutdown(wait=False, cancel_futures=True)
    for proc in procs:
        proc.join(5)
    if manager is not None and manager.ident is not None:  # never started: no thread to spare
        manager.join(5)


__all__ = ["STOP_SIGNALS", "handling_signals", "signals_deferred", "exiting_on_signals", "ignore_stop_signals",
           "end_workers", "stop_signals_blocked"]
