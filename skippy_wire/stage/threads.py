"""How many compute threads a stage runs when not told, and when a count is too many."""

from __future__ import annotations

import numbers
import os

#: A thread count that asks for :func:`default_threads` (``-t -1``, a topology file's
#: ``"threads": -1``), as llama.cpp spells "the default".
DEFAULT_THREADS = -1
#: The most compute threads a stage takes: ggml's ``GGML_MAX_N_THREADS`` (ggml.h).
MAX_THREADS = 512


def default_threads() -> int:
    """Compute threads per stage when not given: 1.

    ggml's CPU threads meet at a spinning barrier after every graph node, so a
    multi-threaded stage collapses as soon as the cores are oversubscribed (another stage,
    another process): on the 2 shared cores of the CI machine SmolLM2 decodes at ~60 tok/s
    with 1 thread and under 1 tok/s with 2 threads while other jobs run.  ``--threads``
    raises it on a machine with cores to spare.
    """
    return 1


def resolved_threads(threads: int | None) -> int:
    """``threads`` for a stage an embedder starts: None is :func:`default_threads`; anything
    else is an integer (numpy's are; TypeError) from 1 to :data:`MAX_THREADS` (0 is no
    default: ValueError, as ``-t 0``)."""
    if threads is None:
        return default_threads()
    # numbers.Integral, not the wire's integer check: the CLI reads this module before a
    # stage asks for its scheduler slice, and that check's numpy would start threads first
    if isinstance(threads, bool) or not isinstance(threads, numbers.Integral):
        raise TypeError(f"threads must be an int or None, not {type(threads).__name__}")
    if not 1 <= threads <= MAX_THREADS:
        raise ValueError(f"threads must be between 1 and {MAX_THREADS} (None: the default), got {threads!r}")
    return int(threads)


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask: containers, taskset)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def oversubscription(threads: int | None) -> str | None:
    """What to warn of when ``threads`` compute threads are more than the CPUs this process
    may use: ggml's threads meet at a spinning barrier after every graph node, so each waits
    for one that has no CPU (on 2 CPUs, 3 threads decode some 400 times slower); None when
    they fit."""
    cpus = available_cpus()
    if threads is None or threads <= cpus:
        return None
    return (f"{threads} compute threads are more than the {cpus} CPUs this process may use: they take turns "
            "at every step and compute far slower than one thread")
