"""How many compute threads a stage runs when not told."""

from __future__ import annotations

#: A thread count that asks for :func:`default_threads` (``-t -1``, a topology file's
#: ``"threads": -1``), as llama.cpp spells "the default".
DEFAULT_THREADS = -1


def default_threads() -> int:
    """Compute threads per stage when not given: 1.

    ggml's CPU threads meet at a spinning barrier after every graph node, so a
    multi-threaded stage collapses as soon as the cores are oversubscribed (another stage,
    another process): on the 2 shared cores of the CI machine SmolLM2 decodes at ~60 tok/s
    with 1 thread and under 1 tok/s with 2 threads while other jobs run.  ``--threads``
    raises it on a machine with cores to spare.
    """
    return 1
